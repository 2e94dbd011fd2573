"""Echo restoration (DESIGN §2): an agent's history is meaning, not bytes.

Agents re-serialise what they echo: pydantic-ai compacts tool arguments, Claude Code sorts
their keys, some trim content; and some replies cannot be echoed as sampled at all (a stop
string cut off mid-token, a stop id the reply leaves out, a length cut inside a character).
The proxy knows what it returned for every turn, so it restores in two steps, both of which
only ever replace something by what it returned, never by anything the agent did not mean:

1. Message level, before rendering (`restore`): an echoed assistant message that carries a
   tool-call id the proxy minted (or, without calls, content equal to a reply's up to
   surrounding whitespace, or where both are blank, reasoning) is found among what the proxy
   returned, and each field that means the same (arguments that parse to the same JSON
   value, text equal up to surrounding whitespace) gets the returned value back.
2. Byte level, after sampling (`echo_view`): the bytes the template renders for the reply as
   returned, kept where they differ from the sampled bytes, so that a render that shows the
   returned reply continues the segment over the sampled ids (`stitching.plan_prompt`). The
   view also stands for a part of the generation prompt that the template writes only before
   a reply it samples, not before one in the history (Qwen3's empty `<think>` block with
   thinking off): the model keeps the prompt ids it saw.

A real rewrite (another value, a dropped field) is not restored, renders differently and
opens a new segment, as before. Rendering the returned reply also covers templates that
print arguments with `tojson` (Llama-3.2's) as well as those that print the sampled string
(Qwen3's).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from molt_proxy.errors import BadRequest
from molt_proxy.parsing import arguments_object, sampled_json_text
from molt_proxy.rendering import Renders
from molt_proxy.types import EchoView, ParsedReply

Find = Callable[[str], ParsedReply | None]
"""A lookup key (`call_key`, `text_key`) → what the proxy returned under it, or None."""

_FOLLOW = "\u2063molt-echo\u2063"
"""The text of the message a probe render puts after the reply, to find where the reply ends."""


def call_key(call_id: str) -> str:
    return f"call:{call_id}"


def text_key(content: str, kind: str = "text") -> str:
    return f"{kind}:{content.strip()}"


def keys_of(reply: ParsedReply) -> list[str]:
    """The keys an echo of `reply` is found by: its tool-call ids; a reply without calls, by
    its text (`_text_keys`)."""
    if reply.tool_calls:
        return [call_key(call["id"]) for call in reply.tool_calls if isinstance(call.get("id"), str)]
    return _text_keys(reply.content, reply.reasoning_content)


def _text_keys(content: Any, reasoning: Any) -> list[str]:
    """A message without calls is named by its content, or, where that is only whitespace, by
    its reasoning (an Anthropic reply shows no whitespace-only text block); whitespace alone
    names nothing."""
    if isinstance(content, str) and content.strip():
        return [text_key(content)]
    return [text_key(reasoning, "thinking")] if isinstance(reasoning, str) and reasoning.strip() else []


class Returned:
    """What the proxy returned for every turn of the open sessions, by the keys echoes name it
    by. Every segment of a session counts: a segment opened from a restored render is
    continued only by renders restored alike."""

    def __init__(self) -> None:
        self._by_key: dict[str, dict[str, ParsedReply]] = {}
        """Key → session id → the reply, the latest last."""
        self._keys: dict[str, list[str]] = {}

    def add(self, session_id: str, reply: ParsedReply) -> None:
        keys = keys_of(reply)
        for key in keys:
            replies = self._by_key.setdefault(key, {})
            replies.pop(session_id, None)
            replies[session_id] = reply
        self._keys.setdefault(session_id, []).extend(keys)

    def forget(self, session_id: str) -> None:
        for key in self._keys.pop(session_id, []):
            replies = self._by_key.get(key, {})
            replies.pop(session_id, None)
            if not replies:
                self._by_key.pop(key, None)

    def of_session(self, session_id: str) -> Find:
        return lambda key: self._by_key.get(key, {}).get(session_id)

    def among(self, accept: Callable[[str], bool]) -> Find:
        """A lookup in the sessions `accept` admits, the latest reply first. A large request
        looks up in a worker thread while the loop records turns: it reads a snapshot."""

        def find(key: str) -> ParsedReply | None:
            for session_id, reply in reversed(tuple(self._by_key.get(key, {}).items())):
                if accept(session_id):
                    return reply
            return None

        return find


def restore(messages: list[dict[str, Any]], find: Find) -> list[dict[str, Any]]:
    """`messages` with each echoed assistant message's fields that mean what the proxy returned
    replaced by what it returned (a new list; the agent's dicts are not touched)."""
    return [_restore(m, find) if m.get("role") == "assistant" else m for m in messages]


def _restore(message: dict[str, Any], find: Find) -> dict[str, Any]:
    calls = [c for c in message.get("tool_calls") or [] if isinstance(c, dict)]
    ids = [c["id"] for c in calls if isinstance(c.get("id"), str)]
    reply = next((r for r in map(find, map(call_key, ids)) if r is not None), None)
    if reply is None and not calls:
        named = _text_keys(message.get("content"), message.get("reasoning_content"))
        reply = find(named[0]) if named else None
    if reply is None:
        return message
    restored = dict(message)
    if _same_text(message.get("content"), reply.content):
        restored["content"] = reply.content
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str) and _same_text(reasoning, reply.reasoning_content):
        restored["reasoning_content"] = reply.reasoning_content
    if calls:
        restored["tool_calls"] = [_restore_call(call, reply) for call in calls]
    return restored


def _restore_call(call: dict[str, Any], reply: ParsedReply) -> dict[str, Any]:
    returned = next((c for c in reply.tool_calls if c.get("id") == call.get("id")), None)
    function = call.get("function")
    if returned is None or not isinstance(function, dict):
        return call
    arguments = returned["function"]["arguments"]
    if not _same_arguments(function.get("arguments"), arguments):
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def _same_text(echoed: str | None, returned: str | None) -> bool:
    """Equal up to surrounding whitespace (no content and empty content are the same)."""
    return (echoed or "").strip() == (returned or "").strip()


def _same_arguments(echoed: Any, returned: str) -> bool:
    """Whether echoed arguments (a JSON string, or an object as some agents send) parse to the
    same JSON value as the returned string."""
    try:
        value = json.loads(returned)
    except json.JSONDecodeError:  # a call cut off by max_tokens: an object is its complete part
        return echoed == returned or (
            isinstance(echoed, dict) and same_json(echoed, arguments_object(returned))
        )
    if isinstance(echoed, str):
        try:
            echoed = json.loads(echoed)
        except json.JSONDecodeError:
            return False
    return same_json(echoed, value)


def same_json(a: Any, b: Any) -> bool:
    """JSON value equality: numbers by value (`1` and `1.0` alike, as JavaScript writes them),
    but `true` is not `1`, and objects by keys whatever their order."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(same_json, a, b))
    if _is_number(a) and _is_number(b):
        return a == b
    return type(a) is type(b) and a == b


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(slots=True, frozen=True)
class Rendered:
    """A request as the chat template rendered it: the prompt text `F` and what it was rendered
    from (the restored messages), which the reply's echo view is rendered against."""

    text: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    template_kwargs: dict[str, Any]


def echo_view(
    renders: Renders, rendered: Rendered, reply: ParsedReply, sampled: bytes, ends_turn: bool
) -> EchoView | None:
    """The bytes the template renders for `reply` as returned, where they differ from the
    `sampled` bytes (None where they do not, or where the template does not show the reply);
    with the end of the generation prompt that the history leaves out, where it leaves one
    out (`EchoView.dropped`).

    The reply is rendered after the request and before what agents send next (its tool
    results, or a user message), as the next request renders it (`Renders.after`: a window
    over the request's render where one is checked). It ends where its sampled ids end: a
    sampled stop id (`ends_turn`) stands for the template's end-of-turn token, so the view
    keeps that token and what the template adds past it (Qwen3's `\\n`) is the next request's;
    a reply cut by a stop string or by length ends with its text, and the template's whole
    closing is the next request's. A view that does not show all the reply says (a template
    dropping earlier reasoning) is no view: that history is rewritten. A template that writes
    a part of the generation prompt only there (Qwen3's empty `<think>` block with thinking
    off, `Renders.dropped`) shows the reply without it: the view stands for that part too, so
    the model's next prompt keeps the ids it saw.
    """
    closing = renders.tokenizer.closing
    if closing is None:
        return None
    follow: list[dict[str, Any]] = [
        {"role": "tool", "tool_call_id": call["id"], "content": _FOLLOW} for call in reply.tool_calls
    ] or [{"role": "user", "content": _FOLLOW}]
    try:
        found = _history(renders, rendered, [reply.as_message(), *follow])
    except BadRequest:
        return None
    if found is None or _FOLLOW not in found[1]:
        return None
    dropped, added = found
    tail = added[: added.index(_FOLLOW)]
    end = tail.rfind(closing.end + closing.after)
    if end == -1:
        return None
    view = tail[:end] + (closing.end if ends_turn else "")
    if not _shows(view, reply):
        return None
    encoded = view.encode()
    if dropped:
        return EchoView(encoded, dropped.encode())
    return None if encoded == sampled else EchoView(encoded)


def _history(renders: Renders, rendered: Rendered, more: list[dict[str, Any]]) -> tuple[str, str] | None:
    """What the history `rendered.messages + more` adds to the request's render (`Renders.after`),
    past the end of the generation prompt it leaves out where the template leaves one out, and
    that end ("" mostly); None where it extends neither."""
    tools, kwargs = rendered.tools, rendered.template_kwargs
    dropped = renders.dropped(tools, kwargs, rendered.messages)
    for tail in (dropped, "") if dropped and rendered.text.endswith(dropped) else ("",):
        added = renders.after(rendered.messages, tools, kwargs, rendered.text, more, tail)
        if added is not None:
            return tail, added
    return None


def _shows(view: str, reply: ParsedReply) -> bool:
    """Whether `view` shows everything `reply` says: its text (trimmed), each call's name and
    arguments (as any JSON text of the same value)."""
    parts = [text.strip() for text in (reply.content, reply.reasoning_content) if text]
    for call in reply.tool_calls:
        function = call["function"]
        parts.append(function["name"])
        try:
            value = json.loads(function["arguments"])
        except json.JSONDecodeError:
            parts.append(function["arguments"])
            continue
        if isinstance(value, dict) and value and sampled_json_text(view, value) is None:
            return False
    return all(part in view for part in parts)
