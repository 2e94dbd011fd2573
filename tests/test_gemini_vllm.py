"""The Gemini API against a real vLLM, by raw HTTP in the API's documented shapes: the taught
weather script's function-calling round trip, whole and streamed, echoed as Gemini CLI echoes
it; thought parts and their signatures; forced calls (`ANY`) and JSON output on the untaught
model. One exact segment each, the same record whole or streamed, and the response ids the
completions recorded."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from google import genai
from google.genai import types

from devtools.scripts import WEATHER_TOOL, weather_episode
from tests.helpers import assert_exact, trajectories

SCRIPT = weather_episode("hermes")["messages"]
WEATHER_DECLARATION = {
    "name": "get_weather",
    "description": WEATHER_TOOL["function"]["description"],
    "parameters": WEATHER_TOOL["function"]["parameters"],
}
GREEDY = {"temperature": 0, "maxOutputTokens": 60}


def generate(url: str, body: dict[str, Any], stream: bool) -> dict[str, Any]:
    """One `generateContent`, or a `streamGenerateContent?alt=sse` whose chunks are gathered
    into one response as a client does: text and thought pieces joined (the signature kept),
    calls in order, the last chunk's finish reason and usage. Streamed, it also checks there
    was more than one chunk and that only the last one finishes."""
    action = "streamGenerateContent" if stream else "generateContent"
    params = {"alt": "sse"} if stream else {}
    response = httpx.post(f"{url}/v1beta/models/tiny:{action}", params=params, json=body, timeout=300)
    assert response.status_code == 200, response.text
    if not stream:
        return response.json()
    chunks = [json.loads(line.removeprefix("data: ")) for line in response.text.split("\n\n") if line]
    assert all("finishReason" not in c["candidates"][0] for c in chunks[:-1])
    parts: list[dict[str, Any]] = []
    for chunk in chunks:
        for part in chunk["candidates"][0]["content"]["parts"]:
            last = parts[-1] if parts else None
            joins = last is not None and "text" in part and "text" in last and "thoughtSignature" not in last
            if joins and bool(part.get("thought")) == bool(last.get("thought")):
                last["text"] += part["text"]
                if "thoughtSignature" in part:
                    last["thoughtSignature"] = part["thoughtSignature"]
            elif part != {"text": ""}:
                parts.append(dict(part))
    gathered = {**chunks[-1], "candidates": [{**chunks[-1]["candidates"][0]}]}
    gathered["candidates"][0]["content"] = {"role": "model", "parts": parts}
    assert len({c["responseId"] for c in chunks}) == 1
    return gathered


def parts_of(response: dict[str, Any]) -> list[dict[str, Any]]:
    return response["candidates"][0]["content"]["parts"]


def as_gemini_cli_echoes(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A reply's parts as Gemini CLI sends them back: thought parts dropped (their signature
    stays where Gemini puts it), call ids prefixed with `<name>__`, args re-serialised with
    their keys in another order."""
    echoed = []
    for part in parts:
        if part.get("thought"):
            continue
        if "functionCall" in part:
            call = part["functionCall"]
            args = dict(reversed(list(call["args"].items())))
            part = {**part, "functionCall": {**call, "id": f"{call['name']}__{call['id']}", "args": args}}
        echoed.append(part)
    return echoed


def _weather_turns(url: str, stream: bool) -> list[dict[str, Any]]:
    body: dict[str, Any] = {
        "systemInstruction": {"parts": [{"text": SCRIPT[0]["content"]}]},
        "contents": [{"role": "user", "parts": [{"text": SCRIPT[1]["content"]}]}],
        "tools": [{"functionDeclarations": [WEATHER_DECLARATION]}],
        "generationConfig": GREEDY,
    }
    first = generate(url, body, stream)
    calls = [p["functionCall"] for p in parts_of(first)]
    assert [(c["name"], c["args"]) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "London"}),
    ]
    assert all(c["id"].startswith("chatcmpl-tool-") for c in calls)
    assert first["candidates"][0]["finishReason"] == "STOP"
    echoed = as_gemini_cli_echoes(parts_of(first))
    results = [SCRIPT[3]["content"], SCRIPT[4]["content"]]
    responses = [
        {
            "functionResponse": {
                "id": p["functionCall"]["id"],
                "name": "get_weather",
                "response": {"output": r},
            }
        }
        for p, r in zip(echoed, results, strict=True)
    ]
    body["contents"] += [{"role": "model", "parts": echoed}, {"role": "user", "parts": responses}]
    counted = httpx.post(f"{url}/v1beta/models/tiny:countTokens", json=body).json()["totalTokens"]
    second = generate(url, body, stream)
    assert parts_of(second) == [{"text": SCRIPT[5]["content"]}]
    assert counted == second["usageMetadata"]["promptTokenCount"]
    return [first, second]


def test_function_calling_round_trip_whole_and_streamed_is_one_exact_segment(
    qwen3_model, qwen3_vllm, start_proxy
):
    proxy = start_proxy(qwen3_model, qwen3_vllm, "--tool-call-parser", "hermes")
    whole = _weather_turns(f"{proxy.url}/s/g-whole", stream=False)
    streamed = _weather_turns(f"{proxy.url}/s/g-streamed", stream=True)
    for a, b in zip(whole, streamed, strict=True):
        strip = [
            {**p, "functionCall": {**p["functionCall"], "id": ""}} if "functionCall" in p else p
            for p in parts_of(a)
        ]
        strip_b = [
            {**p, "functionCall": {**p["functionCall"], "id": ""}} if "functionCall" in p else p
            for p in parts_of(b)
        ]
        assert strip == strip_b
        assert a["usageMetadata"] == b["usageMetadata"]
        assert a["candidates"][0]["finishReason"] == b["candidates"][0]["finishReason"]
    for replies in (whole, streamed):  # rewards may name a reply by its responseId
        body = {"completion_id": replies[-1]["responseId"], "reward": 1.0}
        httpx.post(f"{proxy.url}/v1/rewards", json=body).raise_for_status()
    records: dict[str, list[dict[str, Any]]] = {}
    for t in trajectories(proxy.url):
        records.setdefault(t["session_id"], []).append(t)
    [plain], [streamed_record] = records["g-whole"], records["g-streamed"]  # one segment each
    assert plain["token_ids"] == streamed_record["token_ids"]
    assert plain["loss_mask"] == streamed_record["loss_mask"]
    assert [t["completion_id"] for t in plain["turns"]] == [r["responseId"] for r in whole]
    assert [t["completion_id"] for t in streamed_record["turns"]] == [r["responseId"] for r in streamed]
    prompt = whole[0]["usageMetadata"]["promptTokenCount"]
    assert plain["turns"][0]["completion_start"] == prompt
    assert_exact(plain, qwen3_model)


def test_stop_sequences_and_max_output_tokens(qwen3_model, qwen3_vllm, start_proxy):
    proxy = start_proxy(qwen3_model, qwen3_vllm, "--tool-call-parser", "hermes")
    body: dict[str, Any] = {
        "systemInstruction": {"parts": [{"text": SCRIPT[0]["content"]}]},
        "contents": [
            {"role": "user", "parts": [{"text": SCRIPT[1]["content"]}]},
            {
                "role": "model",
                "parts": [
                    {"functionCall": {"name": "get_weather", "args": {"city": c}}}
                    for c in ("Paris", "London")
                ],
            },
            {
                "role": "user",
                "parts": [
                    {
                        "functionResponse": {
                            "name": "get_weather",
                            "response": {"output": SCRIPT[3 + i]["content"]},
                        }
                    }
                    for i in range(2)
                ],
            },
        ],
        "tools": [{"functionDeclarations": [WEATHER_DECLARATION]}],
    }
    for stream in (False, True):
        stopped = generate(
            f"{proxy.url}/s/g-stop",
            {**body, "generationConfig": {**GREEDY, "stopSequences": ["rainy"]}},
            stream,
        )
        assert parts_of(stopped) == [{"text": SCRIPT[5]["content"].split("rainy")[0]}]
        assert stopped["candidates"][0]["finishReason"] == "STOP"
        cut = generate(
            f"{proxy.url}/s/g-cut",
            {**body, "generationConfig": {"temperature": 0, "maxOutputTokens": 3}},
            stream,
        )
        assert cut["candidates"][0]["finishReason"] == "MAX_TOKENS"
        assert cut["usageMetadata"]["candidatesTokenCount"] == 3


def test_thought_parts_whole_and_streamed_and_the_signature_keeps_the_echo_in_one_segment(
    qwen3_model, qwen3_vllm, start_proxy
):
    """The reply's reasoning goes out as a thought part (`includeThoughts`), its signature on
    the last part; echoed as Gemini CLI echoes it (thought parts dropped, the signature kept),
    the model content renders the sampled `<think>` block again and the segment continues. An
    echo without the signature drops the reasoning, and that render opens a second segment."""
    proxy = start_proxy(qwen3_model, qwen3_vllm, "--reasoning-parser", "qwen3")
    hi = [{"role": "user", "parts": [{"text": "Hi"}]}]
    config = {
        **GREEDY,
        "maxOutputTokens": 40,
        "thinkingConfig": {"includeThoughts": True, "thinkingBudget": 1024},
    }
    for session, stream in (("g-think", False), ("g-think-streamed", True)):
        url = f"{proxy.url}/s/{session}"
        reply = generate(url, {"contents": hi, "generationConfig": config}, stream)
        thought, text = parts_of(reply)
        assert thought["thought"] is True and thought["text"].strip() == "The user greets me."
        assert text["text"].lstrip("\n") == "Hello!" and "thoughtSignature" in text
        usage = reply["usageMetadata"]
        assert 0 < usage["thoughtsTokenCount"] < usage["candidatesTokenCount"] + usage["thoughtsTokenCount"]
        echoed = [*hi, {"role": "model", "parts": as_gemini_cli_echoes(parts_of(reply))}]
        assert echoed[1]["parts"] == [text]
        generate(url, {"contents": echoed, "generationConfig": {**config, "maxOutputTokens": 2}}, stream)
        unsigned = [*hi, {"role": "model", "parts": [{"text": text["text"]}]}]
        generate(url, {"contents": unsigned, "generationConfig": {**config, "maxOutputTokens": 2}}, stream)
        segments = httpx.get(f"{proxy.url}/v1/sessions/{session}").json()["segments"]
        assert [len(s["turns"]) for s in segments] == [2, 1]
    hidden = generate(
        f"{proxy.url}/s/g-hidden",
        {"contents": hi, "generationConfig": {**config, "thinkingConfig": {"thinkingBudget": -1}}},
        False,
    )
    assert [set(p) for p in parts_of(hidden)] == [{"text", "thoughtSignature"}]  # the thought is not shown


# -- forced calls and JSON output on the untaught tiny Qwen3 ---------------------------------------

TIME_DECLARATION = {
    "name": "get_time",
    "description": "The time in a zone.",
    "parameters": {
        "type": "OBJECT",
        "properties": {"zone": {"type": "STRING", "enum": ["Europe/Paris", "Asia/Tokyo", "America/Lima"]}},
        "required": ["zone"],
    },
}
QUESTION = [{"role": "user", "parts": [{"text": "What time is it in Paris?"}]}]


@pytest.mark.parametrize("allowed", [None, ["get_time"]])
def test_a_forced_call_on_the_untaught_model_is_whole_and_streamed_alike_and_its_echo_continues(
    untaught_qwen3_model, untaught_qwen3_vllm, start_proxy, allowed
):
    proxy = start_proxy(
        untaught_qwen3_model,
        untaught_qwen3_vllm,
        "--tool-call-parser",
        "hermes",
        "--tool-strict-level",
        "parameter",
    )
    calling: dict[str, Any] = (
        {"mode": "ANY"} if allowed is None else {"mode": "ANY", "allowedFunctionNames": allowed}
    )
    body = {
        "contents": QUESTION,
        "tools": [{"functionDeclarations": [TIME_DECLARATION, {**WEATHER_DECLARATION}]}],
        "toolConfig": {"functionCallingConfig": calling},
        "generationConfig": {"temperature": 0, "maxOutputTokens": 300},
    }
    sessions = [f"g-forced-{bool(allowed)}-whole", f"g-forced-{bool(allowed)}-streamed"]
    replies = []
    for session, stream in zip(sessions, (False, True), strict=True):
        url = f"{proxy.url}/s/{session}"
        reply = generate(url, body, stream)
        calls = [p["functionCall"] for p in parts_of(reply)]
        assert calls and all(isinstance(c["args"], dict) for c in calls)
        if allowed:
            assert {c["name"] for c in calls} == {"get_time"}
            assert all(
                c["args"]["zone"] in TIME_DECLARATION["parameters"]["properties"]["zone"]["enum"]
                for c in calls
            )
        echoed = as_gemini_cli_echoes(parts_of(reply))
        answers = [
            {
                "functionResponse": {
                    "id": p["functionCall"]["id"],
                    "name": p["functionCall"]["name"],
                    "response": {"output": "12:00"},
                }
            }
            for p in echoed
        ]
        follow = {
            **body,
            "contents": [*QUESTION, {"role": "model", "parts": echoed}, {"role": "user", "parts": answers}],
            "toolConfig": {"functionCallingConfig": {"mode": "NONE"}},
            "generationConfig": {"temperature": 0, "maxOutputTokens": 4},
        }
        generate(url, follow, stream)
        replies.append(reply)
    strip = [[{**p["functionCall"], "id": ""} for p in parts_of(r)] for r in replies]
    assert strip[0] == strip[1]
    for session in sessions:
        httpx.post(f"{proxy.url}/v1/rewards", json={"session_id": session, "reward": 0.0}).raise_for_status()
    records = [t for t in trajectories(proxy.url) if t["session_id"] in sessions]
    assert [len(r["turns"]) for r in records] == [2, 2]  # one segment each: the echo continued it
    assert records[0]["token_ids"] == records[1]["token_ids"]
    assert [t["constrained"] for t in records[0]["turns"]] == [True, False]
    assert [t["completion_id"] for t in records[0]["turns"]][0] == replies[0]["responseId"]


ZONE_SCHEMA = {
    "type": "OBJECT",
    "properties": {"zone": {"type": "STRING", "enum": ["Europe/Paris", "Asia/Tokyo", "America/Lima"]}},
    "required": ["zone"],
}


@pytest.mark.parametrize("field", ["responseSchema", "responseJsonSchema"])
def test_json_output_on_the_untaught_model_samples_no_whitespace_whole_and_streamed(
    untaught_qwen3_model, untaught_qwen3_vllm, start_proxy, field
):
    proxy = start_proxy(untaught_qwen3_model, untaught_qwen3_vllm, "--tool-call-parser", "hermes")
    schema = (
        ZONE_SCHEMA
        if field == "responseSchema"
        else {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ZONE_SCHEMA["properties"]["zone"]["enum"]}},
            "required": ["zone"],
        }
    )
    config = {
        "temperature": 0,
        "maxOutputTokens": 300,
        "responseMimeType": "application/json",
        field: schema,
        "seed": 1,
    }
    texts = []
    for stream in (False, True):
        session = f"g-json-{field}-{stream}"
        url = f"{proxy.url}/s/{session}"
        reply = generate(url, {"contents": QUESTION, "generationConfig": config}, stream)
        [part] = parts_of(reply)
        text = part["text"]
        assert (
            reply["candidates"][0]["finishReason"] == "STOP"
            and reply["usageMetadata"]["candidatesTokenCount"] < 30
        )
        assert text == json.dumps({"zone": json.loads(text)["zone"]})  # one line, the template's separators
        history = [
            *QUESTION,
            {"role": "model", "parts": [part]},
            {"role": "user", "parts": [{"text": "Thanks"}]},
        ]
        generate(
            url, {"contents": history, "generationConfig": {"temperature": 0, "maxOutputTokens": 4}}, stream
        )
        segments = httpx.get(f"{proxy.url}/v1/sessions/{session}").json()["segments"]
        assert [len(s["turns"]) for s in segments] == [2]  # the echo continued the segment
        texts.append(text)
    assert texts[0] == texts[1]


def test_the_google_genai_sdk_echoes_its_own_history_and_the_episode_stays_one_segment(
    qwen3_model, qwen3_vllm, start_proxy
):
    """Google's SDK as the agent: the model's `Content` as the SDK parsed it, sent back as
    the SDK serialises it (the call id, `args` as an object), then the function responses."""
    proxy = start_proxy(qwen3_model, qwen3_vllm, "--tool-call-parser", "hermes")
    client = genai.Client(api_key="-", http_options=types.HttpOptions(base_url=f"{proxy.url}/s/g-sdk"))
    config = types.GenerateContentConfig(
        system_instruction=SCRIPT[0]["content"],
        tools=[types.Tool(function_declarations=[types.FunctionDeclaration(**WEATHER_DECLARATION)])],
        automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
        temperature=0,
        max_output_tokens=60,
    )
    history: list[Any] = [types.Content(role="user", parts=[types.Part(text=SCRIPT[1]["content"])])]
    first = client.models.generate_content(model="tiny", contents=history, config=config)
    calls = first.function_calls or []
    assert [(c.name, c.args) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "London"}),
    ]
    history.append(first.candidates[0].content)
    results = [SCRIPT[3]["content"], SCRIPT[4]["content"]]
    history.append(
        types.Content(
            role="user",
            parts=[
                types.Part.from_function_response(name=c.name, response={"output": r})
                for c, r in zip(calls, results, strict=True)
            ],
        )
    )
    second = client.models.generate_content(model="tiny", contents=history, config=config)
    assert second.text == SCRIPT[5]["content"]
    httpx.post(f"{proxy.url}/v1/rewards", json={"session_id": "g-sdk", "reward": 1.0}).raise_for_status()
    [record] = [t for t in trajectories(proxy.url) if t["session_id"] == "g-sdk"]
    assert [t["completion_id"] for t in record["turns"]] == [first.response_id, second.response_id]
