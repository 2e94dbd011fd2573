"""Anthropic Messages on the wire, the reply side: a turn's `RecordedReply` as a `message`, or
its stream events as Anthropic's server-sent events, and errors in Anthropic's shape.

Content blocks come in sampled order: `thinking` (with a `signature` the proxy mints from the
completion id: Anthropic clients send a thinking block back only with one; an echo is
recognised by its tool-use ids or its text, `echo.py`), `text` (none that is only whitespace,
such as Qwen3's `\\n\\n` between its thinking and a call: Anthropic's API refuses such a block
sent back, and echo restoration puts the sampled whitespace back), then one `tool_use` per
call, its `input` parsed from the exact JSON the model sampled. Streaming is real: each
event goes out as vLLM's parsers release text from the sampled ids —

    message_start, (content_block_start, [ping], content_block_delta*, content_block_stop)*,
    message_delta (stop reason, usage), message_stop

— and `input_json_delta` pieces add up to the call's sampled arguments. A failure after the
first event is an `error` event (the status line has gone out). `stop_reason` is Anthropic's:
`max_tokens` for a length cut (`model_context_window_exceeded` where the end of the context
cut it first: the turn lowers a `max_tokens` the context cannot hold), `tool_use` when the
reply calls tools, `stop_sequence` when a requested stop string ended it, else `end_turn`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from vllm.entrypoints.generate.base.protocol import DeltaMessage

from molt_proxy.errors import MoltError
from molt_proxy.parsing import arguments_object
from molt_proxy.types import ParsedReply, RecordedReply
from molt_proxy.wire.anthropic import message_id, tool_use_id
from molt_proxy.wire.events import Delta, Opened, Replayed, StreamEvent
from molt_proxy.wire.sse import encoded


def thinking_signature(completion_id: str) -> str:
    """The signature of a reply's thinking block: it names the completion it came from."""
    return f"molt:{completion_id}"


def event(name: str, payload: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **payload})}\n\n"


def stop_reason(reply: RecordedReply, stop_sequence: str | None, max_tokens: int) -> str:
    """Anthropic's stop reason; a length cut short of `max_tokens` (the request's) met the end
    of the context (the turn lowered `max_tokens` to fit it)."""
    if reply.finish_reason == "length":
        return "max_tokens" if reply.completion_tokens >= max_tokens else "model_context_window_exceeded"
    if reply.message.tool_calls:
        return "tool_use"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def content_blocks(message: ParsedReply, completion_id: str) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if message.reasoning_content:
        signature = thinking_signature(completion_id)
        blocks.append({"type": "thinking", "thinking": message.reasoning_content, "signature": signature})
    if message.content and message.content.strip():
        blocks.append({"type": "text", "text": message.content})
    for call in message.tool_calls:
        function = call["function"]
        blocks.append(
            {
                "type": "tool_use",
                "id": tool_use_id(call["id"]),
                "name": function["name"],
                "input": arguments_object(function.get("arguments")),
            }
        )
    return blocks


def encode_message(
    reply: RecordedReply, session_id: str, stop_sequence: str | None, max_tokens: int
) -> dict[str, Any]:
    """The `message` body of a turn (or of its replay)."""
    return {
        "id": message_id(reply.completion_id),
        "type": "message",
        "role": "assistant",
        "model": reply.model,
        "content": content_blocks(reply.message, reply.completion_id),
        "stop_reason": stop_reason(reply, stop_sequence, max_tokens),
        "stop_sequence": stop_sequence,
        "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": reply.completion_tokens},
        "session_id": session_id,
    }


def error_body(error: MoltError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error.anthropic_type, "message": error.message}}


@dataclass(slots=True)
class Blocks:
    """The content blocks of one streamed reply: which is open, and the events that open,
    extend and close them."""

    completion_id: str
    index: int = -1
    kind: str | None = None
    """The open block's type (thinking, text, tool_use); None: none open."""
    call: int | None = None
    """The open tool_use block's call index (vLLM's)."""
    pinged: bool = False
    blank: str = ""
    """Whitespace released before any other text: a text block opens only with some."""
    out: list[str] = field(default_factory=list)

    def _open(self, block: dict[str, Any], call: int | None = None) -> None:
        self.close()
        self.blank = ""
        self.index += 1
        self.kind, self.call = block["type"], call
        self.out.append(event("content_block_start", {"index": self.index, "content_block": block}))
        if not self.pinged:
            self.pinged = True
            self.out.append(event("ping", {}))

    def _delta(self, delta: dict[str, Any]) -> None:
        self.out.append(event("content_block_delta", {"index": self.index, "delta": delta}))

    def close(self) -> None:
        if self.kind == "thinking":
            self._delta({"type": "signature_delta", "signature": thinking_signature(self.completion_id)})
        if self.kind is not None:
            self.out.append(event("content_block_stop", {"index": self.index}))
        self.kind = None

    def _text(self, text: str) -> None:
        """Text opens a block once it holds more than whitespace (kept until then)."""
        if self.kind != "text":
            text, self.blank = self.blank + text, ""
            if not text.strip():
                self.blank = text
                return
            self._open({"type": "text", "text": ""})
        self._delta({"type": "text_delta", "text": text})

    def feed(self, delta: DeltaMessage) -> list[str]:
        if delta.reasoning:
            if self.kind != "thinking":
                self._open({"type": "thinking", "thinking": "", "signature": ""})
            self._delta({"type": "thinking_delta", "thinking": delta.reasoning})
        if delta.content:
            self._text(delta.content)
        for call in delta.tool_calls:
            function = call.function
            if self.kind != "tool_use" or self.call != call.index:
                name = (function.name if function is not None else None) or ""
                block: dict[str, Any] = {
                    "type": "tool_use",
                    "id": tool_use_id(call.id or ""),
                    "name": name,
                    "input": {},
                }
                self._open(block, call.index)
            if function is not None and function.arguments:
                self._delta({"type": "input_json_delta", "partial_json": function.arguments})
        out, self.out = self.out, []
        return out

    def whole(self, message: ParsedReply) -> list[str]:
        """A recorded reply's blocks, each in one delta (replaying a retried request)."""
        for block in content_blocks(message, self.completion_id):
            if block["type"] == "thinking":
                self._open({**block, "thinking": "", "signature": ""})
                self._delta({"type": "thinking_delta", "thinking": block["thinking"]})
            elif block["type"] == "text":
                self._open({**block, "text": ""})
                self._delta({"type": "text_delta", "text": block["text"]})
            else:
                self._open({**block, "input": {}})
                self._delta({"type": "input_json_delta", "partial_json": json.dumps(block["input"])})
        self.close()
        out, self.out = self.out, []
        return out


def _start(completion_id: str, model: str, input_tokens: int, session_id: str) -> str:
    message: dict[str, Any] = {
        "id": message_id(completion_id),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": input_tokens, "output_tokens": 0},
        "session_id": session_id,
    }
    return event("message_start", {"message": message})


def _end(reply: RecordedReply, stop_sequence: str | None, max_tokens: int) -> list[str]:
    delta = {"stop_reason": stop_reason(reply, stop_sequence, max_tokens), "stop_sequence": stop_sequence}
    usage = {"input_tokens": reply.prompt_tokens, "output_tokens": reply.completion_tokens}
    return [event("message_delta", {"delta": delta, "usage": usage}), event("message_stop", {})]


@dataclass(slots=True)
class _Events:
    """Anthropic's events of one streamed turn (`encode_message_stream`)."""

    max_tokens: int
    blocks: Blocks | None = None

    def lines(self, item: StreamEvent) -> list[str]:
        if isinstance(item, Replayed):
            reply = item.reply
            return [
                _start(reply.completion_id, reply.model, reply.prompt_tokens, item.session_id),
                *Blocks(reply.completion_id).whole(reply.message),
                *_end(reply, item.stop_sequence, self.max_tokens),
            ]
        if isinstance(item, Opened):
            self.blocks = Blocks(item.completion_id)
            return [_start(item.completion_id, item.model, item.prompt_tokens, item.session_id)]
        if self.blocks is None:
            return []
        if isinstance(item, Delta):
            return self.blocks.feed(item.delta)
        lines = self.blocks.feed(item.last) if item.last is not None else []
        self.blocks.close()
        return [*lines, *self.blocks.out, *_end(item.reply, item.stop_sequence, self.max_tokens)]

    def failed(self, error: MoltError) -> list[str]:
        return [event("error", {"error": error_body(error)["error"]})]


def encode_message_stream(events: AsyncGenerator[StreamEvent], max_tokens: int) -> AsyncGenerator[str]:
    """A streamed turn as Anthropic's events; a failure after the first event, an `error` event
    (`wire.sse.encoded`). Closing this closes `events`, and with them the turn."""
    return encoded(events, _Events(max_tokens))
