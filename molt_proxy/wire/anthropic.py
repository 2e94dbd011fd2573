"""Anthropic Messages on the wire, the request side: `/v1/messages` and its `count_tokens`
decoded into the format-neutral `Conversation` the turn runs on (`wire/anthropic_reply.py`
encodes the answer). Claude Code speaks only this API.

Requests are validated with vLLM's own `AnthropicMessagesRequest` (so every field means here
what it means on `vllm serve`), and the conversation is built as vLLM's Anthropic route builds
its chat request (`AnthropicServingMessages.to_chat_completion_request`), with these choices:

- `system` text blocks are joined with a blank line; a block that starts with Claude Code's
  `x-anthropic-billing-header` is dropped, as vLLM drops it: it holds a per-request hash that
  would rewrite the prompt's first line every turn and open a new segment at every turn.
- A `role: "system"` message before the first user or assistant message joins the system
  prompt. One later in `messages` becomes a user message with the same text, in place: every
  chat template accepts that (Qwen3's refuses a system message after the first), and it never
  rewrites the history before it (moving it into the system prompt would open a new segment).
- `tool_use.input` reaches the template as the object it is (templates print it with `tojson`,
  as for any dict arguments); `thinking` blocks become `reasoning_content`; `redacted_thinking`
  is opaque and dropped; `tool_result` blocks become tool messages, in order.
- `cache_control` (on any block or tool), `output_config`, `context_management`, the thinking
  budget and the `anthropic-*` headers are accepted and ignored: none of them may change the
  render (cache markers move between turns).
- `max_tokens` is a bound, not a demand: one over the context the prompt leaves is lowered to it
  (Claude Code asks 32,000 of any model), and a reply cut there ends with Anthropic's
  `model_context_window_exceeded`. The prompt itself must fit.
- Images and documents are refused (400): the proxy serves text-only models. Forced tool use
  (`tool_choice` `any` or `tool`, `disable_parallel_tool_use`) is constrained decoding, exactly
  as chat completions' `tool_choice: required` / named / `parallel_tool_calls: false`.

Tool-use ids: the reply shows a call id the parser minted (`chatcmpl-tool-X`) as `toolu_X`
(`tool_use_id`), and an echoed `toolu_X` is read back as `chatcmpl-tool-X`, so echoes are
recognised exactly as chat completions' are. The message id is the completion id the same way
(`msg_X` for `chatcmpl-X`), which rewards may name in either spelling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
import pydantic
from vllm.entrypoints.anthropic.protocol import (
    AnthropicContentBlock,
    AnthropicCountTokensRequest,
    AnthropicMessagesRequest,
)
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.exceptions import VLLMValidationError

from molt_proxy.conversation import (
    Conversation,
    check_sampling,
    echoed_call_ids,
    sampling_fields,
    with_string_arguments,
)
from molt_proxy.errors import BadRequest
from molt_proxy.ids import valid_session_id
from molt_proxy.wire.jsonbody import decode_json_object

_BILLING_HEADER = "x-anthropic-billing-header"
_UNSUPPORTED = frozenset({"image", "document", "search_result", "container_upload"})
_CALL_PREFIX, _TOOLU_PREFIX = "chatcmpl-tool-", "toolu_"
_COMPLETION_PREFIX, _MESSAGE_PREFIX = "chatcmpl-", "msg_"


def tool_use_id(call_id: str) -> str:
    """The `toolu_…` id the reply shows for a call id the proxy's parser minted."""
    return _TOOLU_PREFIX + call_id.removeprefix(_CALL_PREFIX) if call_id.startswith(_CALL_PREFIX) else call_id


def call_id(tool_use: str) -> str:
    """The call id an echoed `tool_use` id stands for (the inverse of `tool_use_id`)."""
    minted = tool_use.startswith(_TOOLU_PREFIX)
    return _CALL_PREFIX + tool_use.removeprefix(_TOOLU_PREFIX) if minted else tool_use


def message_id(completion_id: str) -> str:
    return _MESSAGE_PREFIX + completion_id.removeprefix(_COMPLETION_PREFIX)


def recorded_completion_id(any_id: str) -> str:
    """A completion id as recorded, given it as a message id (`msg_X`) or as recorded."""
    prefixed = any_id.startswith(_MESSAGE_PREFIX)
    return _COMPLETION_PREFIX + any_id.removeprefix(_MESSAGE_PREFIX) if prefixed else any_id


_BLOCK: dict[str, Any] = {
    "type": "object",
    "properties": {
        "type": {"enum": ["text", "tool_use", "tool_result", "thinking", "redacted_thinking"]},
        "text": {"type": "string"},
    },
    "required": ["type"],
}
_MESSAGE: dict[str, Any] = {
    "type": "object",
    "properties": {
        "role": {"enum": ["user", "assistant", "system"]},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _BLOCK}]},
    },
    "required": ["role", "content"],
}
_TOOL: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "description": {"type": "string"},
        "input_schema": {"type": "object"},
    },
    "required": ["name", "input_schema"],
}
COUNT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "Anthropic Messages (the fields vLLM's AnthropicMessagesRequest takes; a subset here).",
    "properties": {
        "model": {"type": "string", "minLength": 1},
        "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
        "system": {"anyOf": [{"type": "string"}, {"type": "array", "items": _BLOCK}]},
        "tools": {"type": "array", "items": _TOOL},
        "tool_choice": {
            "type": "object",
            "properties": {
                "type": {"enum": ["auto", "any", "tool", "none"]},
                "name": {"type": "string"},
                "disable_parallel_tool_use": {"type": "boolean"},
            },
        },
        "thinking": {"type": "object", "properties": {"type": {"enum": ["enabled", "adaptive", "disabled"]}}},
        "metadata": {"type": "object"},
    },
    "required": ["model", "messages"],
}
MESSAGES_SCHEMA: dict[str, Any] = {
    **COUNT_SCHEMA,
    "properties": {
        **COUNT_SCHEMA["properties"],
        "max_tokens": {"type": "integer", "minimum": 1},
        "stop_sequences": {"type": "array", "items": {"type": "string", "minLength": 1}},
        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": 0},
        "stream": {"type": "boolean"},
    },
    "required": ["model", "messages", "max_tokens"],
}


@dataclass(slots=True, frozen=True)
class MessagesCall:
    """A decoded `/v1/messages` request: the conversation, and whether to stream the reply."""

    conversation: Conversation
    stream: bool
    max_tokens: int
    """The request's `max_tokens` (0 for `count_tokens`): a length cut short of it met the end
    of the context (`model_context_window_exceeded`)."""


def decode_messages_request(body: bytes, *, count: bool = False) -> MessagesCall:
    """Bytes → the conversation of a messages request; `count`: a `count_tokens` request
    (no `max_tokens`, nothing sampled)."""
    data = decode_json_object(body)
    _refuse_media(data.get("messages"))
    _check_budget(data)
    model = AnthropicCountTokensRequest if count else AnthropicMessagesRequest
    request = _validate(model, data)
    messages = _system_messages(request.system)
    leading = True
    for index, message in enumerate(request.messages):
        leading = leading and message.role == "system"
        messages += _convert(message.role, message.content, index, leading)
    if not messages or all(m["role"] == "system" for m in messages):
        raise BadRequest("'messages' must hold a user or assistant message", param="messages")
    tools = [_tool(tool) for tool in request.tools or []] or None
    template_kwargs = dict(request.chat_template_kwargs or {})
    if request.thinking is not None:
        template_kwargs["enable_thinking"] = request.thinking.type != "disabled"
    parser_request = _parser_request(request, messages, tools, template_kwargs)
    if not count:
        check_sampling(parser_request)
    conversation = Conversation(
        messages=messages,
        tools=tools,
        template_kwargs=template_kwargs,
        sampling=sampling_fields(parser_request),
        max_tokens=getattr(request, "max_tokens", None),
        fit_max_tokens=True,
        parser_request=parser_request,
        session_id=metadata_session(data.get("metadata")),
        call_ids=echoed_call_ids(messages),
    )
    max_tokens = getattr(request, "max_tokens", 0)
    return MessagesCall(conversation, bool(getattr(request, "stream", False)), max_tokens)


def _validate(model: type[pydantic.BaseModel], data: dict[str, Any]) -> Any:
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        error = exc.errors()[0]
        # Union members add their type names to the location; the field path is the rest.
        param = ".".join(str(p) for p in error["loc"] if not str(p)[:1].isupper() and "[" not in str(p))
        raise BadRequest(f"invalid value for '{param}': {error['msg'][:300]}", param=param or None) from None


def _check_budget(data: dict[str, Any]) -> None:
    """Checked before vLLM's model, whose check across the two fields names neither."""
    thinking, max_tokens = data.get("thinking"), data.get("max_tokens")
    budget = thinking.get("budget_tokens") if isinstance(thinking, dict) else None
    if type(budget) is int and type(max_tokens) is int and budget >= max_tokens:
        message = f"'thinking.budget_tokens' ({budget}) must be less than 'max_tokens' ({max_tokens})"
        raise BadRequest(message, param="thinking.budget_tokens")


def _refuse_media(messages: Any) -> None:
    """Images and documents, before validation, with a message that says why (vLLM's model
    would take images, and call a document an unknown block type)."""
    if not isinstance(messages, list):
        return
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        for j, block in enumerate(content if isinstance(content, list) else []):
            inner = block.get("content") if isinstance(block, dict) else None
            nested = [(f".content.{k}", b) for k, b in enumerate(inner)] if isinstance(inner, list) else []
            for suffix, part in [("", block), *nested]:
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind in _UNSUPPORTED:
                    param = f"messages.{i}.content.{j}{suffix}"
                    raise BadRequest(
                        f"{param}: {kind} content is not supported: the served model reads text only",
                        param=param,
                    )


def _system_messages(system: str | list[AnthropicContentBlock] | None) -> list[dict[str, Any]]:
    texts = [system] if isinstance(system, str) else [b.text or "" for b in system or [] if b.type == "text"]
    text = "\n\n".join(t for t in texts if t and not t.startswith(_BILLING_HEADER))
    return [{"role": "system", "content": text}] if text else []


def _convert(
    role: str, content: str | list[AnthropicContentBlock], index: int, leading: bool
) -> list[dict[str, Any]]:
    """One Anthropic message → the template's messages (a user message's tool results are
    tool messages of their own, in order)."""
    param = f"messages.{index}.content"
    if role == "system":
        text = content if isinstance(content, str) else "\n".join(b.text or "" for b in content)
        if not text or text.startswith(_BILLING_HEADER):
            return []
        return [{"role": "system" if leading else "user", "content": text}]
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if role == "assistant":
        return [_assistant(content, param)]
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(content):
        if block.type == "text":
            texts.append(block.text or "")
        elif block.type == "tool_result":
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            out.append(_tool_result(block, f"{param}.{j}"))
        else:
            raise BadRequest(
                f"{param}.{j}: a user message cannot hold a {block.type} block", param=f"{param}.{j}"
            )
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant(blocks: list[AnthropicContentBlock], param: str) -> dict[str, Any]:
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        if block.type == "text":
            texts.append(block.text or "")
        elif block.type == "thinking":
            reasoning.append(block.thinking or "")
        elif block.type == "tool_use":
            if not block.id or not block.name or block.input is None:
                raise BadRequest(
                    f"{param}.{j}: tool_use needs 'id', 'name' and 'input'", param=f"{param}.{j}"
                )
            function = {"name": block.name, "arguments": block.input}
            calls.append({"id": call_id(block.id), "type": "function", "function": function})
        elif block.type != "redacted_thinking":
            raise BadRequest(
                f"{param}.{j}: an assistant message cannot hold a {block.type} block", param=f"{param}.{j}"
            )
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _tool_result(block: AnthropicContentBlock, param: str) -> dict[str, Any]:
    """A tool message. `is_error` is the agent's note; the content itself says what failed
    (Claude Code wraps it in `<tool_use_error>`), so it renders as sent."""
    if not block.tool_use_id:
        raise BadRequest(f"{param}: tool_result needs 'tool_use_id'", param=f"{param}.tool_use_id")
    content = block.content
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(
                    f"{param}.content.{k}: only text blocks are supported", param=f"{param}.content.{k}"
                )
            texts.append(part["text"])
        content = "\n".join(texts)
    return {"role": "tool", "tool_call_id": call_id(block.tool_use_id), "content": content or ""}


def _tool(tool: Any) -> dict[str, Any]:
    """An Anthropic tool as the chat template takes it (the shape chat completions sends), with
    its `strict` as vLLM's Anthropic route keeps it: a strict tool's input follows its schema."""
    described = {"description": tool.description} if tool.description is not None else {}
    strict = {"strict": tool.strict} if tool.strict is not None else {}
    function = {"name": tool.name, **described, "parameters": tool.input_schema, **strict}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    """Anthropic's `tool_choice` as chat completions' fields, which the constraint code reads
    (`constraints.py`): `any` is `required`, `tool` names the function, and
    `disable_parallel_tool_use` is `parallel_tool_calls: false`."""
    if not tools:
        return {"tool_choice": None}
    if choice is None:
        return {"tool_choice": "auto"}
    fields: dict[str, Any] = {"tool_choice": {"any": "required"}.get(choice.type, choice.type)}
    if choice.type == "tool":
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    if choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    return fields


def _parser_request(
    request: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, kwargs: dict[str, Any]
) -> ChatCompletionRequest:
    """vLLM's chat request for its parsers (and the sampling fields), built as vLLM's Anthropic
    route builds it; the parsers read its tools, tool choice, template kwargs and stops."""
    fields: dict[str, Any] = {
        "model": request.model,
        "messages": [with_string_arguments(m) for m in messages],
        "chat_template_kwargs": kwargs,
        "tools": tools,
        **_chat_tool_choice(request.tool_choice, tools),
    }
    if isinstance(request, AnthropicMessagesRequest):
        fields |= {
            "max_tokens": request.max_tokens,
            "stop": request.stop_sequences,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "top_k": request.top_k,
        }
        if any(not s for s in request.stop_sequences or []):
            raise BadRequest("'stop_sequences' cannot contain an empty string", param="stop_sequences")
    try:
        return ChatCompletionRequest.model_validate(fields)
    except VLLMValidationError as exc:  # its cross-field checks, e.g. a tool_choice naming no tool
        message = str(exc.args[0]) if exc.args else "invalid request"
        raise BadRequest(message[:300], param=exc.parameter) from None
    except (pydantic.ValidationError, ValueError, TypeError) as exc:
        raise BadRequest(f"invalid request: {type(exc).__name__}") from None


def metadata_session(metadata: Any) -> str | None:
    """The session a request names: `metadata.session_id`, else the `session_id` inside
    Claude Code's `metadata.user_id` (a JSON string), which its sub-agents share.

    `user_id` is Anthropic's opaque end-user id: any string is a valid one there, and a client
    that puts something else in it never asked the proxy to read it. So reading it is a hint,
    never a refusal: JSON that does not parse, nests past orjson's 1,024 levels, holds a
    5,000-digit number or a lone surrogate, or a `session_id` that is not a valid id
    (`ids.py`), is ignored, and the request is inferred as one without the hint. orjson, not
    `json`: it refuses lone surrogates and deep nesting itself, without recursion, and never
    calls `int()` on a long literal (Python's refuses past 4,300 digits)."""
    if not isinstance(metadata, dict):
        return None
    named = metadata.get("session_id")
    if named is not None:
        if not isinstance(named, str) or not named:
            raise BadRequest("'metadata.session_id' must be a non-empty string", param="metadata.session_id")
        return named
    user = metadata.get("user_id")
    if not isinstance(user, str) or not user.startswith("{"):
        return None
    try:
        parsed = orjson.loads(user)
    except orjson.JSONDecodeError:
        return None
    hint = parsed.get("session_id") if isinstance(parsed, dict) else None
    return hint if isinstance(hint, str) and valid_session_id(hint) else None
