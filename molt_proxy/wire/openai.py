"""OpenAI Chat Completions on the wire: request decoding, reply encoding.

A request decodes into a `ChatCall`: the format-neutral `Conversation` the turn runs on
(messages and tools as the chat template takes them, the sampling fields, vLLM's request for
its parsers, the session hints) and what stays OpenAI's (`stream`, `include_usage`). A turn's
`RecordedReply` encodes back as a whole reply or as stream chunks; `finish_reason` becomes
OpenAI's here, and only here.

Requests are validated with vLLM's own `ChatCompletionRequest` (`conversation.chat_request`:
every field vLLM accepts means here what it means there), plus the checks vLLM leaves to the
chat template: known roles, content where a role needs it, text-only content.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from vllm.entrypoints.generate.base.protocol import DeltaMessage

from molt_proxy.conversation import (
    Conversation,
    chat_request,
    check_sampling,
    echoed_call_ids,
    requested_max_tokens,
    sampling_fields,
)
from molt_proxy.errors import BadRequest, MoltError
from molt_proxy.types import ParsedReply, RecordedReply, TokenLogprobs
from molt_proxy.wire.events import Delta, Opened, Replayed, StreamEvent
from molt_proxy.wire.jsonbody import decode_json_object
from molt_proxy.wire.logprobs import TokenBytes, encode_logprobs, requested_logprobs
from molt_proxy.wire.sse import DONE, data_event, encoded

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
_NEEDS_CONTENT = frozenset({"system", "developer", "user", "tool", "function"})


@dataclass(slots=True, frozen=True)
class ChatCall:
    """A decoded chat request: the conversation, and how OpenAI wants the reply sent."""

    conversation: Conversation
    stream: bool
    include_usage: bool
    """A streamed reply ends with a usage chunk (`stream_options.include_usage`)."""


def decode_chat_request(body: bytes) -> ChatCall:
    """Bytes → a validated request whose messages are plain dicts with text content. The
    messages and tools are kept as sent: vLLM's model drops or renames keys (pydantic drops
    unknown ones; `reasoning_content` becomes `reasoning`), and the chat template must see
    them as the agent wrote them."""
    data = decode_json_object(body)
    if not isinstance(data.get("messages"), list) or not data["messages"]:
        raise BadRequest("'messages' must be a non-empty array", param="messages")
    messages = [_normalize_message(m, i) for i, m in enumerate(data["messages"])]
    top_logprobs = requested_logprobs(data)
    _check_constraint_fields(data)
    # vLLM's validator rewrites the dicts it is given (`reasoning_content` → `reasoning`),
    # and the chat template reads `reasoning_content`: it validates copies.
    request = chat_request({**data, "messages": [dict(m) for m in messages]})
    if request.n != 1:
        # n choices would be n diverging episodes behind one request, and the agent can
        # continue only one of them: sample N attempts as N sessions instead.
        raise BadRequest("only n=1 is supported; send n requests to sample n replies", param="n")
    check_sampling(request)
    conversation = Conversation(
        messages=messages,
        tools=data.get("tools"),
        template_kwargs=dict(request.chat_template_kwargs or {}),
        sampling=sampling_fields(request),
        max_tokens=requested_max_tokens(request),
        parser_request=request,
        session_id=_metadata_session(data.get("metadata")),
        call_ids=echoed_call_ids(messages),
        top_logprobs=top_logprobs,
    )
    usage_chunk = bool(request.stream_options and request.stream_options.include_usage)
    return ChatCall(conversation, bool(request.stream), usage_chunk)


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
"""The kinds of vLLM's `StructuredOutputsParams`, one of which a `structured_outputs` names."""


def _check_constraint_fields(data: dict[str, Any]) -> None:
    """The shapes vLLM's model does not check before it reads them (a `structured_outputs`
    that is not an object raised AttributeError in its validator) or keeps for later (a
    `logit_bias` key is a string to it, and an int to the sampler): refused here, by name."""
    constraint = data.get("structured_outputs")
    if constraint is not None and not isinstance(constraint, dict):
        raise BadRequest("'structured_outputs' must be an object", param="structured_outputs")
    if constraint is not None and sum(constraint.get(kind) is not None for kind in _CONSTRAINTS) != 1:
        raise BadRequest(
            f"'structured_outputs' must name exactly one of {', '.join(_CONSTRAINTS)}",
            param="structured_outputs",
        )
    bias = data.get("logit_bias")
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise BadRequest("'logit_bias' must be an object of token ids to numbers", param="logit_bias")
    for key in bias:
        if not (key.isascii() and key.isdigit()):
            raise BadRequest(
                f"'logit_bias' keys must be token ids in decimal digits, got {key[:40]!r}", param="logit_bias"
            )


def _normalize_message(message: Any, index: int) -> dict[str, Any]:
    param = f"messages.{index}"
    if not isinstance(message, dict):
        raise BadRequest(f"{param} must be an object", param=param)
    role = message.get("role")
    if role not in ROLES:
        raise BadRequest(f"{param}.role {role!r} is not one of {sorted(ROLES)}", param=f"{param}.role")
    content = message.get("content")
    if isinstance(content, list):
        content = "\n".join(_text_part(part, f"{param}.content") for part in content)
    elif content is not None and not isinstance(content, str):
        raise BadRequest(f"{param}.content must be a string or an array of parts", param=f"{param}.content")
    if content is None and role in _NEEDS_CONTENT:
        raise BadRequest(f"{param} with role {role!r} needs 'content'", param=f"{param}.content")
    _check_tool_calls(message.get("tool_calls"), f"{param}.tool_calls")
    # An echoed reply may hold only reasoning (vLLM's Qwen3 parser returns content null when
    # the model never closed its <think> block): that is a real turn, not an empty one.
    if (
        role == "assistant"
        and content is None
        and not (message.get("tool_calls") or message.get("reasoning_content"))
    ):
        raise BadRequest(
            f"{param}: an assistant message needs 'content', 'tool_calls' or 'reasoning_content'", param=param
        )
    return {**message, "content": content} if "content" in message or content is not None else message


def _check_tool_calls(calls: Any, param: str) -> None:
    """An echoed assistant message's calls reach the chat template as they are: each must be
    an object whose `function` is an object with a string name."""
    if calls is None:
        return
    if not isinstance(calls, list):
        raise BadRequest(f"{param} must be an array", param=param)
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise BadRequest(f"{param}.{i} must be an object with a 'function' object", param=f"{param}.{i}")
        if not isinstance(function.get("arguments", ""), str | dict):
            raise BadRequest(
                f"{param}.{i}.function.arguments must be a string", param=f"{param}.{i}.function.arguments"
            )


def _text_part(part: Any, param: str) -> str:
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    raise BadRequest(f"{param}: only text content parts are supported", param=param)


def _metadata_session(metadata: Any) -> str | None:
    """The session id a request names in `metadata.session_id`, if any."""
    value = metadata.get("session_id") if isinstance(metadata, dict) else None
    if value is not None and (not isinstance(value, str) or not value):
        raise BadRequest("'metadata.session_id' must be a non-empty string", param="metadata.session_id")
    return value


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def delta_fields(delta: DeltaMessage) -> dict[str, Any]:
    """vLLM's delta in our reply's field names (`reasoning_content`, as in the full reply)."""
    fields: dict[str, Any] = {}
    if delta.content:
        fields["content"] = delta.content
    if delta.reasoning:
        fields["reasoning_content"] = delta.reasoning
    if delta.tool_calls:
        fields["tool_calls"] = [call.model_dump(exclude_none=True) for call in delta.tool_calls]
    return fields


def finish_reason(reply: RecordedReply) -> str:
    """OpenAI's `finish_reason`: a stop that made tool calls is `tool_calls`; else vLLM's."""
    if reply.message.tool_calls and reply.finish_reason == "stop":
        return "tool_calls"
    return reply.finish_reason


def encode_reply(reply: RecordedReply, session_id: str, token_bytes: TokenBytes) -> dict[str, Any]:
    """The `chat.completion` body of a turn (or of its replay: the same bytes again)."""
    return {
        "id": reply.completion_id,
        "object": "chat.completion",
        "created": reply.created,
        "model": reply.model,
        "choices": [
            {
                "index": 0,
                "message": reply.message.as_message(),
                "logprobs": encode_logprobs(reply.logprobs, token_bytes),
                "finish_reason": finish_reason(reply),
            }
        ],
        "usage": usage(reply.prompt_tokens, reply.completion_tokens),
        "session_id": session_id,
    }


def _whole_delta(reply: ParsedReply) -> dict[str, Any]:
    """A whole reply as one delta (replaying a retried streaming request)."""
    message = reply.as_message()
    message["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message.get("tool_calls", []))]
    return {k: v for k, v in message.items() if v or k == "role"}


@dataclass(slots=True, frozen=True)
class ChunkStream:
    """The events of one streamed reply: every chunk carries its id, time, model and session."""

    completion_id: str
    created: int
    model: str
    session_id: str
    token_bytes: TokenBytes

    def chunk(
        self,
        delta: dict[str, Any] | None,
        finish_reason: str | None = None,
        usage: dict[str, int] | None = None,
        entries: list[TokenLogprobs] | None = None,
    ) -> str:
        """One `chat.completion.chunk` event; `delta=None` is the trailing usage chunk;
        `entries`: the logprobs of the ids sampled since the previous chunk, if asked for."""
        logprobs = encode_logprobs(entries, self.token_bytes)
        chunk: dict[str, Any] = {
            "id": self.completion_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": []
            if delta is None
            else [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
            "session_id": self.session_id,
        }
        if usage is not None:
            chunk["usage"] = usage
        return data_event(chunk)

    def closing(
        self,
        reply: RecordedReply,
        last: dict[str, Any],
        with_usage: bool,
        entries: list[TokenLogprobs] | None = None,
    ) -> list[str]:
        """The last events: the last delta with the finish reason, usage if asked, `[DONE]`."""
        events = [self.chunk(last, finish_reason(reply), entries=entries)]
        if with_usage:
            events.append(self.chunk(None, usage=usage(reply.prompt_tokens, reply.completion_tokens)))
        return [*events, DONE]

    @classmethod
    def replay(
        cls, reply: RecordedReply, session_id: str, with_usage: bool, token_bytes: TokenBytes
    ) -> list[str]:
        """A recorded reply streamed again, whole (its logprobs too), for a retried streaming
        request."""
        stream = cls(reply.completion_id, reply.created, reply.model, session_id, token_bytes)
        return stream.closing(reply, _whole_delta(reply.message), with_usage, reply.logprobs)


@dataclass(slots=True)
class _Chunks:
    """OpenAI's events of one streamed turn (`encode_stream`)."""

    with_usage: bool
    token_bytes: TokenBytes
    stream: ChunkStream | None = None

    def lines(self, event: StreamEvent) -> list[str]:
        if isinstance(event, Replayed):
            return ChunkStream.replay(event.reply, event.session_id, self.with_usage, self.token_bytes)
        if isinstance(event, Opened):
            self.stream = ChunkStream(
                event.completion_id, event.created, event.model, event.session_id, self.token_bytes
            )
            return [self.stream.chunk({"role": "assistant", "content": ""})]
        if self.stream is None:
            return []
        if isinstance(event, Delta):
            fields = delta_fields(event.delta)
            return [self.stream.chunk(fields, entries=event.logprobs)] if fields or event.logprobs else []
        last = delta_fields(event.last) if event.last is not None else {}
        return self.stream.closing(event.reply, last, self.with_usage)

    def failed(self, error: MoltError) -> list[str]:
        """An error chunk, then `[DONE]`, as vLLM's chat route ends a stream that failed (the
        OpenAI SDKs raise the error they read in a chunk)."""
        return [data_event(error.body()), DONE]


def encode_stream(
    events: AsyncGenerator[StreamEvent], with_usage: bool, token_bytes: TokenBytes
) -> AsyncGenerator[str]:
    """A streamed turn as OpenAI's server-sent events: a role chunk once vLLM answers, a chunk
    per delta (or per sampled ids whose text the parsers hold back, when logprobs are asked:
    each chunk carries the logprobs of the ids sampled since the last), then the finish
    reason, usage (if asked) and `[DONE]`; a failure after the first chunk, an error chunk
    (`wire.sse.encoded`). Closing this closes `events`, and with them the turn."""
    return encoded(events, _Chunks(with_usage, token_bytes))
