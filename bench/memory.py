"""Benchmark 3: memory per open session, bytes per stored trajectory, store write rate.

Memory: open sessions are built through `Sessions.record`, exactly as the proxy records
turns, and Python's allocations are counted with tracemalloc. The baseline is the record's
information packed as arrays (int32 id, int8 mask, float32 logprob, int32 version: 13 bytes
per token), i.e. what the same content costs without Python objects. Target: at most 2x.

Store: `Store.record_turn` with the proxy's durability (WAL, synchronous=FULL: an fsync per
acknowledged turn) against the same store with synchronous=OFF (no durability) in the same
run, one writer at a time and 64 at once.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import sqlite3
import sys
import time
import tracemalloc

from bench.common import OUT, Section, median, ratio, table, tiny_model
from molt_proxy.rendering import Renders
from molt_proxy.sessions import Sessions
from molt_proxy.stitching import PromptPlan
from molt_proxy.store import Store, StoredTurn
from molt_proxy.tokenizer import Tokenizer
from molt_proxy.types import Generation, ParsedReply, RecordedReply, SessionStatus

PACKED_BYTES_PER_TOKEN = 4 + 1 + 4 + 4


def _render_cache(tokenizer: Tokenizer, turns: int) -> tuple[float, int]:
    """Bytes the render cache (`rendering.Renders`) holds for one conversation of `turns`
    turns (benchmark 2's), per token of its last render, and that token count: each request
    arrives as new objects, as parsed from its body, and only the cache keeps them."""
    from bench.stitching import _REPLY, _USER

    history = [{"role": "system", "content": "You are a careful coding agent."}]
    renders = Renders(tokenizer)
    renders.windows(None, {})  # the probe's result is not the conversation's
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for turn in range(1, turns + 1):
        history.append({"role": "user", "content": _USER.format(turn=turn)})
        text = renders.render(json.loads(json.dumps(history)), None, {})
        history.append({"role": "assistant", "content": _REPLY.format(turn=turn)})
    tokens = len(tokenizer.encode(text))
    del text
    gc.collect()
    held = (
        tracemalloc.get_traced_memory()[0]
        - before
        - sys.getsizeof(history)
        - sum(sys.getsizeof(m) + sum(sys.getsizeof(v) for v in m.values()) for m in history)
    )
    tracemalloc.stop()
    return held / tokens, tokens


def _turn_inputs(tokenizer: Tokenizer, first: bool) -> tuple[PromptPlan, Generation]:
    prompt = tokenizer.encode("<|im_start|>user\nPlease look at the failing test and fix it. " * 4)
    sampled = tokenizer.encode("I changed the assertion and the test passes now. " * 4)
    plan = PromptPlan(prompt, prompt, tokenizer.ids_bytes(prompt), None if first else 0)
    return plan, Generation(sampled, [-0.25] * len(sampled), [0] * len(sampled), "stop")


async def _sessions(tokenizer: Tokenizer, n: int, turns: int) -> dict[str, float]:
    db = OUT / "memory-bench.db"
    for path in OUT.glob("memory-bench.db*"):
        path.unlink()
    store = Store(db)
    await store.open()
    sessions = Sessions(store, tokenizer, "tiny")
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    tokens = 0
    for i in range(n):
        session = await sessions.create(f"s{i}")
        for t in range(turns):
            plan, generation = _turn_inputs(tokenizer, first=t == 0)
            reply = RecordedReply(
                f"c{i}-{t}", 0, "tiny", ParsedReply("ok"), "stop", len(plan.ids), len(generation.token_ids)
            )
            await sessions.record(session, plan, generation, f"h{i}-{t}", reply)
            tokens += len(plan.new_ids) + len(generation.token_ids)
    gc.collect()
    open_bytes = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    turn_bytes, _ = _payload_bytes(db)  # closing a session drops its turn rows
    for i in range(n):
        await sessions.close(f"s{i}", 1.0, {}, SessionStatus.REWARDED)
    await store.close()
    _, trajectory_bytes = _payload_bytes(db)
    return {
        "per_session": open_bytes / n,
        "per_token": open_bytes / tokens,
        "tokens_per_session": tokens / n,
        "disk_turns_per_session": turn_bytes / n,
        "disk_per_trajectory": trajectory_bytes / n,
    }


def _payload_bytes(path: os.PathLike) -> tuple[int, int]:
    """Bytes the store keeps in turn rows (packed arrays, reply JSON) and trajectory rows
    (compressed JSON), as SQLite reports their lengths: payload, without page overhead."""
    db = sqlite3.connect(str(path))
    try:
        turns = db.execute(
            "SELECT sum(length(new_ids) + length(sampled_ids) + length(logprobs) + length(versions)"
            " + length(reply)) FROM turns"
        ).fetchone()[0]
        trajectories = db.execute("SELECT sum(length(data)) FROM trajectories").fetchone()[0]
    finally:
        db.close()
    return turns or 0, trajectories or 0


async def _write_rate(tokenizer: Tokenizer, durable: bool, turns: int, writers: int) -> float:
    """Turns per second through `Store.record_turn`, `writers` at a time."""
    db = OUT / f"store-bench-{durable}.db"
    for path in OUT.glob(f"store-bench-{durable}.db*"):
        path.unlink()
    store = Store(db)
    await store.open()
    if not durable:
        await store._run(store.db.execute, "PRAGMA synchronous=OFF")
    plan, generation = _turn_inputs(tokenizer, first=True)
    reply = RecordedReply("c", 0, "tiny", ParsedReply("ok"), "stop", len(plan.ids), len(generation.token_ids))
    await Sessions(store, tokenizer, "tiny").create("s")  # the turns' session row
    counter = iter(range(turns))

    async def writer() -> None:
        for i in counter:
            turn = StoredTurn(f"c{i}", 0, plan.new_ids, generation, time.time(), "h", reply)
            await store.record_turn("s", turn)

    started = time.perf_counter()
    await asyncio.gather(*(writer() for _ in range(writers)))
    elapsed = time.perf_counter() - started
    await store.close()
    return turns / elapsed


def run(quick: bool = False) -> Section:
    n, turns, repeats, writes = (50, 4, 1, 200) if quick else (200, 4, 3, 600)
    section = Section(
        "memory",
        "3. Memory per session and trajectory; store write throughput",
        "python -m bench memory",
        "memory: the same token record packed as arrays (13 bytes per token); store: the same "
        "`Store.record_turn` with `PRAGMA synchronous=OFF` (no durability), interleaved in the same run.",
    )
    tokenizer = Tokenizer.load(str(tiny_model("qwen3")))
    memory = [asyncio.run(_sessions(tokenizer, n, turns)) for _ in range(repeats)]
    m = {key: median([r[key] for r in memory]) for key in memory[0]}
    packed = m["tokens_per_session"] * PACKED_BYTES_PER_TOKEN
    section.body.append(
        f"{n} sessions of {turns} turns ({m['tokens_per_session']:.0f} tokens each) recorded through "
        f"`Sessions.record` with the real Qwen3 tokenizer; tracemalloc, median of {repeats} runs."
    )
    section.body.append(
        table(
            ["what", "bytes", "packed baseline", "ratio"],
            [
                [
                    "one open session, in memory",
                    f"{m['per_session']:,.0f}",
                    f"{packed:,.0f}",
                    ratio(m["per_session"], packed),
                ],
                [
                    "per token of an open session",
                    f"{m['per_token']:,.1f}",
                    PACKED_BYTES_PER_TOKEN,
                    ratio(m["per_token"], PACKED_BYTES_PER_TOKEN),
                ],
                [
                    "turn rows in SQLite, per open session (payload)",
                    f"{m['disk_turns_per_session']:,.0f}",
                    f"{packed:,.0f}",
                    ratio(m["disk_turns_per_session"], packed),
                ],
                [
                    "one finalized trajectory in SQLite (compressed JSON payload)",
                    f"{m['disk_per_trajectory']:,.0f}",
                    f"{packed:,.0f}",
                    ratio(m["disk_per_trajectory"], packed),
                ],
            ],
        )
    )
    section.body.append(
        "Before the packed record (commit 419f856, 2026-11-29, same bench): 27,859 bytes per open "
        "session, 71.8 per token (5.52× the packed baseline): ids, mask, logprobs and versions "
        "were Python lists."
    )
    cache, cache_tokens = _render_cache(tokenizer, 50 if quick else 200)
    section.body.append(
        f"Beside the session, the render cache (`rendering.py`) keeps the last request of each "
        f"live conversation, its messages and its render, to render the next one incrementally: "
        f"{cache:.1f} bytes per token for benchmark 2's conversation at {cache_tokens:,} tokens "
        "(tracemalloc; the messages as parsed from a request body, which only the cache keeps "
        "once the request is answered)."
    )
    rates: dict[tuple[bool, int], list[float]] = {}
    for _ in range(repeats):
        for writers in (1, 64):
            for durable in (True, False):
                rates.setdefault((durable, writers), []).append(
                    asyncio.run(_write_rate(tokenizer, durable, writes, writers))
                )
    rows = []
    for writers in (1, 64):
        full, off = median(rates[(True, writers)]), median(rates[(False, writers)])
        rows.append([writers, f"{full:,.0f}", f"{off:,.0f}", ratio(full, off)])
    section.body.append(
        f"Store write throughput: {writes} turns of {m['tokens_per_session'] / turns:.0f} tokens "
        f"through `Store.record_turn` (one SQL thread, as in the proxy), median of {repeats} runs, "
        "on this machine's disk."
    )
    section.body.append(
        table(
            ["concurrent writers", "turns/s, synchronous=FULL", "turns/s, synchronous=OFF", "FULL / OFF"],
            rows,
        )
    )
    return section
