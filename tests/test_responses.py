"""The OpenAI Responses API (issue 13), in process: `input` items decoded into the template's
messages, replies and streamed events through the real `openai` SDK's `client.responses`,
stateless and stored conversations (`previous_response_id`, GET, DELETE), errors in OpenAI's
shape. The real Qwen3 and Llama-3.2 tokenizers, templates and vLLM parsers run in front of the
stand-in vLLM, answering the ids each test scripts (`tests/test_echo.py`); what needs real
sampling (exact logprobs, streamed tool calls) is in `tests/test_responses_vllm.py`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import httpx
import openai
import pytest
from vllm.entrypoints.generate.base.protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall
from vllm.tool_parsers.utils import custom_tool_parameters

from devtools.scripts import AGENTS_SDK_WEATHER_TOOL, WEATHER_TOOL, weather_episode
from molt_proxy.errors import UpstreamError
from molt_proxy.types import ParsedReply, RecordedReply
from molt_proxy.wire.events import Closed, Delta, Opened, StreamEvent
from molt_proxy.wire.responses import conversation, decode_responses_request
from molt_proxy.wire.responses_items import encrypted_reasoning
from molt_proxy.wire.responses_reply import ReplyShape, encode_response_stream
from tests.inprocess import inprocess_proxy, loaded_tokenizer
from tests.test_constrained import grammar
from tests.test_echo import Proxy, qwen3_call, served

RESPONSES_WEATHER_TOOL = {"type": "function", **WEATHER_TOOL["function"]}
INSTRUCTIONS = "You are a weather assistant."
QUESTION = "What is the weather in Paris?"


def chat_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def decode(**body: Any) -> Any:
    request = decode_responses_request(json.dumps({"model": "m", **body}).encode())
    return request, conversation(request, [])


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    with served("qwen3", tmp_path_factory.mktemp("responses") / "q.db") as proxy:
        yield proxy


@pytest.fixture(scope="module")
def thinking(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    """Qwen3 with its reasoning parser: every reply opens with a `<think>` block."""
    with served("qwen3", tmp_path_factory.mktemp("responses") / "t.db", reasoning_parser="qwen3") as proxy:
        yield proxy


def thought(text: str, reasoning: str = "Done.") -> str:
    return f"<think>\n{reasoning}\n</think>\n\n{text}"


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    with served("llama", tmp_path_factory.mktemp("responses") / "l.db") as proxy:
        yield proxy


def sdk(proxy: Proxy, session: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxy.url}/s/{session}/v1", api_key="-", max_retries=0)


def test_input_items_decode_into_the_templates_messages():
    crm = {"type": "function", "name": "find", "description": "Find.", "parameters": {"type": "object"}}
    request, decoded = decode(
        instructions="Be brief.",
        input=[
            {"role": "developer", "content": [{"type": "input_text", "text": "Base prompt."}]},
            {"type": "message", "role": "user", "id": "u1", "content": "Go"},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "encrypted_content": encrypted_reasoning("Look it up."),
                "content": None,
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Checking."}],
            },
            {
                "type": "function_call",
                "call_id": "call_7",
                "name": "get_weather",
                "arguments": '{"city":"P"}',
            },
            {"type": "custom_tool_call", "call_id": "call_8", "name": "apply_patch", "input": "*** Begin"},
            {"type": "function_call", "call_id": "x", "namespace": "crm", "name": "find", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_7", "output": "Sunny"},
            {
                "type": "custom_tool_call_output",
                "call_id": "call_8",
                "output": [{"type": "input_text", "text": "ok"}],
            },
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Done."}]},
            {"role": "assistant", "content": "Bye."},
            {"role": "developer", "content": "Later notice."},
        ],
        tools=[
            RESPONSES_WEATHER_TOOL,
            {"type": "custom", "name": "apply_patch", "description": "Patch.", "format": {"type": "text"}},
            {"type": "namespace", "name": "crm", "description": "CRM.", "tools": [crm]},
            {"type": "web_search"},
        ],
        reasoning={"effort": "none", "summary": "auto"},
        include=["reasoning.encrypted_content"],
        prompt_cache_key="k",
        client_metadata={"a": "b"},
        text={"verbosity": "low"},
        metadata={"session_id": "s-1"},
    )
    assert decoded.messages == [
        {"role": "system", "content": "Be brief.\n\nBase prompt."},
        {"role": "user", "content": "Go"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Look it up.",
            "tool_calls": [
                chat_call("chatcmpl-tool-7", "get_weather", '{"city":"P"}'),
                chat_call("chatcmpl-tool-8", "apply_patch", '{"input": "*** Begin"}'),
                chat_call("x", "crm__find", "{}"),
            ],
        },
        {"role": "tool", "tool_call_id": "chatcmpl-tool-7", "content": "Sunny"},
        {"role": "tool", "tool_call_id": "chatcmpl-tool-8", "content": "ok"},
        {"role": "assistant", "content": "Bye.", "reasoning_content": "Done."},
        {"role": "user", "content": "Later notice."},  # a later developer message, in place
    ]
    assert decoded.tools == [
        WEATHER_TOOL,
        {
            "type": "function",
            "function": {
                "name": "apply_patch",
                "description": "Patch.",
                "parameters": custom_tool_parameters(),
            },
        },
        {
            "type": "function",
            "function": {"name": "crm__find", "description": "Find.", "parameters": {"type": "object"}},
        },
    ]
    assert request.tools.custom == {"apply_patch"} and request.tools.namespaced == {
        "crm__find": ("crm", "find")
    }
    assert decoded.template_kwargs == {"enable_thinking": False}
    assert request.include_encrypted and request.store and not request.stream
    assert decoded.session_id == "s-1"
    assert decoded.call_ids == frozenset({"chatcmpl-tool-7", "chatcmpl-tool-8", "x"})


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_the_weather_script_as_items_renders_as_the_chat_it_means(arch):
    """The taught script sent as Responses items renders to the very text its chat request
    renders to (so the taught model answers it), also in the Agents SDK's spelling."""
    from tests.test_echo import _tokenizer_dir

    tokenizer = loaded_tokenizer(str(_tokenizer_dir(arch)))
    chat = weather_episode("hermes" if arch == "qwen3" else "llama3_json")["messages"]
    calls = chat[2]["tool_calls"]
    items = [
        {"role": "user", "content": chat[1]["content"]},
        *(
            {
                "type": "function_call",
                "call_id": c["id"],
                "name": "get_weather",
                "arguments": c["function"]["arguments"],
            }
            for c in calls
        ),
        *(
            {"type": "function_call_output", "call_id": m["tool_call_id"], "output": m["content"]}
            for m in chat[3 : 3 + len(calls)]
        ),
    ]
    end = 3 + len(calls)
    for tool, chat_tool in [
        (RESPONSES_WEATHER_TOOL, WEATHER_TOOL),
        ({**RESPONSES_WEATHER_TOOL, "strict": False}, AGENTS_SDK_WEATHER_TOOL),
    ]:
        _, decoded = decode(instructions=chat[0]["content"], input=items, tools=[tool])
        rendered = tokenizer.render(decoded.messages, decoded.tools, decoded.template_kwargs)
        assert rendered == tokenizer.render(chat[:end], [chat_tool], {})


def _items(response: Any) -> list[dict[str, Any]]:
    """The output items as an agent appends them to its next `input` (Codex keeps them whole)."""
    return [item.model_dump(exclude_none=True) for item in response.output]


def _results(response: Any, text: str = "Sunny, 22 C.") -> list[dict[str, Any]]:
    calls = [item for item in response.output if item.type == "function_call"]
    return [{"type": "function_call_output", "call_id": c.call_id, "output": text} for c in calls]


def _record(proxy: Proxy, session: str) -> dict[str, Any]:
    [record] = proxy.record(session)  # one segment
    return record


def test_stateless_tool_episode_with_reasoning_is_one_exact_segment(thinking):
    """Codex's way: the whole history resent as `input`, reasoning items echoed with their
    `encrypted_content` only (the summary dropped): one segment over the sampled ids."""
    client = sdk(thinking, "stateless")
    ask = {"model": "m", "instructions": INSTRUCTIONS, "tools": [RESPONSES_WEATHER_TOOL], "store": False}
    sampled = thinking.sample("<think>\nParis, then.\n</think>\n\n" + qwen3_call('{"city": "Paris"}'))
    question = [{"role": "user", "content": QUESTION}]
    first = client.responses.create(input=question, include=["reasoning.encrypted_content"], **ask)
    reasoning, call = first.output  # no message item for the whitespace between them
    assert (reasoning.type, reasoning.summary[0].text) == ("reasoning", "\nParis, then.\n")
    assert reasoning.encrypted_content == encrypted_reasoning("\nParis, then.\n")
    assert (call.type, call.name, call.arguments) == ("function_call", "get_weather", '{"city": "Paris"}')
    assert call.call_id.startswith("call_") and call.id == "fc_" + call.call_id.removeprefix("call_")
    assert first.status == "completed" and first.id.startswith("resp_") and first.session_id == "stateless"
    echoed = _items(first)
    echoed[0]["summary"] = []
    history = [*question, *echoed, *_results(first)]
    thinking.sample(thought("Sunny."))
    second = client.responses.create(input=history, **ask)
    assert second.output_text == "\n\nSunny." and [i.type for i in second.output] == ["reasoning", "message"]
    record = _record(thinking, "stateless")
    one, two = record["turns"]
    ids = record["token_ids"]
    assert ids[one["completion_start"] : one["completion_end"]] == sampled
    messages = [{"role": "system", "content": INSTRUCTIONS}, question[0]]
    prompt = thinking.tokenizer.encode(thinking.tokenizer.render(messages, [WEATHER_TOOL], {}))
    assert ids[: one["completion_start"]] == prompt and first.usage.input_tokens == len(prompt)
    assert (
        two["prompt_start"] == one["completion_end"] and second.usage.input_tokens == two["completion_start"]
    )
    restored = {**first.output[1].model_dump(), "id": "chatcmpl-tool-" + call.call_id.removeprefix("call_")}
    chat_history = [
        *messages,
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "\nParis, then.\n",
            "tool_calls": [chat_call(restored["id"], "get_weather", call.arguments)],
        },
        {"role": "tool", "tool_call_id": restored["id"], "content": "Sunny, 22 C."},
    ]  # fmt: skip
    rest = thinking.tokenizer.ids_bytes(ids[two["prompt_start"] : two["completion_start"]])
    assert thinking.tokenizer.render(chat_history, [WEATHER_TOOL], {}).encode().endswith(rest)


def test_llama_stateless_tool_episode_is_one_segment(llama):
    client = sdk(llama, "llama")
    ask = {"model": "m", "instructions": INSTRUCTIONS, "tools": [RESPONSES_WEATHER_TOOL], "store": False}
    llama.sample('{"name": "get_weather", "parameters": {"city":"Paris"}}')
    question = [{"role": "user", "content": QUESTION}]
    first = client.responses.create(input=question, **ask)
    [call] = first.output
    assert (call.type, call.name, json.loads(call.arguments)) == (
        "function_call",
        "get_weather",
        {"city": "Paris"},
    )
    llama.sample("It is sunny.")
    second = client.responses.create(input=[*question, *_items(first), *_results(first)], **ask)
    assert second.output_text == "It is sunny."
    record = _record(llama, "llama")
    messages = [{"role": "system", "content": INSTRUCTIONS}, question[0]]
    prompt = llama.tokenizer.encode(llama.tokenizer.render(messages, [WEATHER_TOOL], {}))
    assert record["token_ids"][: record["turns"][0]["completion_start"]] == prompt


def test_stored_conversation_continues_by_previous_response_id(thinking):
    client = sdk(thinking, "stored")
    ask = {"model": "m", "instructions": INSTRUCTIONS, "tools": [RESPONSES_WEATHER_TOOL]}
    thinking.sample("<think>\nParis.\n</think>\n\n" + qwen3_call('{"city": "Paris"}'))
    first = client.responses.create(input=QUESTION, **ask)
    assert [i.type for i in first.output] == ["reasoning", "function_call"]
    assert first.output[0].encrypted_content is None  # not asked for; kept in the store
    thinking.sample(thought("Sunny."))
    second = client.responses.create(input=_results(first), previous_response_id=first.id, **ask)
    assert second.previous_response_id == first.id and second.output_text == "\n\nSunny."
    # The id alone names the session: no session in the path.
    plain = openai.OpenAI(base_url=f"{thinking.url}/v1", api_key="-", max_retries=0)
    thinking.sample(thought("Bye."))
    third = plain.responses.create(input="Thanks!", previous_response_id=second.id, **ask)
    assert third.session_id == "stored"
    assert plain.responses.retrieve(second.id).model_dump() == second.model_dump()
    assert client.responses.retrieve(first.id).output[0].encrypted_content is None
    ids = [f"chatcmpl-{r.id.removeprefix('resp_')}" for r in (first, second, third)]
    # Qwen3's template drops earlier reasoning once a user message follows: a new chain.
    assert thinking.segments("stored") == [ids[:2], ids[2:]]
    other = sdk(thinking, "other")
    with pytest.raises(openai.ConflictError, match="belongs to session 'stored'"):
        other.responses.create(input="x", previous_response_id=second.id, **ask)
    with pytest.raises(openai.NotFoundError, match="in session 'other'"):
        other.responses.retrieve(second.id)
    client.responses.delete(second.id)
    for call in (lambda: client.responses.retrieve(second.id), lambda: client.responses.delete(second.id)):
        with pytest.raises(openai.NotFoundError, match="no stored response"):
            call()
    with pytest.raises(openai.NotFoundError, match="never stored"):
        client.responses.create(input="x", previous_response_id=second.id, **ask)
    unstored = client.responses.create(input=QUESTION, store=False, **ask)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    # rewards may name a response by its id
    reward = httpx.post(f"{thinking.url}/v1/rewards", json={"completion_id": third.id, "reward": 1.0})
    assert reward.status_code == 200 and reward.json()["session_id"] == "stored"
    with pytest.raises(openai.NotFoundError):  # a closed session's stored responses are gone
        client.responses.retrieve(third.id)


def test_codex_names_its_session_in_client_metadata(qwen3):
    """Codex sends no session hint of ours, but its own session id in `client_metadata` (one
    per `codex exec` run): its episode is that session. A path, `X-Session-Id` or
    `metadata.session_id` still wins; a `client_metadata.session_id` that is no string is no
    hint (the field is Codex's, so it is not refused)."""
    plain = openai.OpenAI(base_url=f"{qwen3.url}/v1", api_key="-", max_retries=0)
    codex = {"client_metadata": {"session_id": "codex-run-1", "thread_id": "t", "turn_id": "1"}}
    ask = {"model": "m", "instructions": INSTRUCTIONS, "tools": [RESPONSES_WEATHER_TOOL], "store": False}
    qwen3.sample(qwen3_call('{"city": "Paris"}'))
    question = [{"role": "user", "content": QUESTION}]
    first = plain.responses.create(input=question, extra_body=codex, **ask)
    qwen3.sample("Sunny.")
    later = {"client_metadata": {**codex["client_metadata"], "turn_id": "2"}}
    history = [*question, *_items(first), *_results(first)]
    second = plain.responses.create(input=history, extra_body=later, **ask)
    assert (first.session_id, second.session_id) == ("codex-run-1", "codex-run-1")
    assert len(_record(qwen3, "codex-run-1")["turns"]) == 2
    for client, body, named in (
        (sdk(qwen3, "by-path"), codex, "by-path"),
        (plain.with_options(default_headers={"X-Session-Id": "by-header"}), codex, "by-header"),
        (plain, {**codex, "metadata": {"session_id": "by-metadata"}}, "by-metadata"),
    ):
        assert client.responses.create(input=named, extra_body=body, **ask).session_id == named
    for ignored in (7, "", None):
        hint = {"client_metadata": {"session_id": ignored}}
        unnamed = plain.responses.create(input=f"hint {ignored!r}", extra_body=hint, **ask)
        assert len(unnamed.session_id) == 32 and unnamed.session_id.isalnum()  # inferred: a new uuid


def test_reply_and_stream_through_the_sdk(qwen3):
    client = sdk(qwen3, "streamed")
    whole = client.responses.create(model="m", input="hi", max_output_tokens=20)
    assert whole.output_text == "Hello there." and whole.usage.output_tokens == 4
    with client.responses.stream(model="m", input="hi", max_output_tokens=20) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * 3, "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.output_text == "Hello there." and final.status == "completed"
    assert final.usage.model_dump() == whole.usage.model_dump()
    qwen3.sample("Hello", finish_reason="length")
    cut = client.responses.create(model="m", input="again", max_output_tokens=1)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def test_constrained_requests_are_sent_with_structured_outputs(qwen3):
    client = sdk(qwen3, "constrained")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True}}
    qwen3.sample('{"a": 1}')
    assert client.responses.create(model="m", input="json", text=fmt).output_text == '{"a": 1}'
    qwen3.sample(qwen3_call('{"city": "Paris"}'))
    named = {"type": "function", "name": "get_weather"}
    forced = client.responses.create(
        model="m", input=QUESTION, tools=[RESPONSES_WEATHER_TOOL], tool_choice=named
    )
    assert forced.output[-1].type == "function_call"
    sent = httpx.get(f"{qwen3.upstream}/_generated").json()[-2:]
    # the schema as xgrammar's grammar without free whitespace (`tests/test_constrained.py`)
    assert sent[0]["sampling_params"]["structured_outputs"] == {"grammar": grammar(schema)["grammar"]}
    assert "structural_tag" in sent[1]["sampling_params"]["structured_outputs"]
    assert [t["constrained"] for r in qwen3.record("constrained") for t in r["turns"]] == [True, True]


BAD = [
    ({}, "input", "'input' must be a string"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input.0.content.0",
        "text only",
    ),
    (
        {"input": [{"type": "web_search_call", "id": "w"}]},
        "input.0.type",
        "'web_search_call' items are not supported",
    ),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id", "must be a string"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role", "must be user, assistant"),
    (
        {"input": "x", "tools": [RESPONSES_WEATHER_TOOL], "tool_choice": {"type": "allowed_tools"}},
        "tool_choice",
        "function or custom",
    ),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format", "json_schema"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "at least 1"),
    ({"input": "x", "temperature": 3}, "temperature", "[0, 2]"),
    ({"input": "x", "background": True}, "background", "not supported"),
    ({"input": "x", "previous_response_id": 7}, "previous_response_id", "non-empty string"),
    ({"input": "x", "include": "reasoning"}, "include", "array of strings"),
    (
        {"input": [{"type": "reasoning", "encrypted_content": "molt-reasoning:@@@"}]},
        "input.0.encrypted_content",
        "minted",
    ),
    ({"input": "x", "tools": [{"type": "function"}]}, "tools.0.name", "non-empty string"),
]


@pytest.mark.parametrize(("body", "param", "says"), BAD, ids=lambda v: str(v)[:40])
def test_bad_requests_get_openais_error_body(qwen3, body, param, says):
    response = httpx.post(f"{qwen3.url}/v1/responses", json={"model": "m", **body}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param) and says in error["message"]


def test_sdk_raises_the_matching_exceptions(qwen3):
    client = sdk(qwen3, "errors")
    with pytest.raises(openai.BadRequestError, match="'input' must hold a user or assistant message"):
        client.responses.create(model="m", input=[{"role": "system", "content": "only"}])
    with pytest.raises(openai.NotFoundError, match="no stored response 'resp_nope'"):
        client.responses.retrieve("resp_nope")
    with pytest.raises(openai.NotFoundError, match="previous response 'resp_nope' not found"):
        client.responses.create(model="m", input="x", previous_response_id="resp_nope")


def _stream(shape: ReplyShape, events: list[StreamEvent], fail: bool = False) -> list[dict[str, Any]]:
    async def turn() -> AsyncGenerator[StreamEvent]:
        for event in events:
            yield event
        if fail:
            raise UpstreamError("vLLM went away")

    async def collect() -> list[str]:
        return [line async for line in encode_response_stream(shape, turn())]

    lines = asyncio.run(collect())
    return [json.loads(line.split("data: ", 1)[1]) for line in lines]


def _call_delta(index: int, call_id: str | None, name: str | None, arguments: str) -> DeltaMessage:
    function = DeltaFunctionCall(name=name, arguments=arguments)
    return DeltaMessage(tool_calls=[DeltaToolCall(index=index, id=call_id, function=function)])


def test_streamed_items_add_up_to_the_sampled_reply_and_a_late_failure_is_response_failed():
    request, _ = decode(
        input="go",
        include=["reasoning.encrypted_content"],
        tools=[RESPONSES_WEATHER_TOOL, {"type": "custom", "name": "patch"}],
    )
    shape = ReplyShape(request, request.include_encrypted)
    calls = [
        chat_call("chatcmpl-tool-1", "get_weather", '{"city": "Paris"}'),
        chat_call("chatcmpl-tool-2", "patch", '{"input": "diff"}'),
    ]
    reply = RecordedReply("chatcmpl-9", 5, "m", ParsedReply("Ok.", "Hmm.", calls), "stop", 7, 30)
    events: list[StreamEvent] = [
        Opened("chatcmpl-9", 5, "m", "s", 7),
        Delta(DeltaMessage(reasoning="Hm")),
        Delta(DeltaMessage(reasoning="m.")),
        Delta(DeltaMessage(content="Ok.")),
        Delta(_call_delta(0, "chatcmpl-tool-1", "get_weather", '{"city": ')),
        Delta(_call_delta(0, None, None, '"Paris"}')),
        Delta(_call_delta(1, "chatcmpl-tool-2", "patch", '{"input": "diff"}')),
        Closed(reply, None),
    ]
    data = _stream(shape, events)
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    assert [d["type"] for d in data if d["type"].endswith("item.done")] == ["response.output_item.done"] * 4
    pieces = [d["delta"] for d in data if d["type"] == "response.function_call_arguments.delta"]
    assert pieces == ['{"city": ', '"Paris"}']
    final = data[-1]
    assert final["type"] == "response.completed"
    assert [d["item"] for d in data if d["type"] == "response.output_item.done"] == final["response"][
        "output"
    ]
    reasoning, message, call, custom = final["response"]["output"]
    assert reasoning["encrypted_content"] == encrypted_reasoning("Hmm.")
    assert message["content"][0]["text"] == "Ok." and call["arguments"] == '{"city": "Paris"}'
    assert (custom["type"], custom["input"], custom["call_id"]) == ("custom_tool_call", "diff", "call_2")
    failed = _stream(shape, events[:3], fail=True)[-1]
    assert failed["type"] == "response.failed"
    assert failed["response"]["error"] == {"code": "upstream_error", "message": "vLLM went away"}


def test_stored_responses_survive_a_restart(tmp_path):
    db = tmp_path / "restart.db"
    with served("qwen3", db) as proxy:
        first = sdk(proxy, "kept").responses.create(model="m", input="hi", instructions=INSTRUCTIONS)
    with served("qwen3", db) as proxy:
        client = sdk(proxy, "kept")
        assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
        second = client.responses.create(
            model="m", input="again", instructions=INSTRUCTIONS, previous_response_id=first.id
        )
        assert proxy.segments("kept") == [[f"chatcmpl-{r.id.removeprefix('resp_')}" for r in (first, second)]]


def test_keys_guard_the_responses_routes_and_an_agent_sees_only_its_own(tmp_path):
    with inprocess_proxy(tmp_path / "keys.db", admin_key="admin", agent_keys=["agent-x", "agent-y"]) as url:
        for method, path in [
            ("POST", "/v1/responses"),
            ("GET", "/v1/responses/r"),
            ("DELETE", "/v1/responses/r"),
        ]:
            response = httpx.request(method, url + path, json={"model": "m", "input": "hi"}, timeout=30)
            assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
        x = openai.OpenAI(base_url=f"{url}/v1", api_key="agent-x", max_retries=0)
        y = openai.OpenAI(base_url=f"{url}/v1", api_key="agent-y", max_retries=0)
        mine = x.responses.create(model="m", input="hi", metadata={"session_id": "x-1"})
        assert x.responses.retrieve(mine.id).id == mine.id
        with pytest.raises(openai.NotFoundError):  # another owner's response looks unknown
            y.responses.retrieve(mine.id)
        with pytest.raises(openai.NotFoundError, match="previous response"):
            y.responses.create(model="m", input="more", previous_response_id=mine.id)
