"""Token-exact trajectories through the real proxy, a real vLLM on CPU and the openai SDK."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from openai import OpenAI

from devtools import AGENTS_SDK_WEATHER_TOOL, thinking_episode, weather_episode
from tests.conftest import AppProxy, app_proxy
from tests.helpers import assert_exact, play, trajectories
from tests.inprocess import loaded_tokenizer


@pytest.fixture(scope="module")
def qwen3_hermes(qwen3_model, qwen3_vllm, tmp_path_factory) -> Iterator[AppProxy]:
    """One proxy for the tests that need these same flags; each keeps to its own session."""
    db = tmp_path_factory.mktemp("exactness") / "qwen3-hermes.db"
    with app_proxy(qwen3_model, qwen3_vllm.url, db, ["--tool-call-parser", "hermes"]) as proxy:
        yield proxy


def recorded(proxy: AppProxy, session: str) -> list[dict[str, Any]]:
    return [t for t in trajectories(proxy.url) if t["session_id"] == session]


def _render_first_request(model_dir, conversation) -> list[int]:
    tokenizer = loaded_tokenizer(str(model_dir))
    first_reply = next(i for i, m in enumerate(conversation["messages"]) if m["role"] == "assistant")
    text = tokenizer.render(conversation["messages"][:first_reply], conversation["tools"], {})
    return tokenizer.encode(text)


def episode_is_one_exact_segment(proxy, model_dir, conversation, session: str) -> None:
    client = OpenAI(base_url=proxy.base_url(session), api_key="unused")
    replies = play(client, conversation).replies
    assert len(replies) == 5
    description = httpx.get(f"{proxy.url}/v1/sessions/{session}").json()
    assert len(description["segments"]) == 1, description
    assert (
        httpx.post(f"{proxy.url}/v1/rewards", json={"session_id": session, "reward": 1.0}).status_code == 200
    )
    [trajectory] = recorded(proxy, session)
    assert trajectory["reward"] == 1.0
    assert [t["completion_id"] for t in trajectory["turns"]] == [r.id for r in replies]
    ids = trajectory["token_ids"]
    # The first prompt is exactly the tokenized render; every later prompt the proxy sent is
    # the record so far (vLLM echoed each prompt and the proxy checked it: --verify-prompt-ids).
    first = _render_first_request(model_dir, conversation)
    assert ids[: trajectory["turns"][0]["completion_start"]] == first
    for reply, turn in zip(replies, trajectory["turns"], strict=True):
        assert reply.usage.prompt_tokens == turn["completion_start"]
        assert reply.usage.completion_tokens == turn["completion_end"] - turn["completion_start"]
    assert_exact(trajectory, model_dir)


def test_qwen3_five_turn_tool_episode_is_one_exact_segment(qwen3_model, qwen3_hermes):
    episode_is_one_exact_segment(qwen3_hermes, qwen3_model, weather_episode("hermes"), "weather-qwen3")


def test_qwen3_think_stripping_opens_a_segment_and_both_are_exact(qwen3_model, qwen3_vllm, start_proxy):
    proxy = start_proxy(
        qwen3_model, qwen3_vllm, "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"
    )
    client = OpenAI(base_url=proxy.base_url("thinker"), api_key="unused")
    replies = play(client, thinking_episode()).replies
    httpx.post(f"{proxy.url}/v1/rewards", json={"session_id": "thinker", "reward": 0.5}).raise_for_status()
    first, second = trajectories(proxy.url)
    assert (first["segment"], second["segment"]) == (0, 1)
    assert [t["completion_id"] for t in first["turns"]] == [replies[0].id]
    assert [t["completion_id"] for t in second["turns"]] == [replies[1].id]
    assert first["reward"] == second["reward"] == 0.5
    # The new segment starts from the full re-render, where the first <think> block is gone.
    assert "<think>" not in loaded_tokenizer(str(qwen3_model)).hf.decode(second["token_ids"][:20])
    for trajectory in (first, second):
        assert_exact(trajectory, qwen3_model)


def test_interleaved_sub_agent_is_a_second_exact_segment(qwen3_model, qwen3_hermes):
    """A parent and a sub-agent whose requests render apart (the weather script, and the same
    script with the tool in the Agents SDK's spelling), sending their turns at the same time
    in one session: one chain each, sampled concurrently, continued over its own sampled ids,
    both exact. Both are taught, so each reply is the script's and each echo continues."""
    client = OpenAI(base_url=qwen3_hermes.base_url("interleaved"), api_key="unused")
    parent = weather_episode("hermes")
    sub = {**weather_episode("hermes"), "tools": [AGENTS_SDK_WEATHER_TOOL]}
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda conversation: play(client, conversation, replies=2), [parent, sub]))
    chains = [[reply.id for reply in run.replies] for run in runs]
    segments = httpx.get(f"{qwen3_hermes.url}/v1/sessions/interleaved").json()["segments"]
    assert sorted(s["turns"] for s in segments) == sorted(chains)
    body = {"session_id": "interleaved", "reward": 0.5}
    httpx.post(f"{qwen3_hermes.url}/v1/rewards", json=body).raise_for_status()
    records = recorded(qwen3_hermes, "interleaved")
    assert [(r["segment"], r["num_segments"], r["reward"]) for r in records] == [(0, 2, 0.5), (1, 2, 0.5)]
    for record in records:
        assert_exact(record, qwen3_model)


def test_compacting_agent_opens_a_segment_and_both_are_exact(qwen3_model, qwen3_hermes):
    proxy = qwen3_hermes
    client = OpenAI(base_url=proxy.base_url("compactor"), api_key="unused")
    conversation = weather_episode("hermes")
    history = conversation["messages"][:2]
    first = client.chat.completions.create(
        model="tiny", messages=history, tools=conversation["tools"], seed=7
    )
    # The agent drops its history and continues from a summary: a rewrite, not a continuation.
    compacted = [
        {
            "role": "system",
            "content": "You are a weather assistant. Summary so far: the user asked about Paris.",
        },
        {"role": "user", "content": "Thanks!"},
    ]
    second = client.chat.completions.create(model="tiny", messages=compacted, max_tokens=16, seed=7)
    segments = httpx.get(f"{proxy.url}/v1/sessions/compactor").json()["segments"]
    assert [s["turns"] for s in segments] == [[first.id], [second.id]]
    httpx.post(f"{proxy.url}/v1/rewards", json={"session_id": "compactor", "reward": -1}).raise_for_status()
    records = recorded(proxy, "compactor")
    assert [(r["segment"], r["reward"]) for r in records] == [(0, -1.0), (1, -1.0)]
    tokenizer = loaded_tokenizer(str(qwen3_model))
    assert records[1]["token_ids"][: records[1]["turns"][0]["completion_start"]] == tokenizer.encode(
        tokenizer.render(compacted, None, {})
    )
    for record in records:
        assert_exact(record, qwen3_model)
