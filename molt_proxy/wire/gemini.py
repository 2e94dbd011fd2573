"""The Gemini API on the wire, the request side: `generateContent`, `streamGenerateContent`
and `countTokens` bodies decoded into the format-neutral `Conversation` the turn runs on
(`wire/gemini_contents.py` turns `contents` into messages and owns the thought signatures;
`wire/gemini_reply.py` encodes the answer). Gemini CLI speaks only this API.

A request becomes the chat request it means, which vLLM's own code then reads for its parsers
and constraints, with these choices:

- `systemInstruction` is the system prompt.
- `tools[].functionDeclarations` are chat tools: `parametersJsonSchema` as it is, `parameters`
  (Google's OpenAPI subset, `"type": "OBJECT"`) as the JSON schema it means
  (`json_schema`). Other tools (`googleSearch`, `codeExecution`, ...) are left out: nothing
  here can run them. `toolConfig.functionCallingConfig.mode` `ANY` is a forced call
  (constrained decoding, as chat's `tool_choice: required`, or named where
  `allowedFunctionNames` names one; several constrain the call to those), `NONE` renders the
  tools and parses no call, `AUTO` (the default) is `auto`.
- `generationConfig`: `temperature`, `topP`, `topK`, `maxOutputTokens` (a bound, lowered to
  the context the prompt leaves, as on the Anthropic route), `stopSequences`, `seed`,
  `presencePenalty`, `frequencyPenalty` are the sampling fields; `candidateCount` must be 1;
  `responseMimeType: application/json` is JSON output, with `responseSchema` (OpenAPI) or
  `responseJsonSchema` its schema; `thinkingConfig.thinkingBudget` 0 turns the template's
  thinking off, any other budget (or `includeThoughts: true`) on (the budget is not
  enforced), and `includeThoughts` says whether the reply shows thought parts.
- Refused (400): `inlineData` and `fileData` parts (the proxy serves text-only models),
  executable code parts, `cachedContent`, `candidateCount` other than 1, `responseLogprobs`,
  a `responseModalities` other than text, a `responseMimeType` other than text or JSON,
  `VALIDATED` function calling. Accepted and ignored: `safetySettings`, `labels`, the
  thinking budget and level, and other fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

from molt_proxy.conversation import (
    Conversation,
    chat_request,
    check_sampling,
    echoed_call_ids,
    requested_max_tokens,
    sampling_fields,
    with_string_arguments,
)
from molt_proxy.errors import BadRequest
from molt_proxy.wire.gemini_contents import contents_messages, object_field, string_field, system_text
from molt_proxy.wire.jsonbody import decode_json_object

_SAMPLING_NAMES = {
    "temperature": "generationConfig.temperature",
    "top_p": "generationConfig.topP",
    "top_k": "generationConfig.topK",
    "max_tokens": "generationConfig.maxOutputTokens",
    "stop": "generationConfig.stopSequences",
    "seed": "generationConfig.seed",
    "presence_penalty": "generationConfig.presencePenalty",
    "frequency_penalty": "generationConfig.frequencyPenalty",
    "response_format": "generationConfig.responseSchema",
    "tool_choice": "toolConfig.functionCallingConfig",
}
"""Chat fields → the Gemini fields they come from, for the `param` of a refusal."""

_PART: dict[str, Any] = {
    "type": "object",
    "properties": {
        "text": {"type": "string"},
        "thought": {"type": "boolean"},
        "thoughtSignature": {"type": "string"},
        "functionCall": {"type": "object"},
        "functionResponse": {"type": "object"},
    },
}
_CONTENT: dict[str, Any] = {
    "type": "object",
    "properties": {"role": {"enum": ["user", "model"]}, "parts": {"type": "array", "items": _PART}},
    "required": ["parts"],
}
_DECLARATION: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "description": {"type": "string"},
        "parameters": {"type": "object"},
    },
    "required": ["name"],
}
GENERATE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "Gemini API generateContent / countTokens (a subset; see docs/api-formats.md).",
    "properties": {
        "contents": {"type": "array", "items": _CONTENT, "minItems": 1},
        "systemInstruction": _CONTENT,
        "tools": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"functionDeclarations": {"type": "array", "items": _DECLARATION}},
            },
        },
        "toolConfig": {
            "type": "object",
            "properties": {
                "functionCallingConfig": {
                    "type": "object",
                    "properties": {
                        "mode": {"enum": ["AUTO", "ANY", "NONE"]},
                        "allowedFunctionNames": {"type": "array", "items": {"type": "string"}},
                    },
                }
            },
        },
        "generationConfig": {
            "type": "object",
            "properties": {
                "temperature": {"type": "number", "minimum": 0, "maximum": 2},
                "topP": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                "topK": {"type": "integer", "minimum": 0},
                "maxOutputTokens": {"type": "integer", "minimum": 1},
                "stopSequences": {"type": "array", "items": {"type": "string", "minLength": 1}},
                "candidateCount": {"const": 1},
                "seed": {"type": "integer"},
                "responseMimeType": {"enum": ["text/plain", "application/json"]},
                "responseSchema": {"type": "object"},
                "thinkingConfig": {
                    "type": "object",
                    "properties": {
                        "includeThoughts": {"type": "boolean"},
                        "thinkingBudget": {"type": "integer"},
                    },
                },
            },
        },
        "generateContentRequest": {"type": "object"},
    },
}


@dataclass(slots=True, frozen=True)
class GeminiCall:
    """A decoded `generateContent` request: the conversation, and what the reply shows."""

    conversation: Conversation
    include_thoughts: bool
    """`thinkingConfig.includeThoughts`: the reply shows its reasoning as thought parts."""


def decode_generate_request(body: bytes, model: str) -> GeminiCall:
    """Bytes → the conversation of a `generateContent` request for `model` (the URL's)."""
    data = decode_json_object(body)
    return _decode(data, model, count=False)


def decode_count_request(body: bytes, model: str) -> Conversation:
    """Bytes → the conversation of a `countTokens` request: its `contents`, or the whole
    `generateContentRequest` it wraps."""
    data = decode_json_object(body)
    wrapped = data.get("generateContentRequest")
    if wrapped is not None:
        if not isinstance(wrapped, dict):
            raise BadRequest("'generateContentRequest' must be an object", param="generateContentRequest")
        if "contents" in data:
            raise BadRequest(
                "give 'contents' or 'generateContentRequest', not both", param="generateContentRequest"
            )
        data = wrapped
    return _decode(data, model, count=True).conversation


def _decode(data: dict[str, Any], model: str, *, count: bool) -> GeminiCall:
    if data.get("cachedContent") is not None:
        raise BadRequest("cached content is not supported: send the whole 'contents'", param="cachedContent")
    config = object_field(data.get("generationConfig"), "generationConfig")
    system = system_text(data.get("systemInstruction"))
    messages = [{"role": "system", "content": system}] if system else []
    messages += contents_messages(data.get("contents"))
    tools = _tools(data.get("tools"))
    thinking = object_field(config.get("thinkingConfig"), "generationConfig.thinkingConfig")
    template_kwargs = _template_kwargs(thinking)
    include = thinking.get("includeThoughts", False)
    if not isinstance(include, bool):
        raise BadRequest(
            "'generationConfig.thinkingConfig.includeThoughts' must be a boolean",
            param="generationConfig.thinkingConfig.includeThoughts",
        )
    choice, parser_tools = _tool_choice(data.get("toolConfig"), tools)
    fields: dict[str, Any] = {
        "model": model,
        "messages": [with_string_arguments(m) for m in messages],
        "chat_template_kwargs": template_kwargs,
        "tools": parser_tools,
        "tool_choice": choice,
    }
    if not count:
        fields |= _generation_fields(config)
    parser_request = _parser_request({k: v for k, v in fields.items() if v is not None})
    conversation = Conversation(
        messages=messages,
        tools=tools,
        template_kwargs=template_kwargs,
        sampling=sampling_fields(parser_request),
        max_tokens=requested_max_tokens(parser_request),
        fit_max_tokens=True,
        parser_request=parser_request,
        session_id=None,
        call_ids=echoed_call_ids(messages),
    )
    return GeminiCall(conversation, include)


# -- tools and schemas -------------------------------------------------------------------------

_INT_FIELDS = frozenset({"minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties"})


def json_schema(schema: Any) -> Any:
    """Google's OpenAPI schema subset as the JSON schema it means: types in lower case
    (`OBJECT` → `object`), `nullable: true` as a `null` type, int64 fields sent as strings
    (`"maxItems": "3"`) as numbers, Google's `propertyOrdering` dropped (the properties keep
    their order). A JSON schema passes through unchanged."""
    if isinstance(schema, list):
        return [json_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "propertyOrdering" or key == "nullable":
            continue
        if key == "type" and isinstance(value, str):
            out[key] = value.lower()
        elif key == "properties" and isinstance(value, dict):
            out[key] = {name: json_schema(sub) for name, sub in value.items()}
        elif key in ("items", "anyOf", "oneOf", "allOf", "not", "additionalProperties"):
            out[key] = json_schema(value)
        elif key in _INT_FIELDS and isinstance(value, str) and value.isdigit():
            out[key] = int(value)
        else:
            out[key] = value
    if schema.get("nullable") is True and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    return out


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise BadRequest("'tools' must be an array", param="tools")
    chat: list[dict[str, Any]] = []
    for i, tool in enumerate(raw):
        param = f"tools.{i}"
        declarations = object_field(tool, param).get("functionDeclarations")
        if declarations is None:
            continue  # googleSearch, codeExecution, ...: nothing here can run them
        if not isinstance(declarations, list):
            raise BadRequest(
                f"'{param}.functionDeclarations' must be an array", param=f"{param}.functionDeclarations"
            )
        for k, declaration in enumerate(declarations):
            chat.append(
                _function(
                    object_field(declaration, f"{param}.functionDeclarations.{k}"),
                    f"{param}.functionDeclarations.{k}",
                )
            )
    return chat or None


def _function(declaration: dict[str, Any], param: str) -> dict[str, Any]:
    """A function declaration as chat completions sends a tool (key order as the OpenAI SDKs
    write it: templates print tools as JSON)."""
    function: dict[str, Any] = {"name": string_field(declaration.get("name"), f"{param}.name")}
    if not function["name"]:
        raise BadRequest(f"'{param}.name' must not be empty", param=f"{param}.name")
    if declaration.get("description") is not None:
        function["description"] = string_field(declaration["description"], f"{param}.description")
    openapi, plain = declaration.get("parameters"), declaration.get("parametersJsonSchema")
    if openapi is not None and plain is not None:
        raise BadRequest(f"{param}: give 'parameters' or 'parametersJsonSchema', not both", param=param)
    if openapi is not None:
        function["parameters"] = json_schema(object_field(openapi, f"{param}.parameters"))
    elif plain is not None:
        function["parameters"] = object_field(plain, f"{param}.parametersJsonSchema")
    return {"type": "function", "function": function}


def _calling_mode(config: Any) -> tuple[str, list[str] | None]:
    """`toolConfig.functionCallingConfig`: its mode and `allowedFunctionNames`, checked."""
    param = "toolConfig.functionCallingConfig"
    calling = object_field(object_field(config, "toolConfig").get("functionCallingConfig"), param)
    mode = calling.get("mode") or "AUTO"
    allowed = calling.get("allowedFunctionNames")
    if mode not in ("MODE_UNSPECIFIED", "AUTO", "ANY", "NONE", "VALIDATED"):
        raise BadRequest(f"'{param}.mode' must be AUTO, ANY or NONE, got {mode!r}", param=f"{param}.mode")
    if mode == "VALIDATED":
        raise BadRequest(
            "VALIDATED function calling is not supported: use AUTO or ANY", param=f"{param}.mode"
        )
    if allowed is not None:
        names = f"{param}.allowedFunctionNames"
        if not isinstance(allowed, list) or not all(isinstance(n, str) for n in allowed):
            raise BadRequest(f"'{names}' must be an array of strings", param=names)
        if mode != "ANY":
            raise BadRequest(f"'{names}' is only for mode ANY", param=names)
    return mode, allowed


def _tool_choice(config: Any, tools: list[dict[str, Any]] | None) -> tuple[Any, list[dict[str, Any]] | None]:
    """`toolConfig.functionCallingConfig` as chat's `tool_choice`, and the tools the parsers
    (and a forced call's constraint) read: with `ANY` and several `allowedFunctionNames`, only
    those (the template still renders every tool)."""
    mode, allowed = _calling_mode(config)
    param = "toolConfig.functionCallingConfig"
    if not tools:
        if mode == "ANY":
            raise BadRequest("mode ANY needs function declarations in 'tools'", param=f"{param}.mode")
        return None, None
    if mode != "ANY":
        return ("none" if mode == "NONE" else "auto"), tools
    names = [t["function"]["name"] for t in tools]
    unknown = [n for n in allowed or [] if n not in names]
    if unknown:
        raise BadRequest(
            f"'{param}.allowedFunctionNames' names no declared function: {unknown[0]!r}",
            param=f"{param}.allowedFunctionNames",
        )
    if not allowed or set(allowed) == set(names):
        return "required", tools
    if len(set(allowed)) == 1:
        return {"type": "function", "function": {"name": allowed[0]}}, tools
    return "required", [t for t in tools if t["function"]["name"] in allowed]


# -- generation config -------------------------------------------------------------------------


def _template_kwargs(thinking: dict[str, Any]) -> dict[str, Any]:
    """`thinkingConfig` as the template's `enable_thinking`: a budget of 0 turns it off, any
    other budget or `includeThoughts: true` on; none of them leaves the template's default."""
    budget = thinking.get("thinkingBudget")
    if budget is not None:
        if not isinstance(budget, int) or isinstance(budget, bool):
            param = "generationConfig.thinkingConfig.thinkingBudget"
            raise BadRequest(f"'{param}' must be an integer", param=param)
        return {"enable_thinking": budget != 0}
    if thinking.get("includeThoughts") is True:
        return {"enable_thinking": True}
    return {}


def _generation_fields(config: dict[str, Any]) -> dict[str, Any]:
    """`generationConfig` as chat completions' sampling and output fields."""
    count = config.get("candidateCount")
    if count is not None and count != 1:
        raise BadRequest(
            "'generationConfig.candidateCount' must be 1: n candidates would be n diverging episodes "
            "behind one request; send n requests",
            param="generationConfig.candidateCount",
        )
    if config.get("responseLogprobs"):
        raise BadRequest(
            "'generationConfig.responseLogprobs' is not supported", param="generationConfig.responseLogprobs"
        )
    modalities = config.get("responseModalities")
    if modalities is not None and (
        not isinstance(modalities, list) or any(m not in ("TEXT", "text") for m in modalities)
    ):
        raise BadRequest(
            "'generationConfig.responseModalities' must be TEXT: the served model writes text only",
            param="generationConfig.responseModalities",
        )
    top_k = config.get("topK")
    if isinstance(top_k, float) and top_k.is_integer():
        top_k = int(top_k)
    return {
        "max_tokens": config.get("maxOutputTokens"),
        "temperature": config.get("temperature"),
        "top_p": config.get("topP"),
        "top_k": top_k,
        "stop": config.get("stopSequences"),
        "seed": config.get("seed"),
        "presence_penalty": config.get("presencePenalty"),
        "frequency_penalty": config.get("frequencyPenalty"),
        "response_format": _response_format(config),
    }


def _response_format(config: dict[str, Any]) -> dict[str, Any] | None:
    """`responseMimeType` and its schema as chat's `response_format`."""
    mime = config.get("responseMimeType")
    openapi = config.get("responseSchema")
    plain = config.get("responseJsonSchema", config.get("_responseJsonSchema"))
    if openapi is not None and plain is not None:
        raise BadRequest(
            "give 'responseSchema' or 'responseJsonSchema', not both", param="generationConfig.responseSchema"
        )
    if mime in (None, "text/plain"):
        if openapi is not None or plain is not None:
            raise BadRequest(
                "a response schema needs 'responseMimeType': 'application/json'",
                param="generationConfig.responseMimeType",
            )
        return None
    if mime != "application/json":
        raise BadRequest(
            f"'generationConfig.responseMimeType' must be text/plain or application/json, got {mime!r}",
            param="generationConfig.responseMimeType",
        )
    if openapi is None and plain is None:
        return {"type": "json_object"}
    schema = json_schema(openapi) if openapi is not None else plain
    if not isinstance(schema, dict):
        raise BadRequest("the response schema must be an object", param="generationConfig.responseSchema")
    return {"type": "json_schema", "json_schema": {"name": "response", "schema": schema}}


def _parser_request(fields: dict[str, Any]) -> ChatCompletionRequest:
    """vLLM's chat request for its parsers, constraints and sampling fields, checked; a
    refusal names the Gemini field."""
    try:
        request = chat_request(fields, _SAMPLING_NAMES)
        check_sampling(request)
    except BadRequest as exc:
        param = _SAMPLING_NAMES.get(exc.param or "", exc.param)
        raise BadRequest(exc.message.replace(f"'{exc.param}'", f"'{param}'"), param=param) from None
    return request
