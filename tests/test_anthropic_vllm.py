"""The Anthropic Messages API against a real vLLM: the taught weather script's tool round
trip through the `anthropic` SDK, whole and streamed, echoed as the SDK returns it; one exact
segment each, the same record either way, and `count_tokens` equal to the ids sent."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import pytest

from devtools.scripts import weather_episode
from tests.helpers import assert_exact, trajectories
from tests.test_anthropic import ANTHROPIC_WEATHER_TOOL

SCRIPT = weather_episode("hermes")["messages"]


def _turn(sdk: anthropic.Anthropic, messages: list[dict[str, Any]], stream: bool) -> tuple[Any, list[str]]:
    """One request as the script's system prompt and tools; the reply, and (streamed) the
    `input_json_delta` pieces as they came."""
    request = {
        "model": "tiny",
        "max_tokens": 60,
        "extra_body": {"temperature": 0},  # the SDK (2.15) takes no sampling fields of its own
        "system": SCRIPT[0]["content"],
        "tools": [ANTHROPIC_WEATHER_TOOL],
        "messages": messages,
    }
    counted = sdk.messages.count_tokens(**{k: v for k, v in request.items() if k != "max_tokens"})
    if not stream:
        message = sdk.messages.create(**request)
        assert message.usage.input_tokens == counted.input_tokens
        return message, []
    pieces = []
    with sdk.messages.stream(**request) as events:
        for event in events:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                pieces.append(event.delta.partial_json)
        message = events.get_final_message()
    assert message.usage.input_tokens == counted.input_tokens
    return message, pieces


def _episode(url: str, stream: bool) -> list[Any]:
    sdk = anthropic.Anthropic(base_url=url, api_key="-", max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": SCRIPT[1]["content"]}]
    first, pieces = _turn(sdk, messages, stream)
    assert first.stop_reason == "tool_use" and first.id.startswith("msg_")
    uses = [b for b in first.content if b.type == "tool_use"]
    assert [(u.name, u.input) for u in uses] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "London"}),
    ]
    assert all(u.id.startswith("toolu_") for u in uses)
    if stream:  # the pieces add up to the JSON the model sampled
        assert "".join(pieces) == '{"city": "Paris"}{"city": "London"}' and len(pieces) > 2
    messages.append(
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]}
    )
    results = [SCRIPT[3]["content"], SCRIPT[4]["content"]]
    messages.append(
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": u.id, "content": r}
                for u, r in zip(uses, results, strict=True)
            ],
        }
    )
    second, _ = _turn(sdk, messages, stream)
    assert [(b.type, b.text) for b in second.content] == [("text", SCRIPT[5]["content"])]
    assert (second.stop_reason, second.stop_sequence) == ("end_turn", None)
    return [first, second]


def test_tool_round_trip_whole_and_streamed_is_one_exact_segment(qwen3_model, qwen3_vllm, start_proxy):
    proxy = start_proxy(qwen3_model, qwen3_vllm, "--tool-call-parser", "hermes")
    plain = _episode(f"{proxy.url}/s/plain", stream=False)
    streamed = _episode(f"{proxy.url}/s/streamed", stream=True)
    for a, b in zip(plain, streamed, strict=True):
        assert [b_.model_dump(exclude={"id"}) for b_ in a.content] == [
            b_.model_dump(exclude={"id"}) for b_ in b.content
        ]
        assert a.usage.model_dump() == b.usage.model_dump()
    for replies in (plain, streamed):
        # rewards may name a reply by its message id
        body = {"completion_id": replies[-1].id, "reward": 1.0}
        httpx.post(f"{proxy.url}/v1/rewards", json=body).raise_for_status()
    records = {t["session_id"]: [] for t in trajectories(proxy.url)}
    for t in trajectories(proxy.url):
        records[t["session_id"]].append(t)
    [plain_record], [streamed_record] = records["plain"], records["streamed"]  # one segment each
    assert plain_record["token_ids"] == streamed_record["token_ids"]
    assert plain_record["loss_mask"] == streamed_record["loss_mask"]
    assert [t["completion_id"].removeprefix("chatcmpl-") for t in plain_record["turns"]] == [
        r.id.removeprefix("msg_") for r in plain
    ]
    assert_exact(plain_record, qwen3_model)
    assert json.loads(json.dumps(plain_record["turns"][0]["finish_reason"])) == "stop"


def test_stop_sequence_ends_the_reply_and_is_reported(qwen3_model, qwen3_vllm, start_proxy):
    proxy = start_proxy(qwen3_model, qwen3_vllm, "--tool-call-parser", "hermes")
    sdk = anthropic.Anthropic(base_url=f"{proxy.url}/s/stop", api_key="-", max_retries=0)
    history = [
        {"role": "user", "content": SCRIPT[1]["content"]},
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": f"toolu_{i}", "name": "get_weather", "input": {"city": c}}
                for i, c in enumerate(("Paris", "London"))
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": SCRIPT[3 + i]["content"]}
                for i in range(2)
            ],
        },
    ]
    message = sdk.messages.create(
        model="tiny",
        max_tokens=60,
        extra_body={"temperature": 0},
        system=SCRIPT[0]["content"],
        tools=[ANTHROPIC_WEATHER_TOOL],
        messages=history,
        stop_sequences=["rainy"],
    )
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "rainy")
    assert message.content[0].text == SCRIPT[5]["content"].split("rainy")[0]
    cut = sdk.messages.create(
        model="tiny",
        max_tokens=3,
        extra_body={"temperature": 0},
        system=SCRIPT[0]["content"],
        tools=[ANTHROPIC_WEATHER_TOOL],
        messages=history,
    )
    assert (cut.stop_reason, cut.usage.output_tokens) == ("max_tokens", 3)


def test_thinking_blocks_whole_and_streamed(qwen3_model, qwen3_vllm, start_proxy):
    proxy = start_proxy(qwen3_model, qwen3_vllm, "--reasoning-parser", "qwen3")
    sdk = anthropic.Anthropic(base_url=f"{proxy.url}/s/think", api_key="-", max_retries=0)
    request = {
        "model": "tiny",
        "max_tokens": 40,
        "messages": [{"role": "user", "content": "Hi"}],
        "thinking": {"type": "adaptive"},  # what Claude Code sends for a model it does not know
        "extra_body": {"temperature": 0},
    }
    message = sdk.messages.create(**request)
    thinking, text = message.content
    assert (thinking.type, thinking.thinking.strip(), thinking.signature) == (
        "thinking",
        "The user greets me.",
        f"molt:chatcmpl-{message.id.removeprefix('msg_')}",
    )
    assert (text.type, text.text.lstrip("\n"), message.stop_reason) == ("text", "Hello!", "end_turn")
    kinds = []
    with sdk.messages.stream(**request) as events:
        for event in events:
            if event.type == "content_block_delta":
                kinds.append(event.delta.type)
        streamed = events.get_final_message()
    assert kinds[0] == "thinking_delta" and kinds[-1] == "text_delta"
    assert kinds.count("signature_delta") == 1 and kinds.index("signature_delta") < kinds.index("text_delta")
    assert [b.model_dump(exclude={"signature"}) for b in streamed.content] == [
        b.model_dump(exclude={"signature"}) for b in message.content
    ]


# -- forced tool use on the untaught tiny Qwen3 -----------------------------------------------------

TIME_SCHEMA = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["Europe/Paris", "Asia/Tokyo", "America/Lima"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
QUESTION = [{"role": "user", "content": "What time is it in Paris?"}]


def _time_tool(strict: bool | None) -> dict[str, Any]:
    tool = {"name": "get_time", "description": "The time in a zone.", "input_schema": TIME_SCHEMA}
    return tool if strict is None else {**tool, "strict": strict}


def _forced(url: str, tool: dict[str, Any], choice: dict[str, Any], stream: bool) -> Any:
    """A forced tool use (greedy) and its answer, echoed as the SDK returned them; the first
    reply."""
    sdk = anthropic.Anthropic(base_url=url, api_key="-", max_retries=0)
    request = {
        "model": "tiny",
        "max_tokens": 300,
        "tools": [tool],
        "tool_choice": choice,
        "messages": QUESTION,
        "extra_body": {"temperature": 0},
    }
    if stream:
        pieces = []
        with sdk.messages.stream(**request) as events:
            for event in events:
                if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                    pieces.append(event.delta.partial_json)
            reply = events.get_final_message()  # raised ValueError: the pieces added up to a string
        if reply.stop_reason == "tool_use":  # the pieces add up to the JSON objects the model sampled
            assert "".join(pieces) == "".join(
                json.dumps(b.input) for b in reply.content if b.type == "tool_use"
            )
    else:
        reply = sdk.messages.create(**request)
    echoed = [
        *QUESTION,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": b.id, "content": "12:00"}
                for b in reply.content
                if b.type == "tool_use"
            ],
        },
    ]
    sdk.messages.create(**{**request, "messages": echoed, "tool_choice": {"type": "none"}, "max_tokens": 4})
    return reply


PARIS = {"zone": "Europe/Paris"}


@pytest.mark.parametrize(
    ("choice", "strict", "level", "calls"),
    [
        ({"type": "tool", "name": "get_time"}, True, "auto", 1),
        ({"type": "any"}, True, "auto", 2),
        ({"type": "tool", "name": "get_time"}, None, "parameter", 1),
        ({"type": "any"}, None, "parameter", 4),
        ({"type": "tool", "name": "get_time"}, None, "auto", 0),
        ({"type": "any"}, None, "auto", 0),
    ],
)
def test_forced_tool_use_on_the_untaught_model_is_an_object_whole_and_streamed_and_its_echo_continues(
    untaught_qwen3_model, untaught_qwen3_vllm, start_proxy, choice, strict, level, calls
):
    """Issue 26.12: a forced call of a tool not pinned to its schema came back as `tool_use`
    with `input: {}` for a sampled string (whole; its echo opened a second segment, 7 of 7),
    and as `input_json_delta` pieces adding up to a JSON string (streamed; the SDK's
    `get_final_message` raised ValueError). Its arguments are now an object by grammar (a
    strict tool's, or any tool's under `--tool-strict-level parameter`, follow its schema):
    the whole and the streamed reply agree, and the echo of either continues the segment.
    `calls` 0: the loose tool's made-up key runs into `max_tokens` (greedy); the call cut off
    there is a `tool_use` whole as streamed (it was text whole), its input the complete part."""
    proxy = start_proxy(
        untaught_qwen3_model,
        untaught_qwen3_vllm,
        "--tool-call-parser",
        "hermes",
        "--tool-strict-level",
        level,
    )
    sessions = [f"whole-{choice['type']}", f"streamed-{choice['type']}"]
    whole = _forced(f"{proxy.url}/s/{sessions[0]}", _time_tool(strict), choice, stream=False)
    streamed = _forced(f"{proxy.url}/s/{sessions[1]}", _time_tool(strict), choice, stream=True)
    assert [b.model_dump(exclude={"id"}) for b in whole.content] == [
        b.model_dump(exclude={"id"}) for b in streamed.content
    ]
    for reply in (whole, streamed):
        assert all(b.type == "tool_use" and isinstance(b.input, dict) for b in reply.content)
        if calls:
            assert reply.stop_reason == "tool_use"
            assert [(b.name, b.input) for b in reply.content] == [("get_time", PARIS)] * calls
        else:
            assert (reply.stop_reason, len(reply.content)) == ("max_tokens", 1)
    for session in sessions:
        httpx.post(f"{proxy.url}/v1/rewards", json={"session_id": session, "reward": 0.0}).raise_for_status()
    records = [t for t in trajectories(proxy.url) if t["session_id"] in sessions]
    assert [len(r["turns"]) for r in records] == [2, 2]  # one segment each: the echo continued it
    assert records[0]["token_ids"] == records[1]["token_ids"]
