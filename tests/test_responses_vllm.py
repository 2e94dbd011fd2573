"""The OpenAI Responses API against a real vLLM: the taught weather script's tool round trip
through the `openai` SDK's `client.responses`, stateless (the history resent as `input`,
whole and streamed) and stored (`previous_response_id`); one exact segment each, the same
record every way."""

from __future__ import annotations

from typing import Any

import httpx
import openai

from devtools.scripts import weather_episode
from tests.helpers import assert_exact, trajectories
from tests.test_responses import RESPONSES_WEATHER_TOOL

SCRIPT = weather_episode("hermes")["messages"]
ASK = {
    "model": "tiny",
    "instructions": SCRIPT[0]["content"],
    "tools": [RESPONSES_WEATHER_TOOL],
    "temperature": 0,
    "max_output_tokens": 60,
}


def _create(client: openai.OpenAI, stream: bool, **fields: Any) -> tuple[Any, list[str]]:
    """One response; streamed, also the `function_call_arguments.delta` pieces as they came."""
    if not stream:
        return client.responses.create(**ASK, **fields), []
    pieces = []
    with client.responses.stream(**ASK, **fields) as events:
        for event in events:
            if event.type == "response.function_call_arguments.delta":
                pieces.append(event.delta)
        return events.get_final_response(), pieces


def _episode(url: str, stream: bool, stored: bool) -> list[Any]:
    client = openai.OpenAI(base_url=url, api_key="-", max_retries=0)
    question = [{"role": "user", "content": SCRIPT[1]["content"]}]
    first, pieces = _create(client, stream, input=question, store=stored)
    calls = [item for item in first.output if item.type == "function_call"]
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris"}'),
        ("get_weather", '{"city": "London"}'),
    ]
    assert all(c.call_id.startswith("call_") for c in calls) and first.status == "completed"
    if stream:  # the pieces add up to the JSON the model sampled
        assert "".join(pieces) == '{"city": "Paris"}{"city": "London"}' and len(pieces) > 2
    results = [
        {"type": "function_call_output", "call_id": c.call_id, "output": SCRIPT[3 + i]["content"]}
        for i, c in enumerate(calls)
    ]
    if stored:
        second, _ = _create(client, stream, input=results, previous_response_id=first.id)
    else:
        echoed = [item.model_dump(exclude_none=True) for item in first.output]
        second, _ = _create(client, stream, input=[*question, *echoed, *results], store=False)
    assert second.output_text == SCRIPT[5]["content"] and second.status == "completed"
    return [first, second]


def test_tool_round_trip_stateless_stored_and_streamed_is_one_exact_segment(
    qwen3_model, qwen3_vllm, start_proxy
):
    proxy = start_proxy(qwen3_model, qwen3_vllm, "--tool-call-parser", "hermes")
    runs = {
        "plain": _episode(f"{proxy.url}/s/plain/v1", stream=False, stored=False),
        "streamed": _episode(f"{proxy.url}/s/streamed/v1", stream=True, stored=False),
        "stored": _episode(f"{proxy.url}/s/stored/v1", stream=True, stored=True),
    }
    for replies in runs.values():  # rewards may name a response by its id
        httpx.post(
            f"{proxy.url}/v1/rewards", json={"completion_id": replies[-1].id, "reward": 1.0}
        ).raise_for_status()
    records: dict[str, list[dict[str, Any]]] = {name: [] for name in runs}
    for trajectory in trajectories(proxy.url):
        records[trajectory["session_id"]].append(trajectory)
    [plain], [streamed], [stored] = records.values()  # one segment each
    for record in (streamed, stored):
        assert record["token_ids"] == plain["token_ids"] and record["loss_mask"] == plain["loss_mask"]
    for name, record in zip(runs, (plain, streamed, stored), strict=True):
        assert [t["completion_id"].removeprefix("chatcmpl-") for t in record["turns"]] == [
            r.id.removeprefix("resp_") for r in runs[name]
        ]
        assert [r.usage.input_tokens for r in runs[name]] == [t["completion_start"] for t in record["turns"]]
    for record in (plain, streamed, stored):
        assert_exact(record, qwen3_model)
