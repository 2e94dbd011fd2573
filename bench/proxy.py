"""Benchmark 1a: what a front-end costs per request, on an upstream that costs nothing.

One instant mock vLLM (`bench.mock_upstream`) and, in front of it, each as its own
single-process server: molt-proxy with full recording (render, stitch, SQLite with
synchronous=FULL), a bare FastAPI/uvicorn pass-through (httpx client: the floor the issue
names; aiohttp client: the one molt-proxy uses), and LiteLLM's proxy as an OpenAI
pass-through. `direct` is the load generator talking to the mock itself: "added" latency
is a front-end's latency minus direct's at the same concurrency, in the same repetition.

`MOLT_BENCH_BEFORE=DIR` adds molt-proxy as exported in DIR (an earlier commit, `git archive`),
as `molt-proxy (before)`, so that a change is measured beside what it changed.

Front-ends are measured round-robin, repetition by repetition, so a burst of someone
else's work on this shared machine lands on all of them rather than on one.
"""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from bench.common import (
    HOME,
    OUT,
    PYTHON,
    ROOT,
    Child,
    Section,
    median,
    ms,
    proxy_server,
    ratio,
    table,
    tiny_model,
)
from molt_proxy.launcher import free_port

REPLY = "Sure - here is a short answer, with one new fact about the topic."
LITELLM = HOME / "bench" / ".litellm-venv" / "bin" / "litellm"


@dataclass(slots=True)
class Frontend:
    name: str
    url: str
    api_key: str = "unused"
    pid: int | None = None
    """The front-end's process (its children's CPU counts too); None for `direct`."""

    def cpu_seconds(self) -> float:
        if self.pid is None:
            return float("nan")
        process = psutil.Process(self.pid)
        return sum(sum(p.cpu_times()[:2]) for p in [process, *process.children(recursive=True)])


def commit_seconds(folder: Path, count: int = 100) -> float:
    """Median time of one SQLite commit of a 4 KiB row (WAL, `synchronous=FULL`, as the store)
    on the disk the store writes to: the floor of a durable turn's latency, which a
    pass-through that keeps nothing never pays."""
    path = folder / "commit-probe.db"
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.execute("CREATE TABLE probe (row BLOB)")
    times = []
    for _ in range(count):
        started = time.perf_counter()
        db.execute("BEGIN IMMEDIATE")
        db.execute("INSERT INTO probe VALUES (?)", (b"x" * 4096,))
        db.execute("COMMIT")
        times.append(time.perf_counter() - started)
    db.close()
    for file in folder.glob("commit-probe.db*"):
        file.unlink()
    return median(times)


def mock_reply(model_dir: Path) -> tuple[str, list[int]]:
    """The mock's fixed reply: its text and the ids the model 'sampled' (ending in <|im_end|>)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tokenizer.encode(REPLY, add_special_tokens=False)
    return REPLY, ids + [tokenizer.convert_tokens_to_ids("<|im_end|>")]


def litellm_child(upstream: str, key: str) -> Child:
    config = OUT / "litellm.yaml"
    config.write_text(
        "model_list:\n"
        "  - model_name: tiny\n"
        "    litellm_params:\n"
        "      model: openai/tiny\n"
        f"      api_base: {upstream}/v1\n"
        "      api_key: unused\n"
        "litellm_settings:\n"
        "  telemetry: false\n"
    )
    port = free_port()
    command = [str(LITELLM), "--config", str(config), "--host", "127.0.0.1", "--port", str(port)]
    command += ["--num_workers", "1"]
    # The cost map is bundled; without this flag LiteLLM fetches it from the internet at start.
    env = {"LITELLM_MASTER_KEY": key, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    return Child("litellm", command, f"http://127.0.0.1:{port}", env=env)


def loadgen(frontend: Frontend, concurrency: int, seconds: float, *extra: str) -> dict:
    """One `bench.loadgen` run (its own process); `extra` are more of its flags. `cpu_ms`: the
    front-end's CPU time per request over the whole run (warm-up included, so slightly high)."""
    command = [
        PYTHON,
        "-m",
        "bench.loadgen",
        "--url",
        frontend.url,
        "--concurrency",
        str(concurrency),
        *extra,
    ]
    command += ["--seconds", str(seconds), "--warmup", "2", "--api-key", frontend.api_key]
    cpu = frontend.cpu_seconds()
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=seconds + 120)
    if done.returncode != 0:
        raise RuntimeError(f"loadgen failed: {done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["cpu_ms"] = (frontend.cpu_seconds() - cpu) * 1000 / max(result["total_requests"], 1)
    return result


def warm(frontend: Frontend, model: str = "tiny") -> None:
    """One request before any measurement: first requests pay for lazy imports (molt-proxy
    loads vLLM's parsers on first use) and connection set-up, which no later request does."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    headers = {"authorization": f"Bearer {frontend.api_key}"}
    httpx.post(
        f"{frontend.url}/v1/chat/completions", json=body, headers=headers, timeout=300
    ).raise_for_status()


def streaming_supported(url: str) -> bool:
    """Whether molt-proxy on this checkout accepts `stream: true` (another change adds it)."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30).status_code == 200


CONCURRENCIES = (1, 64, 256)


def start_mock(model: Path, children: list[Child]) -> tuple[Child, list[int]]:
    """The instant mock upstream replying `REPLY` (its ids: the second value), started and added
    to `children`."""
    text, ids = mock_reply(model)
    mock_port = free_port()
    mock = Child(
        "mock-upstream",
        [PYTHON, "-m", "bench.mock_upstream", "--port", str(mock_port), "--reply-text", text]
        + ["--reply-ids", ",".join(map(str, ids))],
        f"http://127.0.0.1:{mock_port}",
    )
    children.append(mock.start())
    return mock, ids


def start_frontends(
    mock: Child,
    model: Path,
    children: list[Child],
    notes: list[str],
    clients: tuple[str, ...] = ("httpx", "aiohttp"),
) -> tuple[list[Frontend], str]:
    """`direct`, the pass-throughs (one per HTTP client in `clients`), molt-proxy (and molt-proxy
    as in `MOLT_BENCH_BEFORE`) and LiteLLM, each started in front of `mock` and added to
    `children`; what could not start goes to `notes`. Also returns molt-proxy's URL."""
    frontends = [Frontend("direct", mock.url)]
    for client in clients:
        port = free_port()
        child = Child(
            f"passthrough-{client}",
            [PYTHON, "-m", "bench.passthrough", "--port", str(port), "--upstream", mock.url]
            + ["--client", client],
            f"http://127.0.0.1:{port}",
        )
        children.append(child.start())
        frontends.append(Frontend(child.name, child.url, pid=child.process.pid))
    db = OUT / "proxy-bench.db"
    for path in OUT.glob("proxy-bench.db*"):
        path.unlink()
    molt = proxy_server("molt-proxy", model, mock.url, db)
    children.append(molt.start())
    frontends.append(Frontend("molt-proxy", molt.url, pid=molt.process.pid))
    before = os.environ.get("MOLT_BENCH_BEFORE")
    if before:
        for path in OUT.glob("proxy-bench-before.db*"):
            path.unlink()
        db_before = OUT / "proxy-bench-before.db"
        old = proxy_server("molt-proxy-before", model, mock.url, db_before, Path(before))
        children.append(old.start())
        frontends.append(Frontend("molt-proxy (before)", old.url, pid=old.process.pid))
    if LITELLM.exists():
        key = "sk-" + secrets.token_hex(24)
        try:
            children.append(litellm_child(mock.url, key).start(health="/health/liveliness"))
            frontends.append(Frontend("litellm", children[-1].url, key, children[-1].process.pid))
        except (RuntimeError, TimeoutError) as exc:
            notes.append(f"LiteLLM did not start here: {exc}")
    else:
        notes.append(f"LiteLLM is not measured: {LITELLM} is missing (run `bash bench/setup_litellm.sh`).")
    return frontends, molt.url


Results = dict[tuple[str, int, bool], list[dict]]


def measure(
    frontends: list[Frontend], modes: list[bool], repeats: int, seconds: float, commits: list[float]
) -> Results:
    """Every front-end at every concurrency in every mode, `repeats` times, round-robin (the
    order rotates each repetition); one SQLite commit probe per repetition into `commits`."""
    results: Results = {}
    for rep in range(repeats):
        commits.append(commit_seconds(OUT))
        order = frontends[rep % len(frontends) :] + frontends[: rep % len(frontends)]
        for streaming in modes:
            for concurrency in CONCURRENCIES:
                for frontend in order:
                    flags = ["--stream"] if streaming else []
                    result = loadgen(frontend, concurrency, seconds, *flags)
                    results.setdefault((frontend.name, concurrency, streaming), []).append(result)
                    print(f"  {frontend.name:>18} c={concurrency:<3} s={streaming:d} {result}", flush=True)
    return results


def tables(frontends: list[Frontend], results: Results, modes: list[bool]) -> list[str]:
    """One table per mode and concurrency: requests/s (and its ratio to the aiohttp
    pass-through), latency, added latency and CPU per request of every front-end."""
    out = []
    for streaming, concurrency in [(m, c) for m in modes for c in CONCURRENCIES]:
        rows = []
        direct = results[("direct", concurrency, streaming)]
        floor = results.get(("passthrough-aiohttp", concurrency, streaming), direct)
        floor_rps = median([r["rps"] for r in floor])
        for frontend in frontends:
            runs = results[(frontend.name, concurrency, streaming)]
            added50 = [r["p50"] - d["p50"] for r, d in zip(runs, direct, strict=True)]
            added99 = [r["p99"] - d["p99"] for r, d in zip(runs, direct, strict=True)]
            rps = median([r["rps"] for r in runs])
            rows.append(
                [
                    frontend.name,
                    f"{rps:,.0f}",
                    ratio(rps, floor_rps),
                    ms(median([r["p50"] for r in runs])),
                    ms(median([r["p99"] for r in runs])),
                    "–" if frontend.name == "direct" else ms(median(added50)),
                    "–" if frontend.name == "direct" else ms(median(added99)),
                    "–" if frontend.name == "direct" else f"{median([r['cpu_ms'] for r in runs]):.2f}",
                    sum(r["errors"] for r in runs),
                ]
            )
        header = [
            "front-end",
            "req/s",
            "req/s vs aiohttp pass-through",
            "p50 ms",
            "p99 ms",
            "added p50 ms",
            "added p99 ms",
            "front-end CPU ms/request",
        ]
        out.append(
            f"**{'Streaming' if streaming else 'Non-streaming'}, {concurrency} concurrent session(s)**\n\n"
            + table(header + ["errors"], rows)
        )
    return out


def rps_ratios(results: Results, modes: list[bool], name: str, baseline: str) -> list[str]:
    """`name` / `baseline` requests/s at each concurrency, one line per mode."""
    lines = []
    for streaming in modes:
        new, old = (
            {c: median([r["rps"] for r in results[(n, c, streaming)]]) for c in CONCURRENCIES}
            for n in (name, baseline)
        )
        mode = "streaming" if streaming else "non-streaming"
        lines.append(
            f"{name} / {baseline} requests/s, {mode}: "
            + ", ".join(f"{c} sessions {ratio(new[c], old[c])}" for c in CONCURRENCIES)
            + "."
        )
    return lines


def run(quick: bool = False) -> Section:
    repeats, seconds = (1, 2.0) if quick else (3, 4.0)
    section = Section(
        "proxy",
        "1a. Proxy overhead on an instant upstream",
        "python -m bench proxy",
        "the same load sent straight to the mock upstream (`direct`) and through bare "
        "FastAPI/uvicorn pass-throughs that record nothing (`passthrough-httpx`, the floor the issue "
        "names, and `passthrough-aiohttp`, the same with molt-proxy's HTTP client: the faster of the "
        "two, so the ratios use it), measured in the same run, round-robin with molt-proxy and LiteLLM.",
    )
    model = tiny_model("qwen3")
    children: list[Child] = []
    notes: list[str] = []
    try:
        mock, ids = start_mock(model, children)
        frontends, molt_url = start_frontends(mock, model, children, notes)
        for frontend in frontends:
            warm(frontend)
        stream = streaming_supported(molt_url)
        modes = [False, True] if stream else [False]
        commits: list[float] = []
        results = measure(frontends, modes, repeats, seconds, commits)
    finally:
        for child in reversed(children):
            child.stop()
    section.body.append(
        f"Each cell: median of {repeats} runs of {seconds:.0f} s or more (after 2 s warm-up; a window "
        "lasts until 2 × C requests completed in it, up to 30 s) by a closed-loop "
        "load generator (`bench/loadgen.py`, its own process) of C concurrent sessions, 5 turns each "
        "with growing history (system + user/assistant pairs), `max_tokens` 16, without and with "
        "`stream: true`; the "
        f"mock replies {len(ids)} tokens. Every front-end is one process. Added latency = "
        "front-end − direct, medians of the same repetition. The load generator, the mock and the "
        "front-end share the 2 cores, so at 64 and 256 sessions every front-end is CPU-bound and "
        "its latency is mostly queueing: compare requests/s there."
    )
    section.body += tables(frontends, results, modes)
    if any(f.name == "litellm" for f in frontends):
        section.body += [
            line.replace("litellm requests/s", "LiteLLM requests/s")
            for line in rps_ratios(results, modes, "molt-proxy", "litellm")
        ]
    if any(f.name == "molt-proxy (before)" for f in frontends):
        section.body += rps_ratios(results, modes, "molt-proxy", "molt-proxy (before)")
    if stream:
        notes.append(STREAMING_NOTE)
    else:
        notes.append(
            "Streaming is not measured: molt-proxy on this checkout answers `stream: true` with 400 "
            "(support is being added in another change)."
        )
    notes.append(durability_note(commits))
    section.body.append("\n".join(f"- {note}" for note in notes))
    return section


STREAMING_NOTE = (
    "Streaming: latency is to the last byte of the reply (`data: [DONE]`); the mock streams "
    "one SSE chunk per token to molt-proxy (vLLM's `/inference/v1/generate` shape) and one per "
    "word on `/v1/chat/completions` to the others, which relay it."
)


def durability_note(commits: list[float]) -> str:
    commit = median(commits)
    return (
        f"Durability's floor: one SQLite commit of a 4 KiB row (WAL, `synchronous=FULL`) on the "
        f"store's disk took {ms(commit)} ms (median of {len(commits)} × 100, measured in this run). "
        "molt-proxy commits every turn before it answers, so one session's turns cannot exceed "
        f"{1 / commit:,.0f} req/s on this disk, whatever the CPU; concurrent sessions share commits "
        "(group commit). The pass-throughs keep nothing and never pay it."
    )
