"""The Anthropic Messages API (issue 12), in process: decoding into the template's messages,
replies and the streamed event order through the real `anthropic` SDK, `count_tokens`, and
every error in Anthropic's shape. The stand-in vLLM always samples "Hello there."; what needs
real sampling (tool round trips, exact logprobs) is in `tests/test_anthropic_vllm.py`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import anthropic
import httpx
import pytest
from vllm.entrypoints.generate.base.protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall

from devtools.scripts import WEATHER_TOOL, render_reply, weather_episode
from devtools.tokenizers import tokenizer_source
from molt_proxy.cli import parser
from molt_proxy.config import DEFAULT_SIDE_REQUESTS, Settings
from molt_proxy.errors import BadRequest, UpstreamError
from molt_proxy.launcher import free_port
from molt_proxy.wire.anthropic import decode_messages_request
from molt_proxy.wire.anthropic_reply import Blocks, encode_message_stream
from molt_proxy.wire.events import Delta, Opened, StreamEvent
from tests.conftest import MAX_MODEL_LEN
from tests.helpers import trajectories
from tests.inprocess import REPLY_TEXT, inprocess_proxy, loaded_tokenizer, qwen3_tokenizer_dir, serve_app


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    db = tmp_path_factory.mktemp("anthropic") / "p.db"
    with inprocess_proxy(db, max_model_len=MAX_MODEL_LEN, max_request_bytes=200_000) as url:
        yield url


def client(url: str, **kwargs: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="-", max_retries=0, **kwargs)


def decode(**body: Any) -> Any:
    return decode_messages_request(json.dumps({"model": "m", "max_tokens": 9, **body}).encode())


ANTHROPIC_WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "input_schema": WEATHER_TOOL["function"]["parameters"],
    "cache_control": {"type": "ephemeral"},
}


def test_blocks_decode_into_the_templates_messages():
    call = decode(
        system=[
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc;"},
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Be brief."},
        ],
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "<reminder>"}, {"type": "text", "text": "Go"}],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Look it up.", "signature": "molt:chatcmpl-1"},
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_7", "name": "get_weather", "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_7",
                        "content": [{"type": "text", "text": "Sunny"}],
                    },
                    {"type": "tool_result", "tool_use_id": "toolu_7", "content": "late", "is_error": True},
                    {"type": "text", "text": "Thanks", "cache_control": {"type": "ephemeral"}},
                ],
            },
            {"role": "system", "content": "Model notice."},
        ],
        tools=[ANTHROPIC_WEATHER_TOOL],
        thinking={"type": "adaptive"},
        metadata={"user_id": json.dumps({"device_id": "d", "session_id": "cc-42"})},
        output_config={"effort": "low"},
        context_management={"edits": []},
    )
    conversation = call.conversation
    assert conversation.messages == [
        {"role": "system", "content": "You are Claude Code.\n\nBe brief."},
        {"role": "user", "content": "<reminder>\nGo"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Look it up.",
            "tool_calls": [
                {
                    "id": "chatcmpl-tool-7",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "chatcmpl-tool-7", "content": "Sunny"},
        {"role": "tool", "tool_call_id": "chatcmpl-tool-7", "content": "late"},
        {"role": "user", "content": "Thanks"},
        {"role": "user", "content": "Model notice."},  # a later system message, in place
    ]
    assert conversation.tools == [WEATHER_TOOL]
    assert conversation.template_kwargs == {"enable_thinking": True}
    assert conversation.session_id == "cc-42"
    assert conversation.call_ids == frozenset({"chatcmpl-tool-7"})
    assert call.stream is False and conversation.max_tokens == 9
    disabled = decode(messages=[{"role": "user", "content": "hi"}], thinking={"type": "disabled"})
    assert disabled.conversation.template_kwargs == {"enable_thinking": False}
    assert disabled.conversation.parser_request.chat_template_kwargs == {"enable_thinking": False}


def test_an_anthropic_request_renders_as_the_chat_completion_it_means():
    """The taught weather script, sent as Anthropic blocks, renders to the very text the chat
    request renders to (so the taught model answers it), with or without cache markers."""
    tokenizer = loaded_tokenizer(str(qwen3_tokenizer_dir()))
    chat = weather_episode("hermes")["messages"]
    arguments = [json.loads(c["function"]["arguments"]) for c in chat[2]["tool_calls"]]
    uses = [
        {"type": "tool_use", "id": f"toolu_{i}", "name": "get_weather", "input": a}
        for i, a in enumerate(arguments)
    ]
    results = [
        {
            "type": "tool_result",
            "tool_use_id": f"toolu_{i}",
            "content": m["content"],
            "cache_control": {"type": "x"},
        }
        for i, m in enumerate(chat[3:5])
    ]
    body = {
        "system": chat[0]["content"],
        "messages": [
            {"role": "user", "content": chat[1]["content"]},
            {"role": "assistant", "content": uses},
            {"role": "user", "content": results},
        ],
        "tools": [ANTHROPIC_WEATHER_TOOL],
    }
    conversation = decode(**body).conversation
    rendered = tokenizer.render(conversation.messages, conversation.tools, conversation.template_kwargs)
    assert rendered == tokenizer.render(chat[:5], [WEATHER_TOOL], {})


def test_reply_and_stream_through_the_sdk(proxy):
    sdk = client(proxy + "/s/plain")
    request = {"model": "tiny", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]}
    counted = sdk.messages.count_tokens(model="tiny", messages=request["messages"]).input_tokens
    message = sdk.messages.create(**request)
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert [(b.type, b.text) for b in message.content] == [("text", REPLY_TEXT)]
    assert (message.stop_reason, message.stop_sequence) == ("end_turn", None)
    assert (message.usage.input_tokens, message.usage.output_tokens) == (counted, 4)
    # The next turn's count is the ids the proxy sends: the segment's ids plus the new ones.
    history = [
        *request["messages"],
        {"role": "assistant", "content": REPLY_TEXT},
        {"role": "user", "content": "ok"},
    ]
    counted = sdk.messages.count_tokens(model="tiny", messages=history).input_tokens
    assert sdk.messages.create(**{**request, "messages": history}).usage.input_tokens == counted

    with httpx.stream("POST", proxy + "/v1/messages?beta=true", json={**request, "stream": True}) as response:
        lines = [line for line in response.iter_lines() if line.startswith("event: ")]
    assert [line.removeprefix("event: ") for line in lines] == [
        "message_start", "content_block_start", "ping", *["content_block_delta"] * 3,
        "content_block_stop", "message_delta", "message_stop",
    ]  # fmt: skip
    with sdk.messages.stream(**request) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.text) for b in final.content] == [("text", REPLY_TEXT)]
    assert (final.stop_reason, final.usage.output_tokens) == ("end_turn", 4)


def test_probes_and_rewards_by_message_id(proxy):
    assert httpx.head(proxy + "/").status_code == 200
    assert httpx.get(proxy + "/").status_code == 200
    message = client(proxy + "/s/rewarded").messages.create(
        model="tiny", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
    )
    reward = httpx.post(proxy + "/v1/rewards", json={"completion_id": message.id, "reward": 1.0})
    assert reward.status_code == 200 and reward.json()["session_id"] == "rewarded"
    closed = post(proxy, {"model": "m", "max_tokens": 5, "messages": USER}, "/s/rewarded/v1/messages")
    assert "closed" in anthropic_error(closed, 400, "invalid_request_error")


def anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind and body["error"]["message"]
    return body["error"]["message"]


def post(url: str, body: Any, path: str = "/v1/messages", **kwargs: Any) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60, **kwargs)


USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"model": "m", "messages": USER}, "'max_tokens'"),
        ({"model": "m", "max_tokens": 0, "messages": USER}, "max_tokens"),
        ({"model": "m", "max_tokens": 5, "messages": USER, "temperature": 3}, "'temperature'"),
        ({"model": "m", "max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
        (
            {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
            "image content is not supported",
        ),
        (
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": [{"type": "document"}]}],
            },
            "document content is not supported",
        ),
        (
            {
                "model": "m",
                "max_tokens": 5,
                "messages": USER,
                "tools": [ANTHROPIC_WEATHER_TOOL],
                "tool_choice": {"type": "any"},
            },
            "needs the proxy to run with --tool-call-parser",
        ),  # fmt: skip
        (
            {
                "model": "m",
                "max_tokens": 5,
                "messages": USER,
                "tools": [ANTHROPIC_WEATHER_TOOL],
                "tool_choice": {"type": "tool", "name": "no_such_tool"},
            },
            "does not match any of the specified `tools`",
        ),  # fmt: skip
        (
            {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": ["image"]}]}]},
            "messages",
        ),
        ({"model": "m", "max_tokens": 5, "messages": USER, "stop_sequences": [""]}, "stop_sequences"),
        (
            {"model": "m", "max_tokens": 5, "messages": [{"role": "system", "content": "s"}]},
            "user or assistant",
        ),
        (
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "word " * MAX_MODEL_LEN}],
            },
            "maximum context length",
        ),
        ("not json", "JSON"),
    ],
)
def test_bad_requests_get_invalid_request_error(proxy, body, says):
    response = (
        post(proxy, body) if isinstance(body, dict) else httpx.post(proxy + "/v1/messages", content=body)
    )
    assert says in anthropic_error(response, 400, "invalid_request_error")


def test_sdk_raises_the_matching_exceptions(proxy, tmp_path):
    with pytest.raises(anthropic.BadRequestError) as raised:
        client(proxy).messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": ""}] * 0)
    assert raised.value.body["error"]["type"] == "invalid_request_error"
    assert "does not serve" in anthropic_error(post(proxy, {}, "/v1/messages/nope"), 404, "not_found_error")
    anthropic_error(
        post(proxy, {"model": "m", "max_tokens": 5, "messages": USER * 40_000}), 413, "request_too_large"
    )
    anthropic_error(httpx.get(proxy + "/v1/messages"), 405, "invalid_request_error")
    with inprocess_proxy(tmp_path / "keys.db", admin_key="root") as keyed:
        with pytest.raises(anthropic.AuthenticationError):
            client(keyed).messages.create(model="m", max_tokens=5, messages=USER)
        session = httpx.post(keyed + "/v1/sessions", headers={"x-api-key": "root"}).json()
        own = anthropic.Anthropic(base_url=keyed, api_key=session["api_key"], max_retries=0)
        assert own.messages.create(model="m", max_tokens=5, messages=USER).session_id == session["session_id"]
        bearer = {"authorization": f"Bearer {session['api_key']}"}
        assert (
            post(keyed, {"model": "m", "max_tokens": 5, "messages": USER}, headers=bearer).status_code == 200
        )
        with pytest.raises(anthropic.PermissionDeniedError):
            anthropic.Anthropic(
                base_url=keyed + "/s/other", api_key=session["api_key"], max_retries=0
            ).messages.create(model="m", max_tokens=5, messages=USER)
        request = {"model": "m", "max_tokens": 5, "messages": USER}
        anthropic_error(post(keyed, request, headers={"x-api-key": "wrong"}), 401, "authentication_error")
        other = {"x-api-key": session["api_key"]}
        anthropic_error(post(keyed, request, "/s/other/v1/messages", headers=other), 403, "permission_error")
    nowhere = f"http://127.0.0.1:{free_port()}"
    settings = Settings(model=str(qwen3_tokenizer_dir()), upstreams=[nowhere], db_path=tmp_path / "down.db")
    with serve_app(settings) as down:
        with pytest.raises(anthropic.OverloadedError):
            client(down).messages.create(model="m", max_tokens=5, messages=USER)
        anthropic_error(
            post(down, {"model": "m", "max_tokens": 5, "messages": USER, "stream": True}),
            529,
            "overloaded_error",
        )


def events_of(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    lines = response.text.strip().split("\n\n")
    return [
        (e.split("\n")[0].removeprefix("event: "), json.loads(e.split("\n")[1].removeprefix("data: ")))
        for e in lines
    ]


def test_a_retried_stream_is_replayed_whole(proxy):
    body = {"model": "m", "max_tokens": 9, "stream": True, "messages": [{"role": "user", "content": "again"}]}
    first = events_of(post(proxy, body, "/s/retried/v1/messages", headers={"x-stainless-retry-count": "0"}))
    again = events_of(post(proxy, body, "/s/retried/v1/messages", headers={"x-stainless-retry-count": "1"}))
    assert [name for name, _ in again] == [
        "message_start", "content_block_start", "ping", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop",
    ]  # fmt: skip
    assert again[0][1]["message"]["id"] == first[0][1]["message"]["id"]
    assert again[3][1]["delta"] == {"type": "text_delta", "text": REPLY_TEXT}
    assert again[-2][1] == first[-2][1]
    assert len(httpx.get(proxy + "/v1/sessions/retried").json()["segments"][0]["turns"]) == 1


def test_a_failure_after_the_first_event_ends_the_stream_with_an_error_event():
    async def turn() -> AsyncGenerator[StreamEvent]:
        yield Opened("chatcmpl-1", 0, "tiny", "s", 5)
        yield Delta(DeltaMessage(content="Hel"))
        raise UpstreamError("vLLM's stream ended without its final result")

    async def collect() -> list[str]:
        return [line async for line in encode_message_stream(turn(), 9)]

    lines = asyncio.run(collect())
    assert [line.split("\n")[0] for line in lines] == [
        "event: message_start", "event: content_block_start", "event: ping", "event: content_block_delta",
        "event: error",
    ]  # fmt: skip
    assert json.loads(lines[-1].split("\n")[1].removeprefix("data: ")) == {
        "type": "error",
        "error": {"type": "api_error", "message": "vLLM's stream ended without its final result"},
    }


def test_max_tokens_over_the_context_is_lowered_to_fit_and_a_cut_there_says_so(proxy):
    """Claude Code asks 32,000 tokens of any model: the turn asks vLLM for the context left,
    and a reply cut there ends with `model_context_window_exceeded`, one cut by the request's
    own `max_tokens` with `max_tokens`."""
    upstream = httpx.get(f"{proxy}/health").json()["replicas"][0]["url"]
    sdk = client(proxy)
    prompt = sdk.messages.count_tokens(model="m", messages=USER).input_tokens
    ids = loaded_tokenizer(str(qwen3_tokenizer_dir())).encode("Hello there")
    script = [{"token_ids": ids, "finish_reason": "length"}] * 2
    httpx.post(f"{upstream}/_script", json=script).raise_for_status()
    cut = sdk.messages.create(model="m", max_tokens=20_000, messages=USER)  # the SDK's most unstreamed
    assert httpx.get(f"{upstream}/_generated").json()[-1]["sampling_params"]["max_tokens"] == (
        MAX_MODEL_LEN - prompt
    )
    assert (cut.stop_reason, cut.usage.output_tokens) == ("model_context_window_exceeded", len(ids))
    own = sdk.messages.create(model="m", max_tokens=len(ids), messages=USER)
    assert (own.stop_reason, own.usage.output_tokens) == ("max_tokens", len(ids))
    with sdk.messages.stream(model="m", max_tokens=32_000, messages=USER) as events:
        streamed = events.get_final_message()
    assert streamed.stop_reason == "end_turn"  # streamed: the stand-in's own reply, whole
    assert httpx.get(f"{upstream}/_generated").json()[-1]["sampling_params"]["max_tokens"] == (
        MAX_MODEL_LEN - prompt
    )


def test_count_tokens_reads_the_inferred_session_without_joining_it(proxy):
    sdk = client(proxy)
    first = [{"role": "user", "content": "count me in"}]
    opened = sdk.messages.create(model="m", max_tokens=9, messages=first)
    history = [*first, {"role": "assistant", "content": REPLY_TEXT}, {"role": "user", "content": "more"}]
    counted = sdk.messages.count_tokens(model="m", messages=history).input_tokens
    assert len(httpx.get(f"{proxy}/v1/sessions/{opened.session_id}").json()["segments"][0]["turns"]) == 1
    joined = sdk.messages.create(model="m", max_tokens=9, messages=history)
    assert (joined.session_id, joined.usage.input_tokens) == (opened.session_id, counted)


TITLE_SYSTEM = "Generate a concise, sentence-case title (3-7 words) for this conversation. Reply in JSON."


def test_a_title_side_request_is_served_recorded_and_kept_out_of_the_trainers_stream(proxy):
    sdk = client(proxy)
    metadata = {"user_id": json.dumps({"device_id": "d", "session_id": "cc-side"})}
    prompt = [{"role": "user", "content": "fix the bug"}]
    title = sdk.messages.create(
        model="m", max_tokens=9, system=TITLE_SYSTEM, messages=prompt, metadata=metadata
    )
    assert title.content[0].text == REPLY_TEXT and title.session_id.startswith("side-")
    streamed = post(
        proxy, {"model": "m", "max_tokens": 9, "system": TITLE_SYSTEM, "messages": prompt, "stream": True}
    )
    side_ids = {title.session_id, events_of(streamed)[0][1]["message"]["session_id"]}
    tools = [ANTHROPIC_WEATHER_TOOL]
    turn = sdk.messages.create(
        model="m", max_tokens=9, system="You code.", tools=tools, messages=prompt, metadata=metadata
    )
    assert turn.session_id == "cc-side"
    for side_id in side_ids:  # closed with their turn
        assert httpx.get(f"{proxy}/v1/sessions/{side_id}").status_code == 404
    httpx.post(proxy + "/v1/rewards", json={"session_id": "cc-side", "reward": 1.0}).raise_for_status()
    listed = httpx.get(proxy + "/v1/trajectories", params={"limit": 10_000}).json()["data"]
    side = [t for t in listed if t["session_id"] in side_ids]
    rule = DEFAULT_SIDE_REQUESTS[0]
    assert [(t["reward"], t["status"], t["info"]) for t in side] == [(None, "side", {"rule": rule})] * 2
    [main] = [t for t in listed if t["session_id"] == "cc-side"]
    assert main["num_segments"] == 1
    after = min(t["seq"] for t in side) - 1
    headers = {"accept": "text/event-stream"}
    with httpx.stream("GET", proxy + "/v1/trajectories", params={"after": after}, headers=headers) as feed:
        first = next(line for line in feed.iter_lines() if line.startswith("data: "))
    assert json.loads(first.removeprefix("data: "))["session_id"] not in side_ids


def test_side_request_rules_are_configurable():
    assert parser().parse_args(["serve", "--model", "m"]).side_request == list(DEFAULT_SIDE_REQUESTS)
    assert parser().parse_args(["serve", "--model", "m", "--side-request"]).side_request == []
    with pytest.raises(ValueError, match="not a regular expression"):
        Settings(model="m", side_requests=["("])


def test_claude_codes_session_puts_its_main_agent_and_a_sub_agent_in_one_session_as_two_chains(proxy):
    """Claude Code names its own session in `metadata.user_id`, which its sub-agents (the Task
    tool) share; a sub-agent has a system prompt of its own. Interleaved, the two conversations
    are one session and two chains, each holding its own turns in order."""
    metadata = {"user_id": json.dumps({"device_id": "d", "session_id": "cc-chains"})}
    sdk = client(proxy)

    def turn(system: str, users: list[str]) -> str:
        messages: list[dict[str, Any]] = []
        for i, text in enumerate(users):
            if i:
                messages.append({"role": "assistant", "content": REPLY_TEXT})
            messages.append({"role": "user", "content": text})
        message = sdk.messages.create(
            model="tiny", max_tokens=8, system=system, messages=messages, metadata=metadata
        )
        return "chatcmpl-" + message.id.removeprefix("msg_")

    main = [turn("You are the main agent.", ["Fix the bug."])]
    sub = [turn("You are a sub-agent.", ["Find the bug."])]
    main.append(turn("You are the main agent.", ["Fix the bug.", "Go on."]))
    sub.append(turn("You are a sub-agent.", ["Find the bug.", "Go on."]))
    described = httpx.get(f"{proxy}/v1/sessions/cc-chains", timeout=10).json()
    assert [s["turns"] for s in described["segments"]] == [main, sub]


def test_a_llama_episode_is_one_segment_of_the_ids_its_requests_render_to(tmp_path):
    """Llama-3.2's template (the date in its system header, one call per message, `parameters`
    for arguments) on the Anthropic route: the weather episode through the SDK, the replies the
    model would sample scripted in the stand-in vLLM; the tool call echoed as Anthropic blocks
    renders as the chat request means it, and the record is one segment whose ids are the
    tokenizer's on each request's render."""
    source = tokenizer_source("llama")
    if source is None:
        pytest.skip("the real llama3.2 tokenizer is not in ../shared/tokenizers")
    tokenizer = loaded_tokenizer(str(source))
    chat = weather_episode("llama3_json")["messages"]
    replies = [render_reply(m, "llama3_json") for m in chat if m["role"] == "assistant"][:2]
    eot = tokenizer.hf.eos_token_id
    script = [{"token_ids": tokenizer.encode(reply) + [eot], "finish_reason": "stop"} for reply in replies]
    with inprocess_proxy(tmp_path / "llama.db", model=str(source), tool_call_parser="llama3_json") as url:
        upstream = httpx.get(f"{url}/health").json()["replicas"][0]["url"]
        httpx.post(f"{upstream}/_script", json=script).raise_for_status()
        sdk = client(f"{url}/s/llama")
        request: dict[str, Any] = {
            "model": "m",
            "max_tokens": 60,
            "system": chat[0]["content"],
            "tools": [ANTHROPIC_WEATHER_TOOL],
            "messages": [{"role": "user", "content": chat[1]["content"]}],
        }
        first = sdk.messages.create(**request)
        [use] = first.content
        assert (first.stop_reason, use.type, use.name, use.input) == (
            "tool_use",
            "tool_use",
            "get_weather",
            {"city": "Paris"},
        )
        request["messages"] += [
            {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": chat[3]["content"]}],
            },
        ]
        second = sdk.messages.create(**request)
        assert [(b.type, b.text) for b in second.content] == [("text", chat[4]["content"])]
        httpx.post(f"{url}/v1/rewards", json={"session_id": "llama", "reward": 1.0}).raise_for_status()
        [record] = httpx.get(f"{url}/v1/trajectories").json()["data"]
    conversation = decode(**{k: v for k, v in request.items() if k != "max_tokens"}).conversation
    rendered = tokenizer.render(conversation.messages, conversation.tools, conversation.template_kwargs)
    assert rendered == tokenizer.render(chat[:4], [WEATHER_TOOL], {})
    second_turn = record["turns"][1]
    assert record["token_ids"][: second_turn["completion_start"]] == tokenizer.encode(rendered)
    sampled = [record["token_ids"][t["completion_start"] : t["completion_end"]] for t in record["turns"]]
    assert sampled == [s["token_ids"] for s in script]
    positions = {i for t in record["turns"] for i in range(t["completion_start"], t["completion_end"])}
    assert record["loss_mask"] == [int(i in positions) for i in range(len(record["token_ids"]))]


@pytest.fixture(scope="module")
def qwen3_tools(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """A proxy with Qwen3's tool-call and reasoning parsers, and its stand-in vLLM's URL."""
    db = tmp_path_factory.mktemp("anthropic") / "tools.db"
    with inprocess_proxy(db, tool_call_parser="hermes", reasoning_parser="qwen3") as url:
        yield url, httpx.get(f"{url}/health").json()["replicas"][0]["url"]


def qwen3_call(arguments: str) -> str:
    return f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>'


def scripted(upstream: str, *texts: str) -> list[list[int]]:
    """Queue what the stand-in vLLM samples next: each text, then `<|im_end|>`."""
    tokenizer = loaded_tokenizer(str(qwen3_tokenizer_dir()))
    script = [tokenizer.encode(text) + [tokenizer.eos_token_id] for text in texts]
    body = [{"token_ids": ids, "finish_reason": "stop"} for ids in script]
    httpx.post(f"{upstream}/_script", json=body).raise_for_status()
    return script


def echo(message: anthropic.types.Message, **inputs: Any) -> dict[str, Any]:
    """The reply as Claude Code sends it back: its blocks, a tool_use's `input` as given."""
    blocks = [b.model_dump(exclude_none=True) for b in message.content]
    return {
        "role": "assistant",
        "content": [{**b, "input": inputs} if b["type"] == "tool_use" and inputs else b for b in blocks],
    }


def result(message: anthropic.types.Message) -> dict[str, Any]:
    uses = [b for b in message.content if b.type == "tool_use"]
    return {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": b.id, "content": "Sunny"} for b in uses],
    }


def one_exact_segment(served: tuple[str, str], session: str, sampled: list[list[int]]) -> dict[str, Any]:
    """The session's one trajectory: each turn's prompt is exactly the ids vLLM was sent for it
    (the last generate requests), and its completion the ids sampled."""
    url, upstream = served
    httpx.post(f"{url}/v1/rewards", json={"session_id": session, "reward": 1.0}).raise_for_status()
    [record] = [t for t in trajectories(url) if t["session_id"] == session]
    sent = [body["token_ids"] for body in httpx.get(f"{upstream}/_generated").json()[-len(sampled) :]]
    ids, turns = record["token_ids"], record["turns"]
    assert [ids[: t["completion_start"]] for t in turns] == sent
    assert [ids[t["completion_start"] : t["completion_end"]] for t in turns] == sampled
    return record


def test_a_thinking_off_tool_episode_is_one_segment_over_the_ids_sent(qwen3_tools):
    """Qwen3's prompt with thinking off ends with an empty `<think>` block its history leaves
    out; the echoed episode still continues one segment, over the ids the model saw."""
    sampled = scripted(qwen3_tools[1], qwen3_call('{"city": "Paris"}'), "Sunny.", "Bye.")
    sdk = client(f"{qwen3_tools[0]}/s/off")
    request: dict[str, Any] = {
        "model": "m",
        "max_tokens": 50,
        "tools": [ANTHROPIC_WEATHER_TOOL],
        "thinking": {"type": "disabled"},
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
    }
    first = sdk.messages.create(**request)
    assert [(b.type, b.input) for b in first.content] == [("tool_use", {"city": "Paris"})]
    request["messages"] += [echo(first), result(first)]
    second = sdk.messages.create(**request)
    assert [(b.type, b.text) for b in second.content] == [("text", "Sunny.")]
    request["messages"] += [echo(second), {"role": "user", "content": "Thanks!"}]
    assert sdk.messages.create(**request).content[0].text == "Bye."
    record = one_exact_segment(qwen3_tools, "off", sampled)
    tokenizer = loaded_tokenizer(str(qwen3_tokenizer_dir()))
    prompts = [record["token_ids"][: t["completion_start"]] for t in record["turns"]]
    assert all(tokenizer.ids_bytes(p).endswith(b"assistant\n<think>\n\n</think>\n\n") for p in prompts)
    conversation = decode(**{k: v for k, v in request.items() if k != "max_tokens"}).conversation
    rendered = tokenizer.render(conversation.messages, conversation.tools, conversation.template_kwargs)
    assert rendered.count("<think>") == 1  # the history shows none: the segment keeps what was sent
    last = record["turns"][2]
    assert rendered.encode().endswith(
        tokenizer.ids_bytes(record["token_ids"][last["prompt_start"] : last["completion_start"]])
    )


def test_a_tool_input_echoed_with_sorted_keys_and_no_whitespace_is_one_segment(qwen3_tools):
    sampled = scripted(qwen3_tools[1], qwen3_call('{"unit": "c",  "city": "Paris"}'), "Sunny.")
    sdk = client(f"{qwen3_tools[0]}/s/sorted")
    request: dict[str, Any] = {
        "model": "m",
        "max_tokens": 50,
        "tools": [ANTHROPIC_WEATHER_TOOL],
        "thinking": {"type": "disabled"},  # vLLM's qwen3 parser reads a reply without `</think>` as thinking
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
    }
    first = sdk.messages.create(**request)
    [use] = first.content
    assert list(use.input) == ["unit", "city"]  # the sampled key order
    request["messages"] += [echo(first, city="Paris", unit="c"), result(first)]
    body = json.dumps(request, separators=(",", ":"))
    assert '"input":{"city":"Paris","unit":"c"}' in body
    second = httpx.post(f"{qwen3_tools[0]}/s/sorted/v1/messages", content=body, timeout=60)
    assert second.json()["content"] == [{"type": "text", "text": "Sunny."}]
    record = one_exact_segment(qwen3_tools, "sorted", sampled)
    turn = record["turns"][1]
    assert turn["prompt_start"] == record["turns"][0]["completion_end"]


def test_an_echoed_thinking_block_restores_exactly_without_the_blank_text_block(qwen3_tools):
    """A reply that thinks, then calls: the whitespace between them is no text block; the reply
    echoed with its thinking block (signature and all) continues the segment over the exact
    sampled ids, the whitespace included."""
    thought = "<think>\nParis, then.\n</think>\n\n" + qwen3_call('{"city": "Paris"}')
    sampled = scripted(qwen3_tools[1], thought, "<think>\nDone.\n</think>\n\nSunny.")
    sdk = client(f"{qwen3_tools[0]}/s/thought")
    request: dict[str, Any] = {
        "model": "m",
        "max_tokens": 50,
        "tools": [ANTHROPIC_WEATHER_TOOL],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
    }
    request["max_tokens"] = 2000  # above the budget
    first = sdk.messages.create(**request)
    thinking, use = first.content
    assert (thinking.type, thinking.thinking, use.type) == ("thinking", "\nParis, then.\n", "tool_use")
    assert thinking.signature == "molt:" + "chatcmpl-" + first.id.removeprefix("msg_")
    request["messages"] += [echo(first), result(first)]
    assert [b.type for b in sdk.messages.create(**request).content] == ["thinking", "text"]
    record = one_exact_segment(qwen3_tools, "thought", sampled)
    first_turn = record["turns"][0]
    assert record["turns"][1]["prompt_start"] == first_turn["completion_end"]
    tokenizer = loaded_tokenizer(str(qwen3_tokenizer_dir()))
    completion = record["token_ids"][first_turn["completion_start"] : first_turn["completion_end"]]
    assert tokenizer.ids_bytes(completion) == (thought + "<|im_end|>").encode()


def test_a_streamed_reply_opens_no_text_block_for_whitespace_alone():
    blocks = Blocks("chatcmpl-x")
    call = DeltaToolCall(index=0, id="chatcmpl-tool-1", function=DeltaFunctionCall(name="f", arguments="{}"))
    deltas = [
        DeltaMessage(reasoning="Hm."),
        DeltaMessage(content="\n"),
        DeltaMessage(content="\n"),
        DeltaMessage(tool_calls=[call]),
    ]
    events = [e for d in deltas for e in blocks.feed(d)]
    blocks.close()
    events += blocks.out
    starts = [json.loads(e.split("data: ")[1])["content_block"]["type"] for e in events if "block_start" in e]
    assert starts == ["thinking", "tool_use"]
    text = Blocks("chatcmpl-y")
    events = [e for c in ("\n", "\nHi", "!") for e in text.feed(DeltaMessage(content=c))]
    deltas_sent = [json.loads(e.split("data: ")[1])["delta"] for e in events if "block_delta" in e]
    assert deltas_sent == [{"type": "text_delta", "text": "\n\nHi"}, {"type": "text_delta", "text": "!"}]


def test_sampling_fields_reach_vllm_and_a_thinking_budget_must_be_below_max_tokens(proxy):
    upstream = httpx.get(f"{proxy}/health").json()["replicas"][0]["url"]
    fields = {"temperature": 0.3, "top_p": 0.7, "top_k": 4}
    assert post(proxy, {"model": "m", "max_tokens": 7, "messages": USER, **fields}).status_code == 200
    params = httpx.get(f"{upstream}/_generated").json()[-1]["sampling_params"]
    assert {k: params[k] for k in [*fields, "max_tokens"]} == {**fields, "max_tokens": 7}
    thinking = {"type": "enabled", "budget_tokens": 1024}
    says = "'thinking.budget_tokens' (1024) must be less than 'max_tokens' (1000)"
    refused = post(proxy, {"model": "m", "max_tokens": 1000, "messages": USER, "thinking": thinking})
    assert anthropic_error(refused, 400, "invalid_request_error") == says
    with pytest.raises(BadRequest) as raised:
        decode(messages=USER, thinking=thinking)
    assert (raised.value.param, raised.value.message) == (
        "thinking.budget_tokens",
        "'thinking.budget_tokens' (1024) must be less than 'max_tokens' (9)",
    )


def test_a_failed_generation_is_an_api_error_and_tool_choice_none_leaves_a_call_as_text(qwen3_tools):
    url, upstream = qwen3_tools
    ids = loaded_tokenizer(str(qwen3_tokenizer_dir())).encode("Hi.")
    broken = [{"token_ids": ids, "finish_reason": "stop", "logprobs": [-0.5]}]  # the stand-in fails: 500
    httpx.post(f"{upstream}/_script", json=broken).raise_for_status()
    request = {"model": "m", "max_tokens": 50, "messages": USER, "thinking": {"type": "disabled"}}
    says = anthropic_error(post(url, request, "/s/failed/v1/messages"), 502, "api_error")
    assert says.startswith("vLLM failed with HTTP 500")
    assert httpx.get(f"{url}/v1/sessions/failed").json()["segments"] == []  # nothing recorded
    call = qwen3_call('{"city": "Paris"}')
    scripted(upstream, call)
    request |= {"tools": [ANTHROPIC_WEATHER_TOOL], "tool_choice": {"type": "none"}}
    reply = post(url, request, "/s/none/v1/messages").json()
    assert (reply["content"], reply["stop_reason"]) == ([{"type": "text", "text": call}], "end_turn")
    assert "structured_outputs" not in httpx.get(f"{upstream}/_generated").json()[-1]["sampling_params"]
