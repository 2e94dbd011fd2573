"""Benchmark 8: bytes the store keeps per trajectory token (issue 9: every token was stored twice).

A soak of 1,000 sessions of 5 turns is recorded through `Sessions.record` into a real SQLite
file, exactly as the proxy records turns, then every session is finalized through
`Sessions.close`. Three states of the same data are measured in the same run:

- open: every session still open, so only turn rows (what a restart recovers from);
- the old layout: those turn rows kept *and* each trajectory as plain JSON text, which is
  what the proxy stored before (the open store copied with SQLite's backup API, then the
  same trajectories inserted into the copy as the old code wrote them): the baseline;
- finalized: this proxy's store after closing (trajectories as compressed JSON, turn rows
  dropped, a completion id → session id row per turn, the session rows).

Bytes are SQLite's live pages (`page_count - freelist_count` after a WAL checkpoint, so pages
freed by dropped turn rows, which later rows reuse, do not count), divided by the tokens of
all trajectories. Two data sets: an agent conversation rendered with the real Qwen3 chat
template (varied text, float32 logprobs as vLLM returns them) and random ids with random
logprobs (what compresses worst).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import sqlite3
import struct
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from bench.common import OUT, Section, ratio, table, tiny_model
from molt_proxy.sessions import Sessions
from molt_proxy.stitching import PromptPlan, plan_prompt
from molt_proxy.store import Store
from molt_proxy.tokenizer import Tokenizer
from molt_proxy.types import Generation, ParsedReply, RecordedReply, SessionStatus, Trajectory

TURNS = 5
ISSUE_BYTES_PER_TOKEN = 67.5
"""Issue 9's measurement of the old layout (1,000 sessions through the proxy, mock vLLM)."""

_USER = (
    "Task {task}, step {turn}: the tool returned {n} lines; the build of module m{task} finished "
    "with {w} warnings and the test suite ran {t} tests. What should we do next?"
)
_REPLY = "Fix the {w} warnings in module m{task}, rerun the {t} tests, then report step {turn}."

Turns = Callable[[random.Random, int, int, Sessions], tuple[PromptPlan, list[int]]]
"""(rng, session, turn, registry) → the turn's prompt plan and sampled ids."""


def _float32(value: float) -> float:
    """vLLM's logprobs are float32 values carried as JSON doubles."""
    return struct.unpack("f", struct.pack("f", value))[0]


def _agent(tokenizer: Tokenizer) -> Turns:
    im_end = tokenizer.hf.convert_tokens_to_ids("<|im_end|>")
    histories: dict[int, list[dict[str, str]]] = {}

    def turn(rng: random.Random, i: int, t: int, sessions: Sessions) -> tuple[PromptPlan, list[int]]:
        numbers = {
            "task": i,
            "turn": t,
            "n": rng.randrange(500),
            "w": rng.randrange(9),
            "t": rng.randrange(900),
        }
        messages = histories.setdefault(i, [{"role": "system", "content": "You are a careful coding agent."}])
        messages.append({"role": "user", "content": _USER.format(**numbers)})
        reply = _REPLY.format(**numbers)
        plan = plan_prompt(sessions.get(f"s{i}").segments, tokenizer.render(messages, None, {}), tokenizer)
        messages.append({"role": "assistant", "content": reply})
        return plan, tokenizer.encode(reply) + [im_end]

    return turn


def _random(rng: random.Random, i: int, t: int, sessions: Sessions) -> tuple[PromptPlan, list[int]]:
    prompt = [rng.randrange(150_000) for _ in range(rng.randrange(40, 160))]
    sampled = [rng.randrange(150_000) for _ in range(rng.randrange(20, 120))]
    return PromptPlan(prompt, prompt, sessions.tokenizer.ids_bytes(prompt), 0 if t > 0 else None), sampled


def live_bytes(path: Path) -> int:
    db = sqlite3.connect(path)
    try:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        pages = (
            db.execute("PRAGMA page_count").fetchone()[0] - db.execute("PRAGMA freelist_count").fetchone()[0]
        )
        return pages * db.execute("PRAGMA page_size").fetchone()[0]
    finally:
        db.close()


def _backup(db: sqlite3.Connection, path: Path) -> None:
    target = sqlite3.connect(path)
    try:
        db.backup(target)
    finally:
        target.close()


def _old_layout(open_copy: Path, trajectories: list[Trajectory]) -> int:
    """The open store plus the trajectories as the proxy stored them before: plain JSON text,
    turn rows kept."""
    db = sqlite3.connect(open_copy, isolation_level=None)
    try:
        db.execute("BEGIN")
        db.executemany(
            "INSERT INTO trajectories (seq, trajectory_id, session_id, data) VALUES (?, ?, ?, ?)",
            [(t.seq, t.trajectory_id, t.session_id, json.dumps(t.to_json())) for t in trajectories],
        )
        db.execute("COMMIT")
    finally:
        db.close()
    return live_bytes(open_copy)


async def _soak(tokenizer: Tokenizer, turns: Turns, n: int, name: str) -> dict[str, float]:
    path, copy = OUT / f"storage-{name}.db", OUT / f"storage-{name}-old.db"
    for stale in [*OUT.glob(f"storage-{name}.db*"), *OUT.glob(f"storage-{name}-old.db*")]:
        stale.unlink()
    rng = random.Random(0)
    store = Store(path)
    await store.open()
    sessions = Sessions(store, tokenizer, "tiny")
    for i in range(n):
        session = await sessions.create(f"s{i}")
        for t in range(TURNS):
            plan, sampled = turns(rng, i, t, sessions)
            logprobs = [_float32(-rng.expovariate(2.0)) for _ in sampled]
            generation = Generation(sampled, logprobs, [t // 2] * len(sampled), "stop")
            reply = RecordedReply(  # what the proxy keeps for an idempotent retry
                completion_id=f"chatcmpl-{uuid.UUID(int=rng.getrandbits(128)).hex}",
                created=int(time.time()),
                model="tiny",
                message=ParsedReply(tokenizer.decode(sampled, skip_special_tokens=True)),
                finish_reason="stop",
                prompt_tokens=len(plan.ids),
                completion_tokens=len(sampled),
            )
            request_hash = hashlib.sha256(f"{i}-{t}".encode()).hexdigest()
            await sessions.record(session, plan, generation, request_hash, reply)
    await store._run(_backup, store.db, copy)
    trajectories: list[Trajectory] = []
    for i in range(n):
        trajectories += await sessions.close(f"s{i}", 1.0, {"task": i}, SessionStatus.REWARDED)
    await store.close()
    tokens = sum(len(t.token_ids) for t in trajectories)
    opened = live_bytes(copy)
    return {
        "tokens": tokens,
        "segments": len(trajectories) / n,
        "open": opened / tokens,
        "old": _old_layout(copy, trajectories) / tokens,
        "finalized": live_bytes(path) / tokens,
    }


def run(quick: bool = False) -> Section:
    n = 100 if quick else 1000
    section = Section(
        "storage",
        "8. Bytes stored per trajectory token",
        "python -m bench storage",
        "the same soak in the old layout (turn rows kept beside plain-JSON trajectories, rebuilt in "
        f"the same run from a copy of the open store); issue 9 measured {ISSUE_BYTES_PER_TOKEN} B per "
        "token for it. Target: at most 30 B.",
    )
    tokenizer = Tokenizer.load(str(tiny_model("qwen3")))
    results = {
        "agent conversation (Qwen3 template)": asyncio.run(_soak(tokenizer, _agent(tokenizer), n, "agent")),
        "random ids and logprobs": asyncio.run(_soak(tokenizer, _random, n, "random")),
    }
    section.body.append(
        f"{n:,} sessions of {TURNS} turns recorded through `Sessions.record` (synchronous=FULL, as the "
        "proxy), then all closed through `Sessions.close`. Bytes: SQLite's live pages after a WAL "
        "checkpoint, per token of all trajectories."
    )
    rows = [
        [
            name,
            f"{r['tokens']:,.0f}",
            f"{r['segments']:.1f}",
            f"{r['open']:.1f}",
            f"{r['old']:.1f}",
            f"{r['finalized']:.1f}",
            ratio(r["finalized"], r["old"]),
        ]
        for name, r in results.items()
    ]
    section.body.append(
        table(
            [
                "data",
                "trajectory tokens",
                "segments per session",
                "B/token, all open (turn rows)",
                "B/token, old layout",
                "B/token, finalized",
                "finalized / old",
            ],
            rows,
        )
    )
    return section
