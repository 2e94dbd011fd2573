"""Test helpers: replay a scripted conversation through a real client, and recompute
logprobs with a float32 `transformers` forward."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import torch
from openai import OpenAI
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from transformers import AutoModelForCausalLM

from devtools import Conversation
from molt_proxy import store


def reply_as_message(message: Any) -> dict[str, Any]:
    """What an agent appends to its history: the reply, unchanged."""
    return message.model_dump(exclude_none=True)


@dataclass
class Run:
    """An agent's state while it plays a script: its history and the replies it got."""

    history: list[dict[str, Any]] = field(default_factory=list)
    replies: list[Any] = field(default_factory=list)
    call_ids: dict[str, str] = field(default_factory=dict)
    position: int = 0


def play(
    client: OpenAI,
    conversation: Conversation,
    *,
    run: Run | None = None,
    replies: int | None = None,
    seed: int = 7,
    echo: Callable[[Any], dict[str, Any]] = reply_as_message,
    **kwargs: Any,
) -> Run:
    """Send the conversation turn by turn, each time with the proxy's actual replies in the
    history (as an agent would: `echo` makes the message it appends of a reply), and check
    every reply against the script. Stops after `replies` more replies (or at the end); pass
    the returned run back to continue."""
    run = run or Run()
    goal = None if replies is None else len(run.replies) + replies
    messages = conversation["messages"]
    while run.position < len(messages) and (goal is None or len(run.replies) < goal):
        scripted = messages[run.position]
        run.position += 1
        if scripted["role"] != "assistant":
            message = dict(scripted)
            if message["role"] == "tool":
                message["tool_call_id"] = run.call_ids[message["tool_call_id"]]
            run.history.append(message)
            continue
        extra = {"tools": conversation["tools"]} if conversation["tools"] else {}
        if kwargs.get("stream"):
            chunks = client.chat.completions.create(
                model="tiny",
                messages=run.history,
                seed=seed,
                max_tokens=200,
                stream_options={"include_usage": True},
                **extra,
                **kwargs,
            )
            reply = completion_from_chunks(list(chunks))
        else:
            reply = client.chat.completions.create(
                model="tiny", messages=run.history, seed=seed, max_tokens=200, **extra, **kwargs
            )
        got = reply.choices[0].message
        expected_calls = scripted.get("tool_calls") or []
        assert [(c.function.name, json.loads(c.function.arguments)) for c in got.tool_calls or []] == [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in expected_calls
        ]
        if scripted.get("reasoning_content"):
            # vLLM's Qwen3 parser keeps the newlines around a `<think>` block; the template
            # strips them again on re-render.
            reasoning = (got.model_extra or {}).get("reasoning_content", "")
            assert reasoning.strip() == scripted["reasoning_content"]
            assert got.content.lstrip("\n") == scripted["content"]
        elif not expected_calls:
            assert got.content == scripted["content"]
        for theirs, ours in zip(expected_calls, got.tool_calls or [], strict=True):
            run.call_ids[theirs["id"]] = ours.id
        run.history.append(echo(got))
        run.replies.append(reply)
    return run


def completion_from_chunks(chunks: list[ChatCompletionChunk]) -> ChatCompletion:
    """Accumulate a streamed reply the way agents do (content and arguments concatenated,
    tool calls by index) into the reply object a non-streaming call returns."""
    message: dict[str, Any] = {"role": "assistant", "content": None}
    calls: dict[int, dict[str, Any]] = {}
    finish_reason, usage = None, None
    for chunk in chunks:
        assert chunk.id == chunks[0].id
        usage = chunk.usage or usage
        for choice in chunk.choices:
            delta = choice.delta
            finish_reason = choice.finish_reason or finish_reason
            if delta.content:
                message["content"] = (message["content"] or "") + delta.content
            reasoning = (delta.model_extra or {}).get("reasoning_content")
            if reasoning:
                message["reasoning_content"] = message.get("reasoning_content", "") + reasoning
            for call in delta.tool_calls or []:
                slot = calls.setdefault(
                    call.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
                )
                slot["id"] += call.id or ""
                slot["function"]["name"] += (call.function and call.function.name) or ""
                slot["function"]["arguments"] += (call.function and call.function.arguments) or ""
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return ChatCompletion.model_validate(
        {
            "id": chunks[0].id,
            "object": "chat.completion",
            "created": chunks[0].created,
            "model": chunks[0].model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
            "usage": usage.model_dump() if usage else None,
        }
    )


def trajectories(proxy_url: str, after: int = 0) -> list[dict[str, Any]]:
    """Every finalized trajectory after `after`, page by page."""
    found: list[dict[str, Any]] = []
    url = f"{proxy_url}/v1/trajectories"
    while data := httpx.get(url, params={"after": after, "limit": 1000}).json()["data"]:
        found += data
        after = data[-1]["seq"]
    return found


@cache
def _load(model_dir: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def forward_logits(model_dir: Path, token_ids: list[int], positions: list[int]) -> torch.Tensor:
    """[len(positions), V] float32 logits that score token p, for each p of `positions`. The
    record goes through in chunks of 1,024 tokens, each attending to the ones before through the
    KV cache, and the LM head runs only where asked: for a 19k-token record (Claude Code's) one
    forward takes 20 s with the tiny Qwen3 model's sliding-window mask, and logits everywhere 11 GiB."""
    model = _load(str(model_dir))
    states, cache = [], None
    with torch.no_grad():
        for start in range(0, len(token_ids), 1024):
            chunk = torch.tensor([token_ids[start : start + 1024]])
            out = model.model(input_ids=chunk, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            states.append(out.last_hidden_state[0])
        hidden = torch.cat(states)[[p - 1 for p in positions]]  # position p - 1 predicts token p
        return model.lm_head(hidden).float()


def forward_logprobs(model_dir: Path, token_ids: list[int], positions: set[int] | None = None) -> list[float]:
    """[T] log p(token_t | tokens_<t) under a float32 forward at `positions` (None: all but 0),
    0.0 elsewhere (`forward_logits`)."""
    wanted = sorted(positions if positions is not None else range(1, len(token_ids)))
    logits = forward_logits(model_dir, token_ids, wanted)
    targets = torch.tensor([token_ids[p] for p in wanted])[:, None]
    chosen = torch.log_softmax(logits, dim=-1).gather(1, targets)
    logprobs = [0.0] * len(token_ids)
    for p, value in zip(wanted, chosen[:, 0].tolist(), strict=True):
        logprobs[p] = value
    return logprobs


def assert_exact(trajectory: dict[str, Any], model_dir: Path, tolerance: float = 1e-4) -> None:
    """The record is internally consistent and its logprobs are the model's own."""
    ids, mask, logprobs = trajectory["token_ids"], trajectory["loss_mask"], trajectory["logprobs"]
    assert len(ids) == len(mask) == len(logprobs) == len(trajectory["weight_versions"])
    sampled = set()
    for turn in trajectory["turns"]:
        assert turn["prompt_start"] <= turn["completion_start"] < turn["completion_end"]
        sampled |= set(range(turn["completion_start"], turn["completion_end"]))
    assert {i for i, m in enumerate(mask) if m} == sampled, "the mask must cover exactly the sampled ids"
    reference = forward_logprobs(model_dir, ids, sampled)
    for i in sorted(sampled):
        assert abs(logprobs[i] - reference[i]) <= tolerance, (i, logprobs[i], reference[i])
    assert all(logprobs[i] == 0.0 for i in range(len(ids)) if not mask[i])
    assert all(trajectory["weight_versions"][i] == -1 for i in range(len(ids)) if not mask[i])


def write_old_store(path: Path, schema: str, reply: str, *, inferred: bool = False) -> None:
    """A store as an earlier version wrote it: `schema`, open session `s` and one turn of it
    (`completion_id` "chatcmpl-old": prompt ids [1, 2], sampled [3] at logprob -0.5 under
    version 0, request hash "h", `reply` as stored JSON)."""
    db = sqlite3.connect(path)
    db.executescript(schema)
    session = "INSERT INTO sessions (id, inferred, status, created) VALUES ('s', ?, 'open', 0)"
    db.execute(session, (int(inferred),))
    db.execute(
        "INSERT INTO turns (completion_id, session_id, segment, new_ids, sampled_ids, logprobs,"
        " versions, finish_reason, created, request_hash, reply)"
        " VALUES ('chatcmpl-old', 's', 0, ?, ?, ?, ?, 'stop', 0, 'h', ?)",
        (
            *(
                store._pack(kind, values)
                for kind, values in (("i", [1, 2]), ("i", [3]), ("d", [-0.5]), ("i", [0]))
            ),
            reply,
        ),
    )
    db.commit()
    db.close()


def write_checkpoint(folder: Path, *, config: bytes | None = None, weights: bytes | None = None) -> Path:
    """A small complete checkpoint (a config and one safetensors file), or a broken one."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_bytes(config if config is not None else b'{"model_type": "qwen3"}')
    if weights is None:
        header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
        weights = struct.pack("<Q", len(header)) + header + bytes(8)
    (folder / "model.safetensors").write_bytes(weights)
    return folder


def reopened(db_path: Path) -> list:
    """What a proxy restarting on the store at `db_path` reads back: its open sessions, each
    with its stored turns."""

    async def reopen() -> list:
        old = store.Store(db_path)
        await old.open()
        try:
            return await old.open_sessions()
        finally:
            await old.close()

    return asyncio.run(reopen())
