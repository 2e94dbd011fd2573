"""The Gemini API on the wire, the reply side: a turn's `RecordedReply` as a
`GenerateContentResponse`, or its stream events as the API's server-sent chunks
(`streamGenerateContent?alt=sse`), and errors in Google's shape.

A reply is one candidate whose `content.parts` come in sampled order: a thought part
(`{"text", "thought": true}`, only with `thinkingConfig.includeThoughts`), a text part (none
that is only whitespace, such as Qwen3's `\\n\\n` between its thinking and a call: echo
restoration puts the sampled whitespace back), then a `functionCall` part per call, with an
`id` (the parser's call id) and `args` parsed from the exact JSON the model sampled (key
order kept). A reply with reasoning carries a `thoughtSignature` (`wire.gemini_contents.thought_signature`)
where Gemini puts one: on its first `functionCall` part, else on its last part (an empty text
part where there is no other). `finishReason` is `MAX_TOKENS` for a length cut, else `STOP`;
`usageMetadata` counts the prompt ids sent (`promptTokenCount`), the ids sampled, split into
`thoughtsTokenCount` (the reasoning text's ids, as the tokenizer encodes it alone) and
`candidatesTokenCount` (the rest), and their `totalTokenCount`; `modelVersion` is the served
model and `responseId` the recorded completion id (which rewards may name).

Streaming is real: a chunk (a whole `GenerateContentResponse` holding the new parts) goes out
as vLLM's parsers release text or reasoning; a function call goes out whole, in the last
chunk, with the finish reason, the usage and the signature. A failure after the first chunk is
a last chunk holding Google's error object.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from vllm.entrypoints.generate.base.protocol import DeltaMessage

from molt_proxy.errors import MoltError
from molt_proxy.parsing import arguments_object
from molt_proxy.types import ParsedReply, RecordedReply
from molt_proxy.wire.events import Delta, Opened, Replayed, StreamEvent
from molt_proxy.wire.gemini_contents import thought_signature
from molt_proxy.wire.sse import data_event, encoded

Count = Callable[[str], int]
"""How many ids a text encodes to (the tokenizer's), for `thoughtsTokenCount`."""

_GOOGLE_STATUS = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    502: "UNAVAILABLE",
    503: "UNAVAILABLE",
}


def error_status(error: MoltError) -> int:
    """The HTTP status of `error` on the Gemini routes."""
    return error.google_code or error.status


def error_body(error: MoltError) -> dict[str, Any]:
    """Google's error object: `{"error": {"code", "message", "status"}}`."""
    return {"error": {"code": error_status(error), "message": error.message, "status": error.google_status}}


def http_error_body(status: int, message: str) -> dict[str, Any]:
    """Google's error object for a status Starlette raised (no route, a method not allowed)."""
    return {
        "error": {
            "code": status,
            "message": message,
            "status": _GOOGLE_STATUS.get(status, "INVALID_ARGUMENT"),
        }
    }


def finish_reason(reply: RecordedReply) -> str:
    return "MAX_TOKENS" if reply.finish_reason == "length" else "STOP"


def _call_part(call: dict[str, Any]) -> dict[str, Any]:
    function = call["function"]
    args = arguments_object(function.get("arguments"))
    return {"functionCall": {"id": call["id"], "name": function["name"], "args": args}}


def _signed(parts: list[dict[str, Any]], message: ParsedReply) -> list[dict[str, Any]]:
    """`parts` with the reply's signature where Gemini puts one (see the module)."""
    if not message.reasoning_content:
        return parts
    signature = {"thoughtSignature": thought_signature(message.reasoning_content)}
    calls = [i for i, part in enumerate(parts) if "functionCall" in part]
    if not parts:
        return [{"text": "", **signature}]
    at = calls[0] if calls else len(parts) - 1
    return [{**part, **signature} if i == at else part for i, part in enumerate(parts)]


def content_parts(message: ParsedReply, include_thoughts: bool) -> list[dict[str, Any]]:
    """A reply's parts, whole."""
    parts: list[dict[str, Any]] = []
    if include_thoughts and message.reasoning_content:
        parts.append({"text": message.reasoning_content, "thought": True})
    if message.content and message.content.strip():
        parts.append({"text": message.content})
    parts += [_call_part(call) for call in message.tool_calls]
    return _signed(parts, message)


def usage(reply: RecordedReply, count: Count) -> dict[str, Any]:
    reasoning = reply.message.reasoning_content
    thoughts = min(count(reasoning), reply.completion_tokens) if reasoning else 0
    metadata = {
        "promptTokenCount": reply.prompt_tokens,
        "candidatesTokenCount": reply.completion_tokens - thoughts,
        "totalTokenCount": reply.prompt_tokens + reply.completion_tokens,
    }
    if thoughts:
        metadata["thoughtsTokenCount"] = thoughts
    return metadata


def _response(
    parts: list[dict[str, Any]],
    completion_id: str,
    model: str,
    end: tuple[RecordedReply, Count] | None = None,
) -> dict[str, Any]:
    candidate: dict[str, Any] = {"content": {"role": "model", "parts": parts}, "index": 0}
    body: dict[str, Any] = {"candidates": [candidate]}
    if end is not None:
        reply, count = end
        candidate["finishReason"] = finish_reason(reply)
        body["usageMetadata"] = usage(reply, count)
    return {**body, "modelVersion": model, "responseId": completion_id}


def encode_response(reply: RecordedReply, include_thoughts: bool, count: Count) -> dict[str, Any]:
    """The `GenerateContentResponse` of a turn (or of its replay)."""
    parts = content_parts(reply.message, include_thoughts)
    return _response(parts, reply.completion_id, reply.model, (reply, count))


@dataclass(slots=True)
class _Chunks:
    """Google's chunks of one streamed turn (`encode_stream`)."""

    include_thoughts: bool
    count: Count
    completion_id: str = ""
    model: str = ""
    blank: str = ""
    """Whitespace released before any other text: a text part goes out only with some."""
    texts: bool = False
    """A text part went out."""
    pending: list[dict[str, Any]] = field(default_factory=list)

    def _parts(self, delta: DeltaMessage) -> list[dict[str, Any]]:
        parts: list[dict[str, Any]] = []
        if delta.reasoning and self.include_thoughts:
            parts.append({"text": delta.reasoning, "thought": True})
        if delta.content:
            text, self.blank = self.blank + delta.content, ""
            if text.strip() or self.texts:
                self.texts = True
                parts.append({"text": text})
            else:
                self.blank = text
        return parts  # calls go out whole, at the end, from the recorded reply

    def lines(self, item: StreamEvent) -> list[str]:
        if isinstance(item, Replayed):
            return [data_event(encode_response(item.reply, self.include_thoughts, self.count))]
        if isinstance(item, Opened):
            self.completion_id, self.model = item.completion_id, item.model
            return []
        if isinstance(item, Delta):
            parts = self._parts(item.delta)
            return [data_event(_response(parts, self.completion_id, self.model))] if parts else []
        reply = item.reply
        parts = self._parts(item.last) if item.last is not None else []
        parts += [_call_part(call) for call in reply.message.tool_calls]
        if reply.message.reasoning_content and not reply.message.tool_calls:
            parts.append({"text": ""})  # the signature's part, after the text
        parts = _signed(parts, reply.message)
        return [data_event(_response(parts, reply.completion_id, reply.model, (reply, self.count)))]

    def failed(self, error: MoltError) -> list[str]:
        return [data_event(error_body(error))]


def encode_stream(
    events: AsyncGenerator[StreamEvent], include_thoughts: bool, count: Count
) -> AsyncGenerator[str]:
    """A streamed turn as Google's `data:` chunks; a failure after the first chunk, a chunk
    holding the error (`wire.sse.encoded`). Closing this closes `events`, and with them the
    turn."""
    return encoded(events, _Chunks(include_thoughts, count))


def count_body(total: int) -> dict[str, Any]:
    """`countTokens`' answer."""
    return {"totalTokens": total}


def model_body(name: str, max_model_len: int | None) -> dict[str, Any]:
    """A served model as `GET /v1beta/models` describes one."""
    limits = {"inputTokenLimit": max_model_len, "outputTokenLimit": max_model_len} if max_model_len else {}
    return {
        "name": f"models/{name}",
        "baseModelId": name,
        "version": "molt-proxy",
        "displayName": name,
        "description": "Served by molt-proxy from vLLM; every turn is recorded token-exact.",
        **limits,
        "supportedGenerationMethods": ["generateContent", "streamGenerateContent", "countTokens"],
    }
