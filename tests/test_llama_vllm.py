"""The Llama-3.2 template against a real vLLM on CPU: the taught weather script as one exact
segment through the openai SDK (chat completions) and through the anthropic SDK (Messages).

Kept apart from the Qwen3 files so one worker builds the Llama model and boots its one vLLM
while the other builds the Qwen3 model (`tests/conftest.py`, `SLOW_FIRST`)."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx

from devtools.scripts import weather_episode
from tests.helpers import assert_exact, trajectories
from tests.test_anthropic import ANTHROPIC_WEATHER_TOOL
from tests.test_exactness import episode_is_one_exact_segment


def test_five_turn_tool_episode_is_one_exact_segment(llama_model, llama_vllm, start_proxy):
    proxy = start_proxy(llama_model, llama_vllm, "--tool-call-parser", "llama3_json")
    episode_is_one_exact_segment(proxy, llama_model, weather_episode("llama3_json"), "weather-llama")


def test_anthropic_tool_round_trip_is_one_exact_segment(llama_model, llama_vllm, start_proxy):
    """The Llama-3.2 template on the Anthropic route: its script's tool call and answer through
    the SDK, echoed as the SDK returns them, one exact segment."""
    script = weather_episode("llama3_json")["messages"]
    proxy = start_proxy(llama_model, llama_vllm, "--tool-call-parser", "llama3_json")
    sdk = anthropic.Anthropic(base_url=f"{proxy.url}/s/llama", api_key="-", max_retries=0)
    request: dict[str, Any] = {
        "model": "tiny",
        "max_tokens": 60,
        "extra_body": {"temperature": 0},
        "system": script[0]["content"],
        "tools": [ANTHROPIC_WEATHER_TOOL],
    }
    messages: list[dict[str, Any]] = [{"role": "user", "content": script[1]["content"]}]
    first = sdk.messages.create(**request, messages=messages)
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert (first.stop_reason, use.name, use.input) == ("tool_use", "get_weather", {"city": "Paris"})
    messages.append(
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]}
    )
    result = {"type": "tool_result", "tool_use_id": use.id, "content": script[3]["content"]}
    messages.append({"role": "user", "content": [result]})
    second = sdk.messages.create(**request, messages=messages)
    assert [(b.type, b.text) for b in second.content] == [("text", script[4]["content"])]
    httpx.post(f"{proxy.url}/v1/rewards", json={"session_id": "llama", "reward": 1.0}).raise_for_status()
    [record] = trajectories(proxy.url)
    assert [t["completion_id"].removeprefix("chatcmpl-") for t in record["turns"]] == [
        m.id.removeprefix("msg_") for m in (first, second)
    ]
    assert_exact(record, llama_model)
