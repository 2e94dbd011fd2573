"""The Gemini API on the wire, the request side: `generateContent`, `streamGenerateContent`
and `countTokens` bodies decoded into the format-neutral `Conversation` the turn runs on
(`wire/gemini_reply.py` encodes the answer). Gemini CLI speaks only this API.

A request becomes the chat request it means, which vLLM's own code then reads for its parsers
and constraints, with these choices:

- `contents`: a `user` content's text parts are one user message (joined by a newline), its
  `functionResponse` parts tool messages, in order; a `model` content is one assistant
  message: its text parts joined as sampled pieces (no separator), its thought parts
  (`thought: true`) the reasoning, its `functionCall` parts the calls, `args` as the object
  it is (templates print it with `tojson`). `systemInstruction` is the system prompt.
- A `functionResponse`'s `response` renders as its `output` where that is the only field and
  a string (Google's convention, and what Gemini CLI sends), else as the object's JSON.
- Ids: a call id the proxy's parser minted (`chatcmpl-tool-X`) is shown as it is; an echoed
  one is read back as it is, or with the `<name>__` prefix Gemini CLI adds to every call id
  taken off. A `functionResponse` without an `id` answers the first unanswered call of its
  name in the model content before it.
- Thought signatures: the proxy mints each as the exact reasoning text of its reply
  (`thought_signature`; not secret: an agent's history is its own, and the stitching checks
  what it renders byte for byte). A model content with one on any part (Gemini puts it on the
  first `functionCall` part, Gemini CLI keeps it there and drops thought parts) has that
  reasoning back, whatever thought text it carries, so the echo renders the sampled tokens.
  Any other signature (Gemini CLI's `skip_thought_signature_validator`) is ignored.
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

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

from molt_proxy.conversation import (
    Conversation,
    chat_request,
    check_sampling,
    echoed_call_ids,
    sampling_fields,
    with_string_arguments,
)
from molt_proxy.errors import BadRequest
from molt_proxy.wire.jsonbody import decode_json_object

_CALL_PREFIX = "chatcmpl-tool-"
_SIGNED = b"molt-thought:"
_MEDIA = ("inlineData", "fileData")
_CODE = ("executableCode", "codeExecutionResult")
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
GENERATE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "Gemini API generateContent / countTokens (a subset; see docs/api-formats.md).",
    "properties": {
        "contents": {"type": "array", "items": _CONTENT, "minItems": 1},
        "systemInstruction": _CONTENT,
        "tools": {"type": "array", "items": {"type": "object"}},
        "toolConfig": {"type": "object"},
        "generationConfig": {"type": "object"},
        "generateContentRequest": {"type": "object"},
    },
}


def thought_signature(reasoning: str) -> str:
    """The `thoughtSignature` of a reply's reasoning: the exact text, which the proxy reads
    back (`signed_reasoning`), in base64's URL-safe alphabet, as Google's SDKs write bytes."""
    return base64.urlsafe_b64encode(_SIGNED + reasoning.encode()).decode()


def signed_reasoning(signature: Any) -> str | None:
    """The reasoning a signature the proxy minted stands for (either base64 alphabet: the
    SDKs decode and re-encode it); None for any other."""
    if not isinstance(signature, str):
        return None
    try:
        raw = base64.b64decode(signature.replace("-", "+").replace("_", "/"), validate=True)
        return raw.removeprefix(_SIGNED).decode() if raw.startswith(_SIGNED) else None
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None


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
    config = _object(data.get("generationConfig"), "generationConfig")
    system = _system(data.get("systemInstruction"))
    messages = [{"role": "system", "content": system}] if system else []
    messages += _Contents().messages(data.get("contents"))
    tools = _tools(data.get("tools"))
    thinking = _object(config.get("thinkingConfig"), "generationConfig.thinkingConfig")
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
        max_tokens=fields.get("max_tokens"),
        fit_max_tokens=True,
        parser_request=parser_request,
        session_id=None,
        call_ids=echoed_call_ids(messages),
    )
    return GeminiCall(conversation, include)


# -- contents ----------------------------------------------------------------------------------


def _object(value: Any, param: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadRequest(f"'{param}' must be an object", param=param)
    return value


def _string(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise BadRequest(f"'{param}' must be a string", param=param)
    return value


def _parts(content: Any, param: str) -> list[dict[str, Any]]:
    """A content's parts, each an object; media and code parts refused."""
    if not isinstance(content, dict):
        raise BadRequest(f"'{param}' must be an object with 'parts'", param=param)
    parts = content.get("parts")
    if not isinstance(parts, list):
        raise BadRequest(f"'{param}.parts' must be an array", param=f"{param}.parts")
    for j, part in enumerate(parts):
        where = f"{param}.parts.{j}"
        if not isinstance(part, dict):
            raise BadRequest(f"'{where}' must be an object", param=where)
        for kind in (*_MEDIA, *_CODE):
            if part.get(kind) is not None:
                why = "the served model reads text only" if kind in _MEDIA else "nothing here runs code"
                raise BadRequest(f"{where}: {kind} parts are not supported: {why}", param=f"{where}.{kind}")
    return parts


def _system(instruction: Any) -> str:
    """`systemInstruction`: a content (its text parts joined by a newline) or a string."""
    if instruction is None or isinstance(instruction, str):
        return instruction or ""
    parts = _parts(instruction, "systemInstruction")
    texts = []
    for j, part in enumerate(parts):
        if "text" not in part:
            raise BadRequest(
                f"systemInstruction.parts.{j}: only text parts are supported",
                param=f"systemInstruction.parts.{j}",
            )
        texts.append(_string(part["text"], f"systemInstruction.parts.{j}.text"))
    return "\n".join(texts)


def call_id(echoed: str, name: str) -> str:
    """The call id an echoed `functionCall.id` stands for: as shown, or with the `<name>__`
    prefix Gemini CLI puts on every call id taken off one the proxy minted."""
    bare = echoed.removeprefix(f"{name}__")
    return bare if bare.startswith(_CALL_PREFIX) else echoed


class _Contents:
    """`contents` → the template's messages, with the calls each tool result answers."""

    def __init__(self) -> None:
        self.out: list[dict[str, Any]] = []
        self.unanswered: list[tuple[str, str]] = []
        """(name, id) of the last model content's calls that no response has answered."""

    def messages(self, contents: Any) -> list[dict[str, Any]]:
        if not isinstance(contents, list) or not contents:
            raise BadRequest("'contents' must be a non-empty array of contents", param="contents")
        for i, content in enumerate(contents):
            param = f"contents.{i}"
            parts = _parts(content, param)
            role = content.get("role") or "user"
            if role == "model":
                self.out.append(self._model(parts, param))
            elif role in ("user", "function"):  # "function": the API's older role for responses
                self._user(parts, param)
            else:
                raise BadRequest(f"'{param}.role' must be user or model, got {role!r}", param=f"{param}.role")
        if not any(m["role"] != "system" for m in self.out):
            raise BadRequest("'contents' must hold a part", param="contents")
        return self.out

    def _user(self, parts: list[dict[str, Any]], param: str) -> None:
        texts: list[str] = []
        for j, part in enumerate(parts):
            where = f"{param}.parts.{j}"
            if "functionResponse" in part:
                if texts:
                    self.out.append({"role": "user", "content": "\n".join(texts)})
                    texts = []
                self.out.append(self._response(part["functionResponse"], f"{where}.functionResponse"))
            elif "text" in part:
                if not part.get("thought"):  # a thought of the user's is no message
                    texts.append(_string(part["text"], f"{where}.text"))
            elif "functionCall" in part:
                raise BadRequest(f"{where}: a user content cannot hold a functionCall", param=where)
        if texts or not parts:
            self.out.append({"role": "user", "content": "\n".join(texts)})

    def _model(self, parts: list[dict[str, Any]], param: str) -> dict[str, Any]:
        texts: list[str] = []
        thoughts: list[str] = []
        signed: str | None = None
        calls: list[dict[str, Any]] = []
        for j, part in enumerate(parts):
            where = f"{param}.parts.{j}"
            if signed is None:
                signed = signed_reasoning(part.get("thoughtSignature"))
            if "functionCall" in part:
                calls.append(self._call(part["functionCall"], f"{where}.functionCall", len(calls)))
            elif "text" in part:
                text = _string(part["text"], f"{where}.text")
                (thoughts if part.get("thought") else texts).append(text)
            elif "functionResponse" in part:
                raise BadRequest(f"{where}: a model content cannot hold a functionResponse", param=where)
        message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        reasoning = signed if signed is not None else "".join(thoughts)
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        self.unanswered = [(c["function"]["name"], c["id"]) for c in calls]
        return message

    def _call(self, call: Any, param: str, index: int) -> dict[str, Any]:
        call = _object(call, param)
        name = _string(call.get("name"), f"{param}.name")
        args = call.get("args", {})
        if not isinstance(args, dict):
            raise BadRequest(f"'{param}.args' must be an object", param=f"{param}.args")
        shown = call.get("id")
        identity = call_id(_string(shown, f"{param}.id"), name) if shown is not None else f"{name}-{index}"
        return {"id": identity, "type": "function", "function": {"name": name, "arguments": args}}

    def _response(self, response: Any, param: str) -> dict[str, Any]:
        response = _object(response, param)
        name = _string(response.get("name"), f"{param}.name")
        value = response.get("response", {})
        if not isinstance(value, dict):
            raise BadRequest(f"'{param}.response' must be an object", param=f"{param}.response")
        if response.get("parts"):
            raise BadRequest(f"{param}.parts: multimodal function responses are not supported", param=param)
        shown = response.get("id")
        answered = next((pair for pair in self.unanswered if pair[0] == name), None)
        if shown is not None:
            identity = call_id(_string(shown, f"{param}.id"), name)
            answered = next((pair for pair in self.unanswered if pair[1] == identity), answered)
        else:
            identity = answered[1] if answered is not None else name
        if answered is not None:
            self.unanswered.remove(answered)
        output = value.get("output")
        text = output if set(value) == {"output"} and isinstance(output, str) else json.dumps(value)
        return {"role": "tool", "tool_call_id": identity, "content": text}


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
        declarations = _object(tool, param).get("functionDeclarations")
        if declarations is None:
            continue  # googleSearch, codeExecution, ...: nothing here can run them
        if not isinstance(declarations, list):
            raise BadRequest(
                f"'{param}.functionDeclarations' must be an array", param=f"{param}.functionDeclarations"
            )
        for k, declaration in enumerate(declarations):
            chat.append(
                _function(
                    _object(declaration, f"{param}.functionDeclarations.{k}"),
                    f"{param}.functionDeclarations.{k}",
                )
            )
    return chat or None


def _function(declaration: dict[str, Any], param: str) -> dict[str, Any]:
    """A function declaration as chat completions sends a tool (key order as the OpenAI SDKs
    write it: templates print tools as JSON)."""
    function: dict[str, Any] = {"name": _string(declaration.get("name"), f"{param}.name")}
    if not function["name"]:
        raise BadRequest(f"'{param}.name' must not be empty", param=f"{param}.name")
    if declaration.get("description") is not None:
        function["description"] = _string(declaration["description"], f"{param}.description")
    openapi, plain = declaration.get("parameters"), declaration.get("parametersJsonSchema")
    if openapi is not None and plain is not None:
        raise BadRequest(f"{param}: give 'parameters' or 'parametersJsonSchema', not both", param=param)
    if openapi is not None:
        function["parameters"] = json_schema(_object(openapi, f"{param}.parameters"))
    elif plain is not None:
        function["parameters"] = _object(plain, f"{param}.parametersJsonSchema")
    return {"type": "function", "function": function}


def _calling_mode(config: Any) -> tuple[str, list[str] | None]:
    """`toolConfig.functionCallingConfig`: its mode and `allowedFunctionNames`, checked."""
    param = "toolConfig.functionCallingConfig"
    calling = _object(_object(config, "toolConfig").get("functionCallingConfig"), param)
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
