"""The Gemini API (issue 30), in process: `contents` decoded into the template's messages,
Google's OpenAPI schemas read as JSON schemas, function calling modes, replies whole, streamed
(`alt=sse` and the JSON array), `countTokens`, the models routes, keys as `x-goog-api-key` or
`?key=`, and every error in Google's shape. The stand-in vLLM always samples "Hello there.";
what needs real sampling (calls, thoughts, forced calls, JSON output, exact ids) is in
`tests/test_gemini_vllm.py`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from google import genai
from google.genai import types
from vllm.entrypoints.generate.base.protocol import DeltaMessage

from molt_proxy.config import DEFAULT_SIDE_REQUESTS, Settings
from molt_proxy.errors import BadRequest, UpstreamError
from molt_proxy.launcher import free_port
from molt_proxy.types import ParsedReply, RecordedReply
from molt_proxy.wire.events import Delta, Opened
from molt_proxy.wire.gemini import decode_count_request, decode_generate_request, json_schema
from molt_proxy.wire.gemini_contents import signed_reasoning, thought_signature
from molt_proxy.wire.gemini_reply import content_parts, encode_response, encode_stream
from tests.conftest import MAX_MODEL_LEN
from tests.helpers import trajectories
from tests.inprocess import REPLY_TEXT, inprocess_proxy, qwen3_tokenizer_dir, serve_app

GENERATE = "/v1beta/models/tiny:generateContent"
STREAM = "/v1beta/models/tiny:streamGenerateContent"
COUNT = "/v1beta/models/tiny:countTokens"
HI = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}
WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "parameters": {
        "type": "OBJECT",
        "properties": {"city": {"type": "STRING", "description": "The city name."}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    db = tmp_path_factory.mktemp("gemini") / "p.db"
    with inprocess_proxy(db, max_model_len=MAX_MODEL_LEN, max_request_bytes=200_000) as url:
        yield url


def decode(**body: Any) -> Any:
    return decode_generate_request(json.dumps(body).encode(), "tiny")


def google_error(response: httpx.Response, code: int, status: str) -> str:
    """The message of a Google-shaped error, checked."""
    assert response.status_code == code, response.text
    error = response.json()["error"]
    assert set(error) == {"code", "message", "status"} and (error["code"], error["status"]) == (code, status)
    return error["message"]


# -- decoding ----------------------------------------------------------------------------------


def test_contents_decode_into_the_templates_messages():
    signature = thought_signature("Look it up.")
    call = decode(
        systemInstruction={"parts": [{"text": "You are a weather assistant."}, {"text": "Be brief."}]},
        contents=[
            {"role": "user", "parts": [{"text": "<context>"}, {"text": "Weather in Paris and London?"}]},
            {
                "role": "model",
                "parts": [
                    {"text": "Checking", "thought": False},
                    {"text": "."},
                    {
                        "functionCall": {
                            "id": "get_weather__chatcmpl-tool-1",
                            "name": "get_weather",
                            "args": {"city": "Paris"},
                        },
                        "thoughtSignature": signature,
                    },
                    {"functionCall": {"name": "get_weather", "args": {"city": "London"}}},
                ],
            },
            {
                "role": "user",
                "parts": [
                    {
                        "functionResponse": {
                            "id": "get_weather__chatcmpl-tool-1",
                            "name": "get_weather",
                            "response": {"output": "Sunny, 22 C."},
                        }
                    },
                    {"functionResponse": {"name": "get_weather", "response": {"output": "Rainy, 14 C."}}},
                    {"functionResponse": {"name": "other", "response": {"error": "no such tool"}}},
                    {"text": "Thanks"},
                ],
            },
        ],
    )
    assert call.conversation.messages == [
        {"role": "system", "content": "You are a weather assistant.\nBe brief."},
        {"role": "user", "content": "<context>\nWeather in Paris and London?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Look it up.",  # from the signature: the thought part was dropped
            "tool_calls": [
                {
                    "id": "chatcmpl-tool-1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                },
                {
                    "id": "get_weather-1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "London"}},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "Sunny, 22 C."},
        {"role": "tool", "tool_call_id": "get_weather-1", "content": "Rainy, 14 C."},  # the call left
        {"role": "tool", "tool_call_id": "other", "content": '{"error": "no such tool"}'},
        {"role": "user", "content": "Thanks"},
    ]
    assert call.conversation.call_ids == {"chatcmpl-tool-1", "get_weather-1", "other"}


def test_a_thought_signature_stands_for_the_exact_reasoning_in_either_base64_alphabet():
    text = "Plan: ?>>> é \n"
    signature = thought_signature(text)
    assert signed_reasoning(signature) == text
    assert signed_reasoning(signature.replace("-", "+").replace("_", "/")) == text
    assert signed_reasoning("skip_thought_signature_validator") is None  # Gemini CLI's own
    assert signed_reasoning(None) is None
    thoughts = decode(
        contents=[
            {"role": "user", "parts": [{"text": "Hi"}]},
            {
                "role": "model",
                "parts": [
                    {"text": "The user ", "thought": True},
                    {"text": "greets me.", "thought": True},
                    {"text": "Hello!"},
                ],
            },
            {"role": "user", "parts": [{"text": "Again"}]},
        ]
    )
    assert thoughts.conversation.messages[1] == {
        "role": "assistant",
        "content": "Hello!",
        "reasoning_content": "The user greets me.",
    }


def test_openapi_schemas_read_as_json_schemas():
    assert json_schema(
        {
            "type": "OBJECT",
            "properties": {
                "zone": {"type": "STRING", "enum": ["a", "b"], "nullable": True},
                "days": {"type": "ARRAY", "items": {"type": "INTEGER"}, "maxItems": "3"},
            },
            "propertyOrdering": ["zone", "days"],
            "required": ["zone"],
        }
    ) == {
        "type": "object",
        "properties": {
            "zone": {"type": ["string", "null"], "enum": ["a", "b"]},
            "days": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
        },
        "required": ["zone"],
    }
    plain = {"type": "object", "properties": {"x": {"type": "number"}}}
    assert json_schema(plain) == plain


def test_function_declarations_are_chat_tools_and_calling_modes_are_tool_choices():
    jsonschema = {"name": "get_time", "parametersJsonSchema": {"type": "object", "properties": {}}}
    tools = [{"functionDeclarations": [WEATHER, jsonschema]}, {"googleSearch": {}}]
    call = decode(contents=HI["contents"], tools=tools)
    assert call.conversation.tools == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Get the current weather in a city.",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "description": "The city name."}},
                    "required": ["city"],
                },
            },
        },
        {
            "type": "function",
            "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
        },
    ]

    def choice(config: dict[str, Any]) -> Any:
        request = decode(contents=HI["contents"], tools=tools, toolConfig={"functionCallingConfig": config})
        request = request.conversation.parser_request
        return request.tool_choice, [t.function.name for t in request.tools or []]

    both = ["get_weather", "get_time"]
    assert choice({}) == ("auto", both)
    assert choice({"mode": "NONE"}) == ("none", both)
    assert choice({"mode": "ANY"}) == ("required", both)
    named = choice({"mode": "ANY", "allowedFunctionNames": ["get_time"]})
    assert named[0].function.name == "get_time" and named[1] == both
    three = [{"functionDeclarations": [WEATHER, jsonschema, {**jsonschema, "name": "x"}]}]
    subset = decode(
        contents=HI["contents"],
        tools=three,
        toolConfig={"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["get_time", "x"]}},
    )
    assert subset.conversation.parser_request.tool_choice == "required"  # constrained to those two
    assert [t.function.name for t in subset.conversation.parser_request.tools] == ["get_time", "x"]
    assert len(subset.conversation.tools) == 3  # every tool is rendered


def test_generation_config_is_the_sampling_and_thinking_config_the_template_switch():
    call = decode(
        contents=HI["contents"],
        generationConfig={
            "temperature": 0.5,
            "topP": 0.9,
            "topK": 40.0,
            "maxOutputTokens": 12,
            "stopSequences": ["END"],
            "seed": 7,
            "presencePenalty": 0.1,
            "frequencyPenalty": 0.2,
            "candidateCount": 1,
            "thinkingConfig": {"includeThoughts": True, "thinkingBudget": 1024},
        },
    )
    sampling = call.conversation.sampling
    assert (sampling["temperature"], sampling["top_p"], sampling["top_k"], sampling["seed"]) == (
        0.5,
        0.9,
        40,
        7,
    )
    assert (sampling["stop"], sampling["presence_penalty"], sampling["frequency_penalty"]) == (
        ["END"],
        0.1,
        0.2,
    )
    assert call.conversation.max_tokens == 12 and call.conversation.fit_max_tokens
    as_string = decode(contents=HI["contents"], generationConfig={"maxOutputTokens": "12"})  # int64 as JSON
    assert as_string.conversation.max_tokens == 12
    assert call.include_thoughts and call.conversation.template_kwargs == {"enable_thinking": True}
    off = decode(contents=HI["contents"], generationConfig={"thinkingConfig": {"thinkingBudget": 0}})
    assert off.conversation.template_kwargs == {"enable_thinking": False} and not off.include_thoughts
    assert decode(**HI).conversation.template_kwargs == {}
    schema = {"type": "OBJECT", "properties": {"zone": {"type": "STRING"}}}
    json_out = decode(
        contents=HI["contents"],
        generationConfig={"responseMimeType": "application/json", "responseSchema": schema},
    ).conversation.parser_request.response_format
    assert json_out.type == "json_schema"
    assert json_out.json_schema.json_schema == {"type": "object", "properties": {"zone": {"type": "string"}}}
    plain = decode(contents=HI["contents"], generationConfig={"responseMimeType": "application/json"})
    assert plain.conversation.parser_request.response_format.type == "json_object"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"contents": []}, "contents"),
        ({"contents": [{"role": "tool", "parts": [{"text": "x"}]}]}, "contents.0.role"),
        (
            {"contents": [{"parts": [{"inlineData": {"mimeType": "image/png", "data": "AA=="}}]}]},
            "contents.0.parts.0.inlineData",
        ),
        ({"contents": [{"parts": [{"fileData": {"fileUri": "gs://x"}}]}]}, "contents.0.parts.0.fileData"),
        ({"contents": [{"parts": [{"functionCall": {"name": "f", "args": {}}}]}]}, "contents.0.parts.0"),
        (
            {"contents": [{"role": "model", "parts": [{"functionCall": {"name": "f", "args": "{}"}}]}]},
            "contents.0.parts.0.functionCall.args",
        ),
        ({**HI, "cachedContent": "cachedContents/1"}, "cachedContent"),
        ({**HI, "generationConfig": {"candidateCount": 2}}, "generationConfig.candidateCount"),
        ({**HI, "generationConfig": {"temperature": 3}}, "generationConfig.temperature"),
        ({**HI, "generationConfig": {"topP": 0}}, "generationConfig.topP"),
        ({**HI, "generationConfig": {"maxOutputTokens": 0}}, "max_tokens"),
        ({**HI, "generationConfig": {"stopSequences": [""]}}, "generationConfig.stopSequences"),
        (
            {**HI, "generationConfig": {"responseMimeType": "text/x.enum"}},
            "generationConfig.responseMimeType",
        ),
        (
            {**HI, "generationConfig": {"responseSchema": {"type": "OBJECT"}}},
            "generationConfig.responseMimeType",
        ),
        ({**HI, "generationConfig": {"responseLogprobs": True}}, "generationConfig.responseLogprobs"),
        (
            {**HI, "generationConfig": {"responseModalities": ["IMAGE"]}},
            "generationConfig.responseModalities",
        ),
        (
            {**HI, "toolConfig": {"functionCallingConfig": {"mode": "ANY"}}},
            "toolConfig.functionCallingConfig.mode",
        ),
        (
            {
                **HI,
                "tools": [{"functionDeclarations": [WEATHER]}],
                "toolConfig": {"functionCallingConfig": {"mode": "VALIDATED"}},
            },
            "toolConfig.functionCallingConfig.mode",
        ),
        (
            {
                **HI,
                "tools": [{"functionDeclarations": [WEATHER]}],
                "toolConfig": {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["nope"]}},
            },
            "toolConfig.functionCallingConfig.allowedFunctionNames",
        ),
        (
            {
                **HI,
                "tools": [{"functionDeclarations": [WEATHER]}],
                "toolConfig": {
                    "functionCallingConfig": {"mode": "AUTO", "allowedFunctionNames": ["get_weather"]}
                },
            },
            "toolConfig.functionCallingConfig.allowedFunctionNames",
        ),
        (
            {
                **HI,
                "tools": [
                    {"functionDeclarations": [{"name": "f", "parameters": {}, "parametersJsonSchema": {}}]}
                ],
            },
            "tools.0.functionDeclarations.0",
        ),
    ],
)
def test_bad_requests_are_refused_naming_the_field(body, param):
    with pytest.raises(BadRequest) as refused:
        decode(**body)
    assert refused.value.param == param.replace("max_tokens", "generationConfig.maxOutputTokens")


def test_count_requests_take_contents_or_a_whole_generate_request():
    plain = decode_count_request(json.dumps(HI).encode(), "tiny")
    wrapped = decode_count_request(
        json.dumps({"generateContentRequest": {**HI, "model": "models/tiny"}}).encode(), "tiny"
    )
    assert plain.messages == wrapped.messages == [{"role": "user", "content": "hi"}]
    with pytest.raises(BadRequest):
        decode_count_request(json.dumps({**HI, "generateContentRequest": HI}).encode(), "tiny")


def test_reply_parts_carry_the_signature_where_gemini_puts_it():
    call = {
        "id": "chatcmpl-tool-7",
        "type": "function",
        "function": {"name": "f", "arguments": '{"b": 1, "a": 2}'},
    }
    reasoning = ParsedReply(content="\n\n", reasoning_content="Think.", tool_calls=[call])
    signature = thought_signature("Think.")
    assert content_parts(reasoning, include_thoughts=True) == [
        {"text": "Think.", "thought": True},
        {
            "functionCall": {"id": "chatcmpl-tool-7", "name": "f", "args": {"b": 1, "a": 2}},
            "thoughtSignature": signature,
        },
    ]
    text = ParsedReply(content="\n\nHello!", reasoning_content="Think.")
    assert content_parts(text, include_thoughts=False) == [
        {"text": "\n\nHello!", "thoughtSignature": signature}
    ]
    assert content_parts(ParsedReply(content="", reasoning_content="Think."), include_thoughts=False) == [
        {"text": "", "thoughtSignature": signature}
    ]
    reply = RecordedReply("chatcmpl-1", 0, "tiny", text, "length", prompt_tokens=5, completion_tokens=9)
    encoded = encode_response(reply, False, lambda s: 3)
    assert encoded["candidates"][0]["finishReason"] == "MAX_TOKENS"
    assert encoded["usageMetadata"] == {
        "promptTokenCount": 5,
        "candidatesTokenCount": 6,
        "totalTokenCount": 14,
        "thoughtsTokenCount": 3,
    }
    assert (encoded["modelVersion"], encoded["responseId"]) == ("tiny", "chatcmpl-1")


# -- the routes --------------------------------------------------------------------------------


def chunks(text: str) -> list[dict[str, Any]]:
    return [json.loads(line.removeprefix("data: ")) for line in text.split("\n\n") if line]


def test_whole_streamed_and_array_replies_agree_and_record_one_turn_each(proxy):
    whole = httpx.post(f"{proxy}/s/g-whole{GENERATE}", json=HI).json()
    assert whole["candidates"][0]["content"] == {"role": "model", "parts": [{"text": REPLY_TEXT}]}
    assert whole["candidates"][0]["finishReason"] == "STOP"
    prompt = httpx.post(f"{proxy}/s/g-whole{COUNT}", json=HI).json()["totalTokens"]
    assert whole["usageMetadata"]["promptTokenCount"] == prompt
    sse = httpx.post(f"{proxy}/s/g-sse{STREAM}", params={"alt": "sse"}, json=HI)
    assert sse.headers["content-type"].startswith("text/event-stream")
    streamed = chunks(sse.text)
    array = httpx.post(f"{proxy}/s/g-array{STREAM}", json=HI)
    assert array.headers["content-type"].startswith("application/json")
    for got in (streamed, array.json()):
        assert len(got) > 2  # real streaming: a chunk per release of text
        text = "".join(p["text"] for c in got for p in c["candidates"][0]["content"]["parts"])
        assert text == REPLY_TEXT
        assert got[-1]["candidates"][0]["finishReason"] == "STOP"
        assert got[-1]["usageMetadata"] == whole["usageMetadata"]
        assert all("finishReason" not in c["candidates"][0] for c in got[:-1])
    for session in ("g-whole", "g-sse", "g-array"):
        segments = httpx.get(f"{proxy}/v1/sessions/{session}").json()["segments"]
        assert len(segments) == 1 and len(segments[0]["turns"]) == 1


def test_count_tokens_equals_the_prompt_a_turn_sends_on_its_session(proxy):
    body = {**HI, "systemInstruction": {"parts": [{"text": "Be brief."}]}}
    counted = httpx.post(f"{proxy}/s/g-count{COUNT}", json=body).json()["totalTokens"]
    wrapped = httpx.post(f"{proxy}/s/g-count{COUNT}", json={"generateContentRequest": body}).json()
    assert wrapped == {"totalTokens": counted}
    sent = httpx.post(f"{proxy}/s/g-count{GENERATE}", json=body).json()["usageMetadata"]["promptTokenCount"]
    assert sent == counted
    assert len(httpx.get(f"{proxy}/v1/sessions/g-count").json()["segments"][0]["turns"]) == 1


def test_models_are_listed_and_described_as_gemini_lists_them(proxy):
    listed = httpx.get(f"{proxy}/v1beta/models").json()["models"]
    assert [m["name"] for m in listed] == ["models/tiny"]
    assert listed[0]["inputTokenLimit"] == MAX_MODEL_LEN
    assert "generateContent" in listed[0]["supportedGenerationMethods"]
    assert httpx.get(f"{proxy}/s/x/v1beta/models/tiny").json() == listed[0]
    google_error(httpx.get(f"{proxy}/v1beta/models/gemini-2.5-pro"), 404, "NOT_FOUND")


def test_every_error_has_googles_shape(proxy):
    assert "JSON" in google_error(
        httpx.post(proxy + GENERATE, content=b"{", headers={"content-type": "application/json"}),
        400,
        "INVALID_ARGUMENT",
    )
    message = google_error(
        httpx.post(proxy + GENERATE, json={**HI, "generationConfig": {"candidateCount": 3}}),
        400,
        "INVALID_ARGUMENT",
    )
    assert "candidateCount" in message
    streamed = httpx.post(
        proxy + STREAM, params={"alt": "sse"}, json={"contents": [{"parts": [{"inlineData": {}}]}]}
    )
    assert "text only" in google_error(streamed, 400, "INVALID_ARGUMENT")
    assert "embedContent" in google_error(
        httpx.post(proxy + "/v1beta/models/tiny:embedContent", json=HI), 404, "NOT_FOUND"
    )
    google_error(httpx.post(proxy + "/v1beta/tunedModels/x:generateContent", json=HI), 404, "NOT_FOUND")
    google_error(httpx.delete(proxy + "/v1beta/models/tiny"), 404, "NOT_FOUND")
    big = {"contents": [{"parts": [{"text": "x" * 300_000}]}]}
    assert "over" in google_error(httpx.post(proxy + GENERATE, json=big), 400, "INVALID_ARGUMENT")
    plain = httpx.post(proxy + GENERATE, content=json.dumps(HI), headers={"content-type": "text/plain"})
    assert plain.status_code in (400, 415) and plain.json()["error"]["status"] == "INVALID_ARGUMENT"
    long = {"contents": [{"parts": [{"text": "word " * (MAX_MODEL_LEN + 10)}]}]}
    assert "context length" in google_error(httpx.post(proxy + GENERATE, json=long), 400, "INVALID_ARGUMENT")
    # a closed session takes no more turns: Google's FAILED_PRECONDITION
    httpx.post(f"{proxy}/s/g-closed{GENERATE}", json=HI).raise_for_status()
    httpx.post(f"{proxy}/v1/rewards", json={"session_id": "g-closed", "reward": 1}).raise_for_status()
    google_error(httpx.post(f"{proxy}/s/g-closed{GENERATE}", json=HI), 400, "FAILED_PRECONDITION")
    # the OpenAI routes keep OpenAI's shape
    assert (
        httpx.post(proxy + "/v1/chat/completions", content=b"{").json()["error"]["type"]
        == "invalid_request_error"
    )


def test_an_unreachable_vllm_is_unavailable(tmp_path):
    nowhere = f"http://127.0.0.1:{free_port()}"  # no vLLM listens there
    settings = Settings(model=str(qwen3_tokenizer_dir()), upstreams=[nowhere], db_path=tmp_path / "down.db")
    with serve_app(settings) as proxy:
        google_error(httpx.post(f"{proxy}/s/down{GENERATE}", json=HI), 503, "UNAVAILABLE")
        google_error(
            httpx.post(f"{proxy}/s/down{STREAM}", params={"alt": "sse"}, json=HI), 503, "UNAVAILABLE"
        )
        google_error(httpx.get(f"{proxy}/v1beta/models"), 503, "UNAVAILABLE")


ADMIN_KEY = "admin-0123456789abcdef"
AGENT_KEY = "agent-0123456789abcdef"


def test_keys_come_as_x_goog_api_key_or_the_key_query_parameter(tmp_path):
    with inprocess_proxy(tmp_path / "keys.db", admin_key=ADMIN_KEY, agent_keys=[AGENT_KEY]) as proxy:
        assert "x-goog-api-key" in google_error(httpx.post(proxy + GENERATE, json=HI), 401, "UNAUTHENTICATED")
        wrong = httpx.post(proxy + GENERATE, json=HI, headers={"x-goog-api-key": "nope"})
        google_error(wrong, 401, "UNAUTHENTICATED")
        google_error(httpx.post(proxy + GENERATE, params={"key": "nope"}, json=HI), 401, "UNAUTHENTICATED")
        by_header = httpx.post(proxy + GENERATE, json=HI, headers={"x-goog-api-key": AGENT_KEY})
        assert by_header.status_code == 200, by_header.text
        by_query = httpx.post(proxy + STREAM, params={"alt": "sse", "key": AGENT_KEY}, json=HI)
        assert (
            by_query.status_code == 200
            and chunks(by_query.text)[-1]["candidates"][0]["finishReason"] == "STOP"
        )
        counted = httpx.post(proxy + COUNT, params={"key": AGENT_KEY}, json=HI)
        assert counted.status_code == 200 and counted.json()["totalTokens"] > 0
        # a session key chats on its own session only
        created = httpx.post(proxy + "/v1/sessions", headers={"x-goog-api-key": AGENT_KEY}).json()
        own = {"x-goog-api-key": created["api_key"]}
        ok = httpx.post(f"{proxy}/s/{created['session_id']}{GENERATE}", json=HI, headers=own)
        assert ok.status_code == 200
        google_error(
            httpx.post(f"{proxy}/s/another{GENERATE}", json=HI, headers=own), 403, "PERMISSION_DENIED"
        )
        # the trainer's routes are the admin's: a key in the query is read on the Gemini routes only
        assert httpx.get(proxy + "/v1/trajectories", params={"key": ADMIN_KEY}).status_code == 401


def test_a_title_request_is_a_side_request_on_the_gemini_route_too(proxy):
    rule = DEFAULT_SIDE_REQUESTS[0]
    title = {
        "systemInstruction": {"parts": [{"text": "Write a concise, sentence-case title for this chat."}]},
        "contents": HI["contents"],
    }
    for path, params in ((GENERATE, {}), (STREAM, {"alt": "sse"})):
        httpx.post(f"{proxy}/s/g-main{path}", params=params, json=title).raise_for_status()
    listed = trajectories(proxy)
    side = [t for t in listed if t["session_id"].startswith("side-") and t["info"] == {"rule": rule}]
    assert len(side) >= 2 and all(t["status"] == "side" for t in side)
    assert httpx.get(f"{proxy}/v1/sessions/g-main").status_code == 404  # never opened


# -- Google's own SDK as the client ------------------------------------------------------------


def test_the_google_genai_sdk_generates_streams_counts_and_lists_through_the_proxy(proxy):

    client = genai.Client(api_key="-", http_options=types.HttpOptions(base_url=f"{proxy}/s/g-sdk"))
    config = types.GenerateContentConfig(temperature=0, system_instruction="Be brief.")
    reply = client.models.generate_content(model="tiny", contents="hi", config=config)
    assert reply.text == REPLY_TEXT and reply.candidates[0].finish_reason == types.FinishReason.STOP
    plain = client.models.generate_content(model="tiny", contents="hi")
    counted = client.models.count_tokens(model="tiny", contents="hi").total_tokens
    assert counted == plain.usage_metadata.prompt_token_count < reply.usage_metadata.prompt_token_count
    # on a session of its own: the same body again on the same session is a retry, replayed whole
    streaming = genai.Client(api_key="-", http_options=types.HttpOptions(base_url=f"{proxy}/s/g-sdk-stream"))
    pieces = list(streaming.models.generate_content_stream(model="tiny", contents="hi", config=config))
    assert len(pieces) > 2 and "".join(p.text or "" for p in pieces) == REPLY_TEXT
    assert pieces[-1].usage_metadata.total_token_count == reply.usage_metadata.total_token_count
    assert [m.name for m in client.models.list()] == ["models/tiny"]
    assert client.models.get(model="tiny").input_token_limit == MAX_MODEL_LEN
    with pytest.raises(genai.errors.ClientError) as refused:
        client.models.generate_content(
            model="tiny", contents="hi", config=types.GenerateContentConfig(candidate_count=2)
        )
    assert (refused.value.code, refused.value.status) == (400, "INVALID_ARGUMENT")


def test_a_stream_that_fails_after_its_first_chunk_ends_with_googles_error_object():

    async def events() -> Any:
        yield Opened("chatcmpl-1", 0, "tiny", "s")
        yield Delta(DeltaMessage(content="Hel"))
        raise UpstreamError("vLLM failed")

    async def lines() -> list[str]:
        return [line async for line in encode_stream(events(), False, len)]

    first, last = asyncio.run(lines())
    assert json.loads(first.removeprefix("data: "))["candidates"][0]["content"]["parts"] == [{"text": "Hel"}]
    assert json.loads(last.removeprefix("data: ")) == {
        "error": {"code": 502, "message": "vLLM failed", "status": "UNAVAILABLE"}
    }
