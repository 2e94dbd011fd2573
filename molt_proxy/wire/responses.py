"""OpenAI Responses on the wire, the request side: `POST /v1/responses` decoded into the
format-neutral `Conversation` the turn runs on (`wire/responses_items.py` turns `input` items
into messages; `wire/responses_reply.py` encodes the answer). Codex CLI speaks only this API,
and it is the OpenAI Agents SDK's default.

The request becomes the chat request it means, which vLLM's own code then reads for its
parsers and constraints: `instructions` is the system prompt; `function` tools are chat tools
(`strict` kept, so a strict tool constrains as on chat completions); a `custom` (freeform)
tool is vLLM's function shim taking one string, `input`; a `namespace` group's tools are
functions named `<namespace>__<name>` (vLLM's names for both, so a request renders as on
`vllm serve`'s Responses route); hosted tools (`web_search`, `file_search`, ...) are left out,
since nothing here can run them. `tool_choice` `required` or named, `parallel_tool_calls:
false` and `text.format` `json_object` / `json_schema` are constrained decoding, as the chat
fields they become. `reasoning.effort` `none` turns the template's thinking off, any other
effort on. `max_output_tokens`, `temperature` and `top_p` are sampling fields as on chat
completions. `metadata.session_id` is a session hint, and so is the `session_id` Codex puts in
`client_metadata` (one per `codex exec` run). Accepted and ignored: `prompt_cache_key`, the
rest of `client_metadata`, `text.verbosity`, `reasoning.summary`, `truncation`, `user`,
`safety_identifier`, `service_tier`, `stream_options`, `max_tool_calls`, `top_logprobs` and any
other field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tool_parsers.utils import custom_tool_parameters, flat_namespace_tool_name

from molt_proxy.conversation import (
    Conversation,
    chat_request,
    check_sampling,
    echoed_call_ids,
    requested_max_tokens,
    sampling_fields,
)
from molt_proxy.errors import BadRequest
from molt_proxy.ids import valid_session_id
from molt_proxy.wire.control import JSON_SCHEMA_FORMAT
from molt_proxy.wire.jsonbody import decode_json_object
from molt_proxy.wire.responses_items import input_messages

ENCRYPTED_REASONING = "reasoning.encrypted_content"
_UNSUPPORTED = {
    "background": "background responses are not supported",
    "conversation": "conversations are not supported; send 'input' or 'previous_response_id'",
    "prompt": "prompt templates are not supported; send 'instructions' and 'input'",
}

_ITEM: dict[str, Any] = {
    "type": "object",
    "properties": {"type": {"type": "string"}, "role": {"type": "string"}},
}
RESPONSES_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "OpenAI Responses (a subset of its fields; see docs/api-formats.md).",
    "properties": {
        "model": {"type": "string"},
        "input": {"anyOf": [{"type": "string"}, {"type": "array", "items": _ITEM}]},
        "instructions": {"type": "string"},
        "tools": {"type": "array", "items": {"type": "object", "properties": {"type": {"type": "string"}}}},
        "tool_choice": {"anyOf": [{"enum": ["auto", "none", "required"]}, {"type": "object"}]},
        "parallel_tool_calls": {"type": "boolean"},
        "max_output_tokens": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "store": {"type": "boolean"},
        "stream": {"type": "boolean"},
        "previous_response_id": {"type": "string"},
        "include": {"type": "array", "items": {"type": "string"}},
        "metadata": {"type": "object"},
        "text": {
            "type": "object",
            "properties": {
                "format": {
                    "anyOf": [
                        {"type": "object", "properties": {"type": {"enum": ["text", "json_object"]}}},
                        {
                            **JSON_SCHEMA_FORMAT,
                            "properties": {
                                "type": {"const": "json_schema"},
                                **JSON_SCHEMA_FORMAT["properties"],
                            },
                            "required": ["type", *JSON_SCHEMA_FORMAT["required"]],
                        },
                    ]
                }
            },
        },
    },
    "required": ["input"],
}


@dataclass(slots=True, frozen=True)
class Tools:
    """A request's tools as the template takes them, and which rendered names stand for
    `custom` tools and namespaced ones (their calls are shown as such)."""

    chat: list[dict[str, Any]]
    custom: frozenset[str]
    namespaced: dict[str, tuple[str, str]]
    """Rendered name → (namespace, name)."""


@dataclass(slots=True, frozen=True)
class ResponsesRequest:
    """A decoded `/v1/responses` body, before its history is known (a stored previous
    response's items come first)."""

    data: dict[str, Any]
    """The body, for the fields the reply echoes."""
    items: list[dict[str, Any]]
    """Its `input` as items (a string is one user message)."""
    stream: bool
    store: bool
    previous_response_id: str | None
    include_encrypted: bool
    tools: Tools
    session_id: str | None


def decode_responses_request(body: bytes) -> ResponsesRequest:
    data = decode_json_object(body)
    for name, why in _UNSUPPORTED.items():
        if data.get(name):
            raise BadRequest(why, param=name)
    raw = data.get("input")
    if isinstance(raw, str):
        items: list[Any] = [{"type": "message", "role": "user", "content": raw}]
    elif isinstance(raw, list) and raw:
        items = raw
    else:
        raise BadRequest("'input' must be a string or a non-empty array of items", param="input")
    include = _list_of_strings(data.get("include"), "include")
    previous = data.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise BadRequest("'previous_response_id' must be a non-empty string", param="previous_response_id")
    for flag in ("stream", "store", "parallel_tool_calls"):
        if data.get(flag) is not None and not isinstance(data[flag], bool):
            raise BadRequest(f"'{flag}' must be a boolean", param=flag)
    return ResponsesRequest(
        data=data,
        items=items,
        stream=bool(data.get("stream")),
        store=data.get("store") is not False,
        previous_response_id=previous,
        include_encrypted=ENCRYPTED_REASONING in include,
        tools=_tools(data.get("tools")),
        session_id=_metadata_session(data.get("metadata")) or _codex_session(data.get("client_metadata")),
    )


def conversation(request: ResponsesRequest, history: list[dict[str, Any]]) -> Conversation:
    """The turn's conversation: the stored `history` (items) then the request's own items."""
    data = request.data
    instructions = data.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("'instructions' must be a string", param="instructions")
    messages = input_messages([*history, *request.items], [instructions] if instructions else [])
    if not any(m["role"] != "system" for m in messages):
        raise BadRequest("'input' must hold a user or assistant message", param="input")
    tools = request.tools.chat or None
    limit = data.get("max_output_tokens")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise BadRequest("'max_output_tokens' must be an integer of at least 1", param="max_output_tokens")
    template_kwargs = _template_kwargs(data.get("reasoning"))
    parser_request = _parser_request(data, messages, tools, template_kwargs)
    check_sampling(parser_request)
    return Conversation(
        messages=messages,
        tools=tools,
        template_kwargs=template_kwargs,
        sampling=sampling_fields(parser_request),
        max_tokens=requested_max_tokens(parser_request),
        parser_request=parser_request,
        session_id=request.session_id,
        call_ids=echoed_call_ids(messages),
    )


def _list_of_strings(value: Any, param: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BadRequest(f"'{param}' must be an array of strings", param=param)
    return value


def _metadata_session(metadata: Any) -> str | None:
    if metadata is not None and not isinstance(metadata, dict):
        raise BadRequest("'metadata' must be an object", param="metadata")
    value = (metadata or {}).get("session_id")
    if value is not None and (not isinstance(value, str) or not value):
        raise BadRequest("'metadata.session_id' must be a non-empty string", param="metadata.session_id")
    return value


def _codex_session(client_metadata: Any) -> str | None:
    """The `session_id` Codex sends in `client_metadata`, where it is a valid session id
    (`ids.py`; Codex's are UUIDs): a hint, like Claude Code's in `metadata.user_id`, so
    anything else there is ignored."""
    value = client_metadata.get("session_id") if isinstance(client_metadata, dict) else None
    return value if isinstance(value, str) and valid_session_id(value) else None


def _function(tool: dict[str, Any], name: str, param: str) -> dict[str, Any]:
    """A Responses `function` (or `custom`) tool as chat completions sends it, key order kept
    as the OpenAI SDKs write it (templates print tools as JSON)."""
    function: dict[str, Any] = {"name": name}
    description = tool.get("description")
    if description is not None:
        if not isinstance(description, str):
            raise BadRequest(f"{param}.description must be a string", param=f"{param}.description")
        function["description"] = description
    if tool.get("type") == "custom":
        function["parameters"] = custom_tool_parameters()
        return {"type": "function", "function": function}
    parameters = tool.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise BadRequest(f"{param}.parameters must be an object", param=f"{param}.parameters")
        function["parameters"] = parameters
    if tool.get("strict") is not None:
        function["strict"] = tool["strict"]
    return {"type": "function", "function": function}


def _tools(raw: Any) -> Tools:
    if raw is None:
        return Tools([], frozenset(), {})
    if not isinstance(raw, list):
        raise BadRequest("'tools' must be an array", param="tools")
    chat: list[dict[str, Any]] = []
    custom: set[str] = set()
    namespaced: dict[str, tuple[str, str]] = {}
    for i, tool in enumerate(raw):
        param = f"tools.{i}"
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            raise BadRequest(f"{param} must be an object with a 'type'", param=param)
        inner: list[tuple[dict[str, Any], str | None]] = [(tool, None)]
        if tool["type"] == "namespace":
            members = tool.get("tools")
            if not isinstance(members, list) or not all(isinstance(m, dict) for m in members):
                raise BadRequest(f"{param}.tools must be an array of tools", param=f"{param}.tools")
            inner = [(member, _name(tool, param)) for member in members]
        for member, namespace in inner:
            if member.get("type") not in ("function", "custom"):
                continue  # a hosted tool (web_search, ...): nothing here can run it
            name = _name(member, param)
            if namespace is not None:
                namespaced[flat_namespace_tool_name(namespace, name)] = (namespace, name)
                name = flat_namespace_tool_name(namespace, name)
            if member["type"] == "custom":
                custom.add(name)
            chat.append(_function(member, name, param))
    return Tools(chat, frozenset(custom), namespaced)


def _name(tool: dict[str, Any], param: str) -> str:
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise BadRequest(f"{param}.name must be a non-empty string", param=f"{param}.name")
    return name


def _template_kwargs(reasoning: Any) -> dict[str, Any]:
    if reasoning is None:
        return {}
    if not isinstance(reasoning, dict):
        raise BadRequest("'reasoning' must be an object", param="reasoning")
    effort = reasoning.get("effort")
    if effort is None:
        return {}
    if not isinstance(effort, str):
        raise BadRequest("'reasoning.effort' must be a string", param="reasoning.effort")
    return {"enable_thinking": effort != "none"}


def _tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> Any:
    """Responses' `tool_choice` as chat completions': `{"type": "function", "name": N}` (or
    `custom`) names the function."""
    if not tools:
        return None
    if choice is None or choice in ("auto", "none", "required"):
        return choice or "auto"
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom"):
        name = choice.get("name")
        if not isinstance(name, str):
            raise BadRequest("'tool_choice.name' must be a string", param="tool_choice.name")
        return {"type": "function", "function": {"name": name}}
    raise BadRequest(
        "'tool_choice' must be auto, none, required or a function or custom tool by name", param="tool_choice"
    )


def _response_format(text: Any) -> dict[str, Any] | None:
    """`text.format` as chat completions' `response_format`."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("json_object", "json_schema"):
        raise BadRequest("'text.format.type' must be text, json_object or json_schema", param="text.format")
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    if not isinstance(fmt.get("schema"), dict):
        raise BadRequest("'text.format.schema' must be a JSON schema object", param="text.format.schema")
    schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
    return {"type": "json_schema", "json_schema": schema}


def _parser_request(
    data: dict[str, Any],
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    kwargs: dict[str, Any],
) -> ChatCompletionRequest:
    """vLLM's chat request for its parsers, constraints and sampling fields."""
    fields: dict[str, Any] = {
        "model": data.get("model"),
        "messages": [dict(m) for m in messages],  # vLLM's validator rewrites the dicts it reads
        "chat_template_kwargs": kwargs,
        "tools": tools,
        "tool_choice": _tool_choice(data.get("tool_choice"), tools),
        "max_tokens": data.get("max_output_tokens"),
        "temperature": data.get("temperature"),
        "top_p": data.get("top_p"),
        "seed": data.get("seed"),  # not OpenAI's; vLLM's chat field, for reproducible samples
        "response_format": _response_format(data.get("text")),
    }
    if data.get("parallel_tool_calls") is not None:
        fields["parallel_tool_calls"] = data["parallel_tool_calls"]
    renamed = {"max_tokens": "max_output_tokens", "response_format": "text.format"}
    return chat_request({k: v for k, v in fields.items() if v is not None}, renamed)
