"""Incremental chat-template rendering: a turn renders what is new, not the whole history.

Every request of a conversation carries its whole history, and the chat template renders it
in time linear in its length (16 ms a turn at 200 turns, and once more for the reply's echo
view). Templates are mostly message-local: a message renders from itself, its neighbours and
the head of the conversation (the system prompt, the tools, Llama-3.2's date and first user
message), not from messages far before it. Where that holds, a request `P + N` that extends
an earlier one `P` (the previous turn's request, its messages equal) renders as `P`'s render
followed by what a *window* adds: the head `A` (up to the first user message), the context `C`
(a few messages before `N`, from one that follows an assistant message), then `N`:

    render(P + N) = render(P) + (render(A + C + N) - render(A + C))

Nothing of that is assumed; a window is used only where it is checked:
- once per (tools, template kwargs), `render_probe.probe` renders a battery of conversations
  both ways and allows windows for the kinds of request whose every case agreed byte for byte.
  Messages with reasoning or the tokenizer's special strings are kinds of their own: Qwen3's
  template drops the `<think>` of earlier turns when a user message follows (where they are
  in the history, not only in the new messages, no window is used for it);
- per request (`render_probe.window`), the head must render alone as the start of both the
  earlier render and the window's, the window's rest (context and generation prompt) must be
  exactly how the earlier render ends (a date that changed, a template that counts messages,
  fail here), and the window without `N` must be a prefix of the window with it (an appended
  message that rewrites the context fails here).
Anything else, an error included, renders the whole history, as before.

Renders are cached by content, not by session (a request is rendered before its session is
known: the render finds it), and each entry gives way to the one that extends it.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import chain, islice
from typing import Any, TypeVar

from molt_proxy.errors import BadRequest
from molt_proxy.render_probe import Featured, Messages, Window, Windows, probe, window
from molt_proxy.tokenizer import Tokenizer

Probed = TypeVar("Probed")

LEAVE_OUT = 16
"""A window leaves at least this many messages out, or the whole history is rendered: below
that, one render of it costs less than a window's."""
_PROBES = 256
"""The (tools, kwargs) whose probe result is kept; the oldest goes first."""
_PROBE_REPLY = "molt-probe-reply"
"""The text of the reply `Renders.dropped` probes with, to find where the reply's text starts."""
_CACHE_CHARS = 64 * 2**20
"""The rendered characters the cache keeps (the messages they were rendered from come beside
them, about as large): the least recently used go first."""


@dataclass(slots=True)
class _Entry:
    """One render: the messages, tools and kwargs it was rendered from, with the generation
    prompt; whether any message carries reasoning or a special string; the template's windows;
    the window it was rendered by, if one."""

    messages: Messages
    tools: list[dict[str, Any]] | None
    kwargs: dict[str, Any]
    text: str
    featured: bool
    windows: Windows
    window: Window | None
    nested: list[int]
    """The indices of the messages with a value other than a string or None (tool calls):
    where `==` is not enough (JSON's `1`, `1.0` and `true` are equal in Python, and key order
    is not compared)."""
    keys: tuple[str, ...]
    """Every message's keys in order, one after another (`_keys`): key order is not compared
    by `==`, and a template may print a message's items in it. Kept with the entry, and
    extended from its parent's, so that a request's check builds only its own."""
    dropped: str | None = None
    """`Renders.dropped` for its tools and kwargs, once asked (the next turns' renders keep it)."""


class Renders:
    """The chat template's renders of one tokenizer, incremental where a window is checked."""

    def __init__(self, tokenizer: Tokenizer, leave_out: int = LEAVE_OUT):
        self.tokenizer = tokenizer
        self.leave_out = leave_out
        """The fewest messages a window leaves out (`LEAVE_OUT`; the probe's scripts are short)."""
        self.windowed = 0
        """How many renders a window served (the rest rendered the whole history)."""
        self._entries: OrderedDict[tuple[int, str], _Entry] = OrderedDict()
        self._chars = 0
        self._windows: dict[str, Windows] = {}
        self._dropped: dict[str, str] = {}
        self._lock = threading.Lock()
        """Large requests render in worker threads beside the event loop's."""
        self.featured = Featured(tokenizer.added_tokens)

    def render(self, messages: Messages, tools: list[dict[str, Any]] | None, kwargs: dict[str, Any]) -> str:
        """`Tokenizer.render(messages, tools, kwargs)`: the earlier render it extends and a
        window where one is checked, else the whole history. The cache keeps `messages` (the
        list itself: `after` finds its render by it), which must not change afterwards."""
        parent = self._parent(messages, tools, kwargs)
        text, made = None, None
        if parent is None:
            nested, keys = _nested(messages, 0), _keys(messages, 0, len(messages))
            windows, featured = self.windows(tools, kwargs), self.featured.any(messages)
        else:
            m = len(parent.messages)
            nested, keys = (
                parent.nested + _nested(messages, m),
                parent.keys + _keys(messages, m, len(messages)),
            )
            windows, new = parent.windows, self.featured.any(messages[m:])
            featured = parent.featured or new
            if windows.allow(parent.featured, new):
                found = window(
                    self.tokenizer.render,
                    parent.text,
                    m,
                    messages,
                    tools,
                    kwargs,
                    True,
                    self.leave_out,
                    parent.window,
                )
                if found is not None:
                    text, made = parent.text + found[0], found[1]
                    self.windowed += 1
        if text is None:
            text = self.tokenizer.render(messages, tools, kwargs)
        entry = _Entry(messages, tools, kwargs, text, featured, windows, made, nested, keys)
        entry.dropped = None if parent is None else parent.dropped
        self._remember(entry, parent)
        return text

    def after(
        self,
        messages: Messages,
        tools: list[dict[str, Any]] | None,
        kwargs: dict[str, Any],
        text: str,
        more: Messages,
        dropped: str = "",
    ) -> str | None:
        """What `render(messages + more)` without a generation prompt adds to `text`, the render
        of `messages` with one, less `dropped`: the end of its generation prompt that the
        history leaves out (`Renders.dropped`). None where it does not start with `text` less
        that. The echo view's. A window serves only `dropped == ""`: the probe checks no other."""
        entry = self._entries.get(_key(messages, len(messages)))
        if entry is not None and entry.messages is messages:
            windows, featured, earlier = entry.windows, entry.featured, entry.window
        else:
            windows, featured, earlier = self.windows(tools, kwargs), self.featured.any(messages), None
        whole = messages + more
        if not dropped and windows.allow(featured, self.featured.any(more)):
            found = window(
                self.tokenizer.render,
                text,
                len(messages),
                whole,
                tools,
                kwargs,
                False,
                self.leave_out,
                earlier,
            )
            if found is not None:
                self.windowed += 1
                return found[0]
        rendered = self.tokenizer.render(whole, tools, kwargs, add_generation_prompt=False)
        kept = text[: len(text) - len(dropped)]
        return rendered[len(kept) :] if text.endswith(dropped) and rendered.startswith(kept) else None

    def dropped(
        self, tools: list[dict[str, Any]] | None, kwargs: dict[str, Any], messages: Messages | None = None
    ) -> str:
        """The end of the generation prompt that the template leaves out where it renders the
        reply as history (Qwen3's empty `<think>\\n\\n</think>\\n\\n` with `enable_thinking`
        false), probed once per tools and kwargs on a one-message conversation: what the
        generation prompt adds past the header the history shows before a reply's text.
        `messages`: a request `render` rendered with them, whose cached render keeps the answer
        for the conversation's next turns (the per-turn echo view then skips the probe's key)."""
        entry = None if messages is None else self._entries.get(_key(messages, len(messages)))
        if entry is None or entry.messages is not messages:
            return self._probed(self._dropped, tools, kwargs, _dropped)
        if entry.dropped is None:
            entry.dropped = self._probed(self._dropped, tools, kwargs, _dropped)
        return entry.dropped

    def windows(self, tools: list[dict[str, Any]] | None, kwargs: dict[str, Any]) -> Windows:
        """The template's windows with these tools and kwargs, probed once (about 90 small
        renders: tens of milliseconds, on the first request with them)."""
        return self._probed(self._windows, tools, kwargs, probe)

    def _probed(
        self,
        cache: dict[str, Probed],
        tools: list[dict[str, Any]] | None,
        kwargs: dict[str, Any],
        make: Callable[[Tokenizer, list[dict[str, Any]] | None, dict[str, Any]], Probed],
    ) -> Probed:
        """A probe of the template with these tools and kwargs: from `cache`, else `make`s."""
        key = json.dumps([tools, kwargs], sort_keys=True, default=str)
        found = cache.get(key)
        if found is None:
            found = make(self.tokenizer, tools, kwargs)
            with self._lock:
                cache[key] = found
                if len(cache) > _PROBES:
                    del cache[next(iter(cache))]
        return found

    def _parent(
        self, messages: Messages, tools: list[dict[str, Any]] | None, kwargs: dict[str, Any]
    ) -> _Entry | None:
        """The cached render whose messages begin `messages`: the request itself (a retry, or
        one of a group's identical first requests), else the one before its last assistant
        messages (the previous turn's request)."""
        for m in _seams(messages):
            entry = self._entries.get(_key(messages, m))
            if (
                entry is not None
                and repr(entry.kwargs) == repr(kwargs)
                and entry.tools == tools  # the head, rendered again by every window, shows them
                and entry.messages == messages[:m]
                and entry.keys == _keys(messages, 0, m)  # key order, once `==` found the same keys
                and all(repr(entry.messages[i]) == repr(messages[i]) for i in entry.nested)
            ):
                return entry
        return None

    def _remember(self, entry: _Entry, parent: _Entry | None) -> None:
        key = _key(entry.messages, len(entry.messages))
        with self._lock:
            if parent is not None:
                self._drop(_key(parent.messages, len(parent.messages)))
            self._drop(key)
            self._entries[key] = entry
            self._chars += len(entry.text)
            while self._chars > _CACHE_CHARS and len(self._entries) > 1:
                self._drop(next(iter(self._entries)))

    def _drop(self, key: tuple[int, str]) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._chars -= len(entry.text)


def _dropped(tokenizer: Tokenizer, tools: list[dict[str, Any]] | None, kwargs: dict[str, Any]) -> str:
    """`Renders.dropped`, probed: "" where the template refuses the probe or shows the reply
    otherwise than after a part of the generation prompt."""
    asked: Messages = [{"role": "user", "content": "u"}]
    reply = {"role": "assistant", "content": _PROBE_REPLY}
    try:
        base = tokenizer.render(asked, tools, kwargs, add_generation_prompt=False)
        prompt = tokenizer.render(asked, tools, kwargs)
        history = tokenizer.render([*asked, reply, *asked], tools, kwargs, add_generation_prompt=False)
    except BadRequest:
        return ""
    shown = history[len(base) :]
    if not (prompt.startswith(base) and history.startswith(base) and _PROBE_REPLY in shown):
        return ""
    header, generation_prompt = shown[: shown.index(_PROBE_REPLY)], prompt[len(base) :]
    return generation_prompt[len(header) :] if generation_prompt.startswith(header) else ""


def _key(messages: Messages, m: int) -> tuple[int, str]:
    """Where the render of `messages[:m]` is cached: its length and its last message."""
    return m, json.dumps(messages[m - 1], sort_keys=True, default=str) if m else ""


def _nested(messages: Messages, start: int) -> list[int]:
    """The indices from `start` on of the messages with a value other than a string or None."""
    return [
        i
        for i in range(start, len(messages))
        if any(type(v) is not str and v is not None for v in messages[i].values())
    ]


def _keys(messages: Messages, start: int, end: int) -> tuple[str, ...]:
    """The keys of `messages[start:end]` in order, one message's after another's: where each
    message has the same keys as another list's (`==`), equal tuples mean the same order."""
    return tuple(chain.from_iterable(islice(messages, start, end)))


def _seams(messages: Messages) -> Iterator[int]:
    """The lengths of the earlier requests `messages` may extend: itself, then up to each of
    its last two assistant messages (a reply and the tool results or user message after it)."""
    yield len(messages)
    found = 0
    for i in range(len(messages) - 1, 0, -1):
        if messages[i].get("role") == "assistant":
            yield i
            found += 1
            if found == 2:
                return
