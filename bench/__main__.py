"""`python -m bench [NAME ...] [--quick]`: run benchmarks and regenerate bench/RESULTS.md.

With no names, every benchmark runs, in order. Each one owns a marked block of RESULTS.md
and replaces only that block, so one benchmark can be rerun alone without losing the others'
figures (each block carries its own command, date, machine, load and code version).

By default the code measured is the last commit (`--code HEAD`), exported with `git archive`
to bench/out/src/<commit> and run from there: several people edit this checkout at once,
and a benchmark of a half-edited working tree measures nothing anyone can reproduce.
`--code worktree` measures the checkout as it is (for trying an uncommitted change).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.common import HOME, OUT, PYTHON, ROOT

BENCHMARKS = {
    "proxy": "bench.proxy",
    "proxy_vllm": "bench.proxy_vllm",
    "stitching": "bench.stitching",
    "memory": "bench.memory",
    "trainer": "bench.trainer_step",
    "refresh": "bench.refresh",
    "e2e": "bench.end_to_end",
    "storage": "bench.storage",
    "stall": "bench.stall",
    "constrained": "bench.constrained",
    "prefix": "bench.prefix",
    "restart": "bench.restart",
    "peers": "bench.peers",
}
RESULTS = HOME / "bench" / "RESULTS.md"
HEADER = """# molt-proxy benchmarks

Regenerate everything with `.venv/bin/python -m bench` (about 25 minutes on 2 cores), or one
block with `.venv/bin/python -m bench NAME` ({names}). Each block names its command, when
it ran, the machine and its load, and the baseline measured beside it in the same run. These
machines are small and shared: read the ratios and medians, not single absolute times.
LiteLLM runs from its own virtual environment (`bash bench/setup_litellm.sh`, see the
`bench` extra in pyproject.toml); `peers` installs Agent Lightning and rLLM's gateway, pinned,
into venvs of their own on its first run.
"""


def _block(name: str, text: str) -> str:
    return f"<!-- bench:{name} -->\n{text}\n<!-- /bench:{name} -->"


def write_block(name: str, text: str) -> None:
    current = RESULTS.read_text() if RESULTS.exists() else HEADER.format(names=", ".join(BENCHMARKS))
    blocks = {
        m.group(1): m.group(0)
        for m in re.finditer(r"<!-- bench:(\w+) -->.*?<!-- /bench:\1 -->", current, flags=re.S)
    }
    blocks[name] = _block(name, text)
    ordered = [blocks[n] for n in BENCHMARKS if n in blocks]
    RESULTS.write_text(HEADER.format(names=", ".join(BENCHMARKS)) + "\n" + "\n\n".join(ordered) + "\n")


def snapshot(ref: str) -> tuple[Path, str]:
    """Export commit `ref` (plus this bench/ folder) to bench/out/src/<sha>; return it and
    a description. `shared` beside it points at ../shared, where the project finds the real
    tokenizers relative to its own files."""
    sha = subprocess.run(
        ["git", "rev-parse", ref], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    subject = subprocess.run(
        ["git", "log", "-1", "--format=%s", sha], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    dest = OUT / "src" / sha[:12]
    if not dest.exists():
        tmp = dest.with_name(dest.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        archive = subprocess.run(["git", "archive", sha], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
        tmp.rename(dest)
    shutil.rmtree(dest / "bench", ignore_errors=True)
    shutil.copytree(
        ROOT / "bench", dest / "bench", ignore=shutil.ignore_patterns("out", ".*-venv", "__pycache__")
    )
    shared = dest.parent / "shared"
    if not shared.exists() and (HOME.parent / "shared").exists():
        shared.symlink_to(HOME.parent / "shared")
    return dest, f"commit {sha[:12]} ({subject!r}), exported with git archive"


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("names", nargs="*", help=f"any of {', '.join(BENCHMARKS)}; default: all")
    parser.add_argument("--quick", action="store_true", help="fewer repeats, for development")
    parser.add_argument("--code", default="HEAD", help="a git ref to measure, or 'worktree'")
    args = parser.parse_args()
    unknown = set(args.names) - set(BENCHMARKS)
    if unknown:
        parser.error(f"unknown benchmark(s) {sorted(unknown)}; choose from {', '.join(BENCHMARKS)}")
    OUT.mkdir(parents=True, exist_ok=True)
    if args.code != "worktree" and "MOLT_BENCH_CODE" not in os.environ:
        src, description = snapshot(args.code)
        env = {
            **os.environ,
            "MOLT_BENCH_HOME": str(HOME),
            "MOLT_BENCH_CODE": description,
            "PYTHONPATH": str(src),
        }
        argv = [PYTHON, "-m", "bench", *args.names] + (["--quick"] if args.quick else [])
        return subprocess.run(argv, cwd=src, env=env).returncode
    failed = []
    for name in args.names or list(BENCHMARKS):
        print(f"== {name}", flush=True)
        started = time.monotonic()
        try:
            section = importlib.import_module(BENCHMARKS[name]).run(quick=args.quick)
        except Exception as exc:  # one broken benchmark must not lose the others' results
            print(f"   {name} failed: {exc!r}", file=sys.stderr, flush=True)
            failed.append(name)
            continue
        text = section.render(time.monotonic() - started)
        if args.quick:
            print(text)
        else:
            write_block(name, text)
        print(f"   {name} done in {time.monotonic() - started:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
