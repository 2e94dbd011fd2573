"""OpenAI Responses on the wire, the reply side: a turn's `RecordedReply` as a `response`
object, or its stream events as the Responses API's server-sent events.

Output items come in sampled order: `reasoning` (its text as one `summary_text`, and, when
`include` asks, an `encrypted_content` the proxy reads back exactly), an assistant `message`
with one `output_text`, then a `function_call` per call (a minted `call_id`, the exact sampled
`arguments`), or a `custom_tool_call` (its `input`) for a custom tool. A length cut is
`status: "incomplete"` with `incomplete_details.reason: "max_output_tokens"`.

Streaming is real: each event goes out as vLLM's parsers release text from the sampled ids —

    response.created, response.in_progress,
    (response.output_item.added, part added, *.delta*, *.done, part done,
     response.output_item.done)*,
    response.completed | response.incomplete

— every event with its `sequence_number`; `function_call_arguments.delta` pieces add up to the
sampled arguments. A custom tool call's `input` goes out whole when the call ends (its text
is a JSON string until then). A failure after the first event is `response.failed`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from vllm.entrypoints.generate.base.protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall
from vllm.entrypoints.openai.responses.utils import decode_custom_tool_input

from molt_proxy.errors import MoltError
from molt_proxy.types import ParsedReply, RecordedReply
from molt_proxy.wire.events import Delta, Opened, Replayed, StreamEvent
from molt_proxy.wire.responses import ResponsesRequest
from molt_proxy.wire.responses_items import (
    encrypted_reasoning,
    function_item_id,
    item_id,
    response_id,
    shown_call_id,
)
from molt_proxy.wire.sse import encoded


@dataclass(slots=True, frozen=True)
class ReplyShape:
    """What of the request a reply shows: the fields it echoes and how it shows calls."""

    request: ResponsesRequest
    encrypted: bool
    """Reasoning items carry `encrypted_content` (asked by `include`, or kept in the store)."""


def response_status(reply: RecordedReply) -> str:
    return "incomplete" if reply.finish_reason == "length" else "completed"


def reasoning_item(completion_id: str, text: str, encrypted: bool) -> dict[str, Any]:
    item: dict[str, Any] = {
        "id": item_id("rs", completion_id),
        "type": "reasoning",
        "summary": [{"type": "summary_text", "text": text}],
    }
    if encrypted:
        item["encrypted_content"] = encrypted_reasoning(text)
    return item


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(completion_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id("msg", completion_id),
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [_output_text(text)],
    }


def call_item(shape: ReplyShape, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    """A `function_call` item, or a `custom_tool_call` for a custom tool; a namespaced tool's
    call names its namespace."""
    tools = shape.request.tools
    item: dict[str, Any] = {
        "id": function_item_id(call_id),
        "status": status,
        "call_id": shown_call_id(call_id),
    }
    if name in tools.custom:
        item |= {"type": "custom_tool_call", "name": name, "input": decode_custom_tool_input(arguments)}
    else:
        item |= {"type": "function_call", "name": name, "arguments": arguments}
    if name in tools.namespaced:
        item["namespace"], item["name"] = tools.namespaced[name]
    return item


def output_items(
    shape: ReplyShape, message: ParsedReply, completion_id: str, status: str
) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if message.reasoning_content:
        items.append(reasoning_item(completion_id, message.reasoning_content, shape.encrypted))
    if message.content and message.content.strip():  # not the whitespace between reasoning and calls
        items.append(message_item(completion_id, message.content, status))
    for call in message.tool_calls:
        function = call["function"]
        items.append(call_item(shape, call["id"], function["name"], function.get("arguments") or "", status))
    return items


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _base(shape: ReplyShape, completion_id: str, created: int, model: str, session_id: str) -> dict[str, Any]:
    """A response without its outcome (`status`, `output`, `usage`), as it starts."""
    data = shape.request.data
    return {
        "id": response_id(completion_id),
        "object": "response",
        "created_at": created,
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "instructions": data.get("instructions"),
        "max_output_tokens": data.get("max_output_tokens"),
        "model": model,
        "output": [],
        "parallel_tool_calls": data.get("parallel_tool_calls", True),
        "previous_response_id": shape.request.previous_response_id,
        "reasoning": data.get("reasoning") or {"effort": None, "summary": None},
        "store": shape.request.store,
        "temperature": data.get("temperature", 1.0),
        "text": data.get("text") or {"format": {"type": "text"}},
        "tool_choice": data.get("tool_choice", "auto"),
        "tools": data.get("tools") or [],
        "top_p": data.get("top_p", 1.0),
        "truncation": "disabled",
        "usage": None,
        "metadata": data.get("metadata") or {},
        "user": None,
        "session_id": session_id,
    }


def encode_response(shape: ReplyShape, reply: RecordedReply, session_id: str) -> dict[str, Any]:
    """The `response` object of a turn (or of its replay)."""
    status = response_status(reply)
    response = _base(shape, reply.completion_id, reply.created, reply.model, session_id)
    response |= {
        "status": status,
        "output": output_items(shape, reply.message, reply.completion_id, status),
        "usage": _usage(reply.prompt_tokens, reply.completion_tokens),
    }
    if status == "incomplete":
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    return response


def _whole(message: ParsedReply) -> list[DeltaMessage]:
    """A recorded reply as deltas, each item whole (replaying a retried request)."""
    deltas = [DeltaMessage(reasoning=message.reasoning_content), DeltaMessage(content=message.content)]
    for index, call in enumerate(message.tool_calls):
        function = DeltaFunctionCall(
            name=call["function"]["name"], arguments=call["function"].get("arguments")
        )
        deltas.append(DeltaMessage(tool_calls=[DeltaToolCall(index=index, id=call["id"], function=function)]))
    return deltas


@dataclass(slots=True)
class Items:
    """The output items of one streamed response: which is open, its text so far, and the
    numbered events that open, extend and close them."""

    shape: ReplyShape
    response: dict[str, Any]
    """The response as it started (`_base`)."""
    sequence: int = 0
    kind: str | None = None
    """The open item's type (reasoning, message, call); None: none open."""
    call: tuple[int, str, str] | None = None
    """The open call's (index, id, name)."""
    text: str = ""
    blank: str = ""
    """Content held back while it is only whitespace (`_content`)."""
    done: list[dict[str, Any]] = field(default_factory=list)
    out: list[str] = field(default_factory=list)

    def emit(self, kind: str, payload: dict[str, Any]) -> None:
        data = {"type": kind, "sequence_number": self.sequence, **payload}
        self.sequence += 1
        self.out.append(f"event: {kind}\ndata: {json.dumps(data)}\n\n")

    def _where(self) -> dict[str, Any]:
        return {"output_index": len(self.done), "item_id": self._item("")["id"]}

    def _item(self, status: str) -> dict[str, Any]:
        completion_id = self.response["id"].replace("resp_", "chatcmpl-", 1)
        if self.kind == "reasoning":
            return reasoning_item(completion_id, self.text, self.shape.encrypted)
        if self.kind == "message":
            return message_item(completion_id, self.text, status)
        _, call_id, name = self.call or (0, "", "")
        return call_item(self.shape, call_id, name, self.text, status)

    def _open(self, kind: str, call: tuple[int, str, str] | None = None) -> None:
        self.close()
        self.kind, self.call, self.text, self.blank = kind, call, "", ""
        added = self._item("in_progress")
        if kind == "reasoning":
            added["summary"] = []
        elif kind == "message":
            added["content"] = []
        elif added["type"] == "function_call":
            added["arguments"] = ""
        else:
            added["input"] = ""
        self.emit("response.output_item.added", {"output_index": len(self.done), "item": added})
        if kind == "reasoning":
            part = {"type": "summary_text", "text": ""}
            self.emit(
                "response.reasoning_summary_part.added", {**self._where(), "summary_index": 0, "part": part}
            )
        elif kind == "message":
            self.emit(
                "response.content_part.added", {**self._where(), "content_index": 0, "part": _output_text("")}
            )

    def _extend(self, text: str) -> None:
        self.text += text
        if self.kind == "reasoning":
            self.emit(
                "response.reasoning_summary_text.delta", {**self._where(), "summary_index": 0, "delta": text}
            )
        elif self.kind == "message":
            delta = {**self._where(), "content_index": 0, "delta": text, "logprobs": []}
            self.emit("response.output_text.delta", delta)
        elif self._item("")["type"] == "function_call":
            self.emit("response.function_call_arguments.delta", {**self._where(), "delta": text})

    def close(self, status: str = "completed") -> None:
        if self.kind is None:
            return
        where, item = self._where(), self._item(status)
        if self.kind == "reasoning":
            self.emit(
                "response.reasoning_summary_text.done", {**where, "summary_index": 0, "text": self.text}
            )
            part = {"type": "summary_text", "text": self.text}
            self.emit("response.reasoning_summary_part.done", {**where, "summary_index": 0, "part": part})
        elif self.kind == "message":
            self.emit(
                "response.output_text.done", {**where, "content_index": 0, "text": self.text, "logprobs": []}
            )
            self.emit(
                "response.content_part.done", {**where, "content_index": 0, "part": _output_text(self.text)}
            )
        elif item["type"] == "function_call":
            done = {**where, "name": item["name"], "arguments": self.text}
            self.emit("response.function_call_arguments.done", done)
        else:
            self.emit("response.custom_tool_call_input.delta", {**where, "delta": item["input"]})
            self.emit("response.custom_tool_call_input.done", {**where, "input": item["input"]})
        self.emit("response.output_item.done", {"output_index": len(self.done), "item": item})
        self.done.append(item)
        self.kind = None

    def feed(self, delta: DeltaMessage) -> list[str]:
        if delta.reasoning:
            if self.kind != "reasoning":
                self._open("reasoning")
            self._extend(delta.reasoning)
        if delta.content:
            self._content(delta.content)
        for call in delta.tool_calls:
            function = call.function
            if self.kind != "call" or self.call is None or self.call[0] != call.index:
                name = (function.name if function is not None else None) or ""
                self._open("call", (call.index, call.id or "", name))
            if function is not None and function.arguments:
                self._extend(function.arguments)
        out, self.out = self.out, []
        return out

    def _content(self, text: str) -> None:
        """Content opens a message item once it is more than whitespace (as the whole reply
        has one only then); the whitespace before is its text's start."""
        if self.kind == "message":
            self._extend(text)
            return
        held = self.blank + text
        if held.strip():
            self._open("message")
            self._extend(held)
        else:
            self.blank = held

    def start(self) -> list[str]:
        self.emit("response.created", {"response": self.response})
        self.emit("response.in_progress", {"response": self.response})
        out, self.out = self.out, []
        return out

    def end(self, reply: RecordedReply, last: DeltaMessage | None) -> list[str]:
        """The last events: what the parsers released at the end, the open item closed, and
        the whole response."""
        lines = self.feed(last) if last is not None else []
        self.close(response_status(reply))
        session_id = self.response["session_id"]
        final = encode_response(self.shape, reply, session_id)
        self.emit(f"response.{final['status']}", {"response": final})
        out, self.out = self.out, []
        return [*lines, *out]

    def failed(self, error: MoltError) -> str:
        error_body = {"code": error.type, "message": error.message}
        self.emit("response.failed", {"response": {**self.response, "status": "failed", "error": error_body}})
        out, self.out = self.out, []
        return "".join(out)


def _replayed(shape: ReplyShape, item: Replayed) -> list[str]:
    reply = item.reply
    items = Items(shape, _base(shape, reply.completion_id, reply.created, reply.model, item.session_id))
    lines = items.start()
    for delta in _whole(reply.message):
        lines += items.feed(delta)
    return lines + items.end(reply, None)


def _lines(shape: ReplyShape, items: Items | None, event: StreamEvent) -> tuple[Items | None, list[str]]:
    """One turn event's lines, and the stream's items (opened by `Opened`)."""
    if isinstance(event, Replayed):
        return items, _replayed(shape, event)
    if isinstance(event, Opened):
        items = Items(shape, _base(shape, event.completion_id, event.created, event.model, event.session_id))
        return items, items.start()
    if items is None:
        return None, []
    if isinstance(event, Delta):
        return items, items.feed(event.delta)
    return items, items.end(event.reply, event.last)


@dataclass(slots=True)
class _Events:
    """The Responses API's events of one streamed turn (`encode_response_stream`)."""

    shape: ReplyShape
    items: Items | None = None

    def lines(self, event: StreamEvent) -> list[str]:
        self.items, lines = _lines(self.shape, self.items, event)
        return lines

    def failed(self, error: MoltError) -> list[str]:
        return [self.items.failed(error)] if self.items is not None else []


def encode_response_stream(shape: ReplyShape, events: AsyncGenerator[StreamEvent]) -> AsyncGenerator[str]:
    """A streamed turn as the Responses API's events; a failure after the first event,
    `response.failed` (`wire.sse.encoded`). Closing this closes `events`, and with them the
    turn."""
    return encoded(events, _Events(shape))
