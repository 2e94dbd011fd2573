"""Streaming (`stream: true`) through the real proxy, a real vLLM on CPU and the openai SDK:
deltas arrive as vLLM samples, and the record equals the non-streamed one."""

from __future__ import annotations

import json
import re
import time

import httpx
from openai import OpenAI

from devtools import thinking_episode, weather_episode
from tests.helpers import assert_exact, play, trajectories
from tests.inprocess import loaded_tokenizer


def _reward(proxy, session: str) -> None:
    httpx.post(f"{proxy.url}/v1/rewards", json={"session_id": session, "reward": 1.0}).raise_for_status()


def _by_session(proxy) -> dict[str, list[dict]]:
    found: dict[str, list[dict]] = {}
    for trajectory in trajectories(proxy.url):
        found.setdefault(trajectory["session_id"], []).append(trajectory)
    return found


def _assert_same_record(streamed: dict, plain: dict) -> None:
    assert streamed["token_ids"] == plain["token_ids"]
    assert streamed["loss_mask"] == plain["loss_mask"]
    assert streamed["weight_versions"] == plain["weight_versions"]
    for a, b in zip(streamed["logprobs"], plain["logprobs"], strict=True):
        assert abs(a - b) <= 1e-5
    offsets = ("prompt_start", "completion_start", "completion_end", "finish_reason")
    assert [[t[k] for k in offsets] for t in streamed["turns"]] == [
        [t[k] for k in offsets] for t in plain["turns"]
    ]


def test_streamed_tool_episode_records_what_the_non_streamed_one_does(qwen3_model, qwen3_vllm, start_proxy):
    proxy = start_proxy(qwen3_model, qwen3_vllm, "--tool-call-parser", "hermes")
    episode = weather_episode("hermes")
    streamed = play(
        OpenAI(base_url=proxy.base_url("streamed"), api_key="-"), episode, temperature=0, stream=True
    )
    plain = play(OpenAI(base_url=proxy.base_url("plain"), api_key="-"), episode, temperature=0)
    for a, b in zip(streamed.replies, plain.replies, strict=True):
        a_message, b_message = a.choices[0].message, b.choices[0].message
        assert a_message.content == b_message.content
        assert [(c.function.name, c.function.arguments) for c in a_message.tool_calls or []] == [
            (c.function.name, c.function.arguments) for c in b_message.tool_calls or []
        ]
        assert a.choices[0].finish_reason == b.choices[0].finish_reason
        assert a.usage.model_dump() == b.usage.model_dump()
    _reward(proxy, "streamed")
    _reward(proxy, "plain")
    records = _by_session(proxy)
    [streamed_record], [plain_record] = records["streamed"], records["plain"]  # one segment each
    assert [t["completion_id"] for t in streamed_record["turns"]] == [r.id for r in streamed.replies]
    _assert_same_record(streamed_record, plain_record)
    assert_exact(streamed_record, qwen3_model)


def test_deltas_arrive_piece_by_piece(qwen3_model, qwen3_vllm, start_proxy):
    proxy = start_proxy(qwen3_model, qwen3_vllm, "--tool-call-parser", "hermes")
    client = OpenAI(base_url=proxy.base_url("pieces"), api_key="-")
    episode = weather_episode("hermes")
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=episode["messages"][:2], tools=episode["tools"], temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    argument_pieces = [
        call.function.arguments
        for chunk in chunks
        for choice in chunk.choices
        for call in choice.delta.tool_calls or []
        if call.function and call.function.arguments
    ]
    assert len(argument_pieces) > 4  # arguments stream as vLLM samples them, not in one piece
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not [c for c in chunks if c.usage]  # usage only when asked for
    # The second scripted reply is plain content: it streams in several content deltas.
    history = [*episode["messages"][:5]]
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=history,
            tools=episode["tools"],
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    content = episode["messages"][5]["content"]
    assert len(pieces) > 5 and "".join(pieces) == content
    # A busy machine may get several tokens in one delta: count the taught reply's tokens.
    sampled = len(loaded_tokenizer(str(qwen3_model)).encode(content)) + 1  # + <|im_end|>
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == sampled


def test_streamed_reasoning_goes_to_reasoning_content(qwen3_model, qwen3_vllm, start_proxy):
    proxy = start_proxy(qwen3_model, qwen3_vllm, "--reasoning-parser", "qwen3")
    streamed = play(
        OpenAI(base_url=proxy.base_url("think-s"), api_key="-"),
        thinking_episode(),
        temperature=0,
        stream=True,
    )
    plain = play(OpenAI(base_url=proxy.base_url("think-p"), api_key="-"), thinking_episode(), temperature=0)
    for a, b in zip(streamed.replies, plain.replies, strict=True):
        assert a.choices[0].message.model_extra["reasoning_content"] == b.choices[0].message.reasoning_content
        assert a.choices[0].message.content == b.choices[0].message.content
    _reward(proxy, "think-s")
    _reward(proxy, "think-p")
    records = _by_session(proxy)
    for streamed_segment, plain_segment in zip(records["think-s"], records["think-p"], strict=True):
        _assert_same_record(streamed_segment, plain_segment)


def _vllm_gauges(vllm) -> tuple[float, float]:
    """(requests running, generation tokens so far) from vLLM's Prometheus metrics."""
    metrics = httpx.get(f"{vllm.url}/metrics").text

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", metrics, re.M))

    return total("vllm:num_requests_running"), total("vllm:generation_tokens_total")


def test_disconnect_mid_stream_records_nothing_and_aborts_vllm(qwen3_model, qwen3_vllm, start_proxy):
    proxy = start_proxy(qwen3_model, qwen3_vllm)
    path = f"{proxy.url}/s/gone/v1/chat/completions"
    long = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Count."}],
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    # Warm the proxy's streaming path first: a cold one under CI load can take longer to send
    # its first events than the tiny model takes to sample every token, leaving nothing to abort.
    warm = {**long, "max_tokens": 4}
    with httpx.stream("POST", f"{proxy.url}/s/warm/v1/chat/completions", json=warm, timeout=60) as r:
        r.read()
    _, tokens_before = _vllm_gauges(qwen3_vllm)
    with httpx.Client(timeout=60) as client, client.stream("POST", path, json=long) as response:
        assert response.status_code == 200
        data = (line for line in response.iter_lines() if line.startswith("data: "))
        first_events = [json.loads(next(data)[6:]) for _ in range(3)]
        assert first_events[0]["choices"][0]["delta"]["role"] == "assistant"
    # The client is gone: the proxy stops the stream, vLLM aborts, and the turn is not recorded.
    # Had it not aborted, vLLM would run until all 2000 tokens were sampled.
    deadline = time.monotonic() + 60
    while _vllm_gauges(qwen3_vllm)[0] > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1)  # vLLM publishes its counters at the end of each engine step
    running, tokens_after = _vllm_gauges(qwen3_vllm)
    assert running == 0 and tokens_after - tokens_before < 2000
    assert httpx.get(f"{proxy.url}/v1/sessions/gone").json()["segments"] == []
    # The session is free and consistent: the agent's retry is answered and recorded once.
    retry = {**long, "max_tokens": 8}
    with httpx.stream("POST", path, json=retry, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    completion_id = json.loads(lines[0][6:])["id"]
    [segment] = httpx.get(f"{proxy.url}/v1/sessions/gone").json()["segments"]
    assert segment["turns"] == [completion_id] and segment["num_sampled"] == 8


def test_errors_before_the_first_token_are_plain_error_responses(qwen3_model, qwen3_vllm, start_proxy):
    proxy = start_proxy(qwen3_model, qwen3_vllm)
    too_long = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 99999}
    response = httpx.post(f"{proxy.url}/v1/chat/completions", json={**too_long, "stream": True}, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"


def test_retried_stream_replays_the_recorded_reply(qwen3_model, qwen3_vllm, start_proxy):
    proxy = start_proxy(qwen3_model, qwen3_vllm)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True}
    path = f"{proxy.url}/s/replay/v1/chat/completions"

    def events() -> list[dict]:
        with httpx.stream("POST", path, json=body, timeout=60) as response:
            return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]

    first, again = events(), events()
    assert again[0]["id"] == first[0]["id"]
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in first if e["choices"])
    assert again[0]["choices"][0]["delta"]["content"] == text
    [segment] = httpx.get(f"{proxy.url}/v1/sessions/replay").json()["segments"]
    assert segment["turns"] == [first[0]["id"]]
