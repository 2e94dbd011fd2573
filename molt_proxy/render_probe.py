"""Windows over an earlier render (`rendering.py`): what rendering a request's new messages by
a window adds to the earlier render, the checks every window must pass, and whether a chat
template may be rendered by windows at all, probed per tools and template kwargs on a battery
of small conversations.

A window over `messages` (extending an earlier request `messages[:m]`) renders the head (up to
the first user message), a context of a few messages before `m` (from one that follows an
assistant message) and the new messages, and keeps what the new messages add; `rendering.py`
has the reasoning, and `window` the checks.

The probe: each script is a conversation in letters (below); at each seam, where a request ends
and the next one's new messages begin (an assistant reply, then the tool results or user message
after it), the next request is rendered whole and by a window over the earlier render, with and
without a generation prompt (the request, and the echo view's history), and a retry of the
earlier request (nothing new) as well. A kind of request gets windows only if every case of
its kind that a window took agreed byte for byte, and at least one did.

The scripts hold what templates are known to treat by position: tool results grouped after an
assistant message (Qwen3), a system message in the middle, parallel calls (Llama-3.2 refuses
them: such a case says nothing), histories without a system message; and the *featured*
messages (reasoning, or the tokenizer's special strings in the text) that Qwen3 renders by
where the last user message is. Rewrites of earlier turns are tried where a window leaves the
rewritten turn out: `SUAUTPPPAU` (a plain call, then a user message: templates that hide
earlier turns, as gpt-oss's drops their analysis) and `SUQPQPTPTPRU` (reasoning turns, then a
user message that drops their `<think>`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from molt_proxy.errors import BadRequest
from molt_proxy.tokenizer import Tokenizer

Messages = list[dict[str, Any]]

CONTEXT = 2
"""At least this many messages before the new ones go into a window: a message may render
after its neighbour's role (Qwen3 opens a group of tool results only after a non-tool)."""
_REACH = 8
"""How much further back a window's context may start (to start after an assistant message),
and how long an earlier window's context is reused before a new one is anchored."""


class Render(Protocol):
    """`Tokenizer.render`: the chat template's render of a conversation."""

    def __call__(
        self,
        messages: Messages,
        tools: list[dict[str, Any]] | None,
        kwargs: dict[str, Any],
        /,
        *,
        add_generation_prompt: bool = True,
    ) -> str: ...


@dataclass(slots=True, frozen=True)
class Window:
    """A window over some messages, for the next window over them to start from: the head
    (`messages[:head]`) rendered alone, and with the messages from `start` on and a generation
    prompt (`text`), as the render of those messages ends."""

    head: int
    alone: str
    start: int
    text: str


def window(
    render: Render,
    text: str,
    m: int,
    messages: Messages,
    tools: list[dict[str, Any]] | None,
    kwargs: dict[str, Any],
    add_generation_prompt: bool,
    leave_out: int,
    earlier: Window | None = None,
) -> tuple[str, Window] | None:
    """What rendering `messages` adds to `text`, the render of `messages[:m]` with a
    generation prompt, by a window, and the window; None where no window applies or one of its
    checks fails: the head must render alone as the start of both `text` and the window's
    render, the window's rest (context and generation prompt) must be exactly how `text` ends
    (a date that changed, a template that counts messages, fail here), and the window without
    the new messages must be a prefix of the window with them (an appended message that
    rewrites the context fails here). A window leaves at least `leave_out` messages out.
    `earlier`: a window over `messages[:m]`, whose renders this one reuses while its context
    is short. Callers check the probe first (`Windows.allow`)."""
    head = _head_end(messages)
    if head is None or messages[-1].get("role") == "assistant":
        return None
    start: int | None
    try:
        if earlier is not None and earlier.head == head and m - earlier.start <= CONTEXT + _REACH:
            alone, start, old = earlier.alone, earlier.start, earlier.text
        else:
            start = _context(messages, m, head, leave_out)
            if start is None:
                return None
            alone = (
                earlier.alone
                if earlier is not None and earlier.head == head
                else render(messages[:head], tools, kwargs, add_generation_prompt=False)
            )
            old = render(messages[:head] + messages[start:m], tools, kwargs)
        new = render(
            messages[:head] + messages[start:], tools, kwargs, add_generation_prompt=add_generation_prompt
        )
    except BadRequest:  # the whole render says whether, and how, the template refuses
        return None
    checked = (
        old.startswith(alone)
        and text.startswith(alone)
        and len(text) >= len(old)
        and text.endswith(old[len(alone) :])
        and new.startswith(old)
    )
    return (new[len(old) :], Window(head, alone, start, new)) if checked else None


def _head_end(messages: Messages) -> int | None:
    """One past the first user message: templates write the system prompt, the tools and
    (Llama-3.2's, with tools) the first user message into a head of their own."""
    return next((i + 1 for i, message in enumerate(messages) if message.get("role") == "user"), None)


def _context(messages: Messages, m: int, head: int, leave_out: int) -> int | None:
    """Where a window's context starts: at least `CONTEXT` messages before `m`, at a message that
    follows an assistant message (where templates start a group of messages), after the head
    with at least `leave_out` messages left out; None: no such message in reach."""
    latest = m - CONTEXT
    for start in range(latest, max(head + leave_out - 1, latest - _REACH), -1):
        if messages[start - 1].get("role") == "assistant" and messages[start].get("role") != "assistant":
            return start
    return None


class Featured:
    """Which messages carry reasoning or one of the tokenizer's special strings: what templates
    such as Qwen3's render differently by where the message stands, so a window over them is
    a kind of request of its own (`Windows`)."""

    def __init__(self, added_tokens: frozenset[str]):
        specials = sorted(added_tokens, key=len, reverse=True)
        self._special = re.compile("|".join(map(re.escape, specials))) if specials else None

    def message(self, message: dict[str, Any]) -> bool:
        if message.get("reasoning_content") is not None or message.get("reasoning") is not None:
            return True
        special = self._special
        return special is not None and any(special.search(s) for s in _strings(message))

    def any(self, messages: Messages) -> bool:
        return any(map(self.message, messages))


def _strings(value: Any) -> Iterator[str]:
    """Every string inside a message, keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield str(key)
            yield from _strings(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _strings(item)


# -- the probe -------------------------------------------------------------------------------

_SCRIPTS = (
    "SUAUAUAUAUAU",
    "SUAUTPPPAUTPPPAU",
    "SUTPTPDPPTPAUTPAU",
    "UAUAYUAUTPAUAU",
    "UTPTPTPTPAU",
    "SURURURURU",
    "SUQPQPTPTPRU",
    "SUTPTPTPTPQPRU",
    "SUTPKUTPWPAUTPTPAU",
)
"""S system, U user, A assistant, T assistant calling a tool, D calling two, P a tool result,
Y a system message later on; featured: R assistant with reasoning, Q calling a tool with
reasoning, K assistant whose text holds special strings, W a user message that does."""
_SEAMS_PER_SCRIPT = 2
"""The last seams of each script, where a window leaves messages out."""


@dataclass(slots=True, frozen=True)
class Windows:
    """The kinds of request for which a template's probe found the window right."""

    plain: bool
    """Requests whose messages carry no reasoning and no special string."""
    new_featured: bool
    """Requests whose new messages do (a reply with reasoning), the earlier ones not."""
    featured: bool
    """Requests with such messages anywhere."""

    def allow(self, old_featured: bool, new_featured: bool) -> bool:
        if old_featured:
            return self.featured
        return self.new_featured if new_featured else self.plain


def probe(tokenizer: Tokenizer, tools: list[dict[str, Any]] | None, kwargs: dict[str, Any]) -> Windows:
    """Run the battery; a kind is allowed windows where all its cases agreed (see the module)."""
    render = _Memo(tokenizer).render  # the cases of a script share most of their renders
    featured = Featured(tokenizer.added_tokens)
    make = _maker(tokenizer.added_tokens)
    outcomes: dict[str, list[bool]] = {"plain": [], "new": [], "old": []}
    for script in _SCRIPTS:
        messages = [make(letter, i) for i, letter in enumerate(script)]
        for m, e in _seams(script)[-_SEAMS_PER_SCRIPT:]:
            old = featured.any(messages[:m])
            kind = "old" if old else "new" if featured.any(messages[m:e]) else "plain"
            outcomes[kind] += _case(render, messages, m, e, tools, kwargs)
    plain = bool(outcomes["plain"]) and all(outcomes["plain"])
    new = plain and bool(outcomes["new"]) and all(outcomes["new"])
    return Windows(plain, new, new and bool(outcomes["old"]) and all(outcomes["old"]))


def _case(
    render: Render,
    messages: Messages,
    m: int,
    e: int,
    tools: list[dict[str, Any]] | None,
    kwargs: dict[str, Any],
) -> list[bool]:
    """Whether each window that applies at this seam agrees with the whole render: the next
    request, its history without a generation prompt, and a retry of the earlier request."""
    try:
        earlier = render(messages[:m], tools, kwargs)
        wholes = [
            (messages[:e], True, render(messages[:e], tools, kwargs)),
            (messages[:e], False, render(messages[:e], tools, kwargs, add_generation_prompt=False)),
            (messages[:m], True, earlier),
        ]
    except BadRequest:  # a conversation this template refuses says nothing
        return []
    agreed = []
    for request, generation_prompt, whole in wholes:
        found = window(render, earlier, m, request, tools, kwargs, generation_prompt, leave_out=1)
        if found is not None and (request is not wholes[-1][0] or earlier + found[0] != whole):
            agreed.append(earlier + found[0] == whole)  # a retry that agrees is no evidence
    return agreed


class _Memo:
    """The tokenizer's renders, each rendered once: the cases of a script share most of theirs."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._done: dict[tuple[str, bool], str | BadRequest] = {}

    def render(
        self,
        messages: Messages,
        tools: list[dict[str, Any]] | None,
        kwargs: dict[str, Any],
        *,
        add_generation_prompt: bool = True,
    ) -> str:
        key = (json.dumps(messages), add_generation_prompt)
        if key not in self._done:
            try:
                self._done[key] = self.tokenizer.render(
                    messages, tools, kwargs, add_generation_prompt=add_generation_prompt
                )
            except BadRequest as exc:
                self._done[key] = exc
        done = self._done[key]
        if isinstance(done, BadRequest):
            raise done
        return done


def _seams(script: str) -> list[tuple[int, int]]:
    """(m, e): the earlier request is the first m messages, the next the first e: a reply at m,
    then the messages up to the next assistant one."""
    seams = []
    for m in range(1, len(script)):
        e = m + 1
        while e < len(script) and script[e] not in "ATDRQK":
            e += 1
        if script[m] in "ATDRQK" and script[m - 1] not in "ATDRQK" and e > m + 1:
            seams.append((m, e))
    return seams


def _maker(added: frozenset[str]) -> Callable[[str, int], dict[str, Any]]:
    """The message for a script letter at position i. Special strings come in the tokenizer's
    own tag pairs (`<think>`/`</think>`), else its first special token."""
    pairs = sorted(t for t in added if t.startswith("<") and not t.startswith("</") and f"</{t[1:]}" in added)
    first = min(added, default="")
    opening, closing = (pairs[0], f"</{pairs[0][1:]}") if pairs else (first, first)
    wrap_open, wrap_close = (pairs[-1], f"</{pairs[-1][1:]}") if pairs else (first, first)

    def call(i: int, n: int) -> dict[str, Any]:
        arguments = f'{{"n": {i}, "k": {n}}}'
        return {
            "id": f"call-{i}-{n}",
            "type": "function",
            "function": {"name": "probe", "arguments": arguments},
        }

    def make(letter: str, i: int) -> dict[str, Any]:
        calls = {"T": 1, "Q": 1, "D": 2}.get(letter, 0)
        message: dict[str, Any] = {
            "S": {"role": "system", "content": "probe system"},
            "Y": {"role": "system", "content": f"note {i}"},
            "U": {"role": "user", "content": f"question {i}"},
            "W": {"role": "user", "content": f"{wrap_open}\nresult {i}\n{wrap_close}"},
            "P": {"role": "tool", "tool_call_id": f"call-{i - 1}-0", "content": f"result {i}"},
            "K": {"role": "assistant", "content": f"{opening}\nthought {i}\n{closing}\n\nanswer {i}"},
        }.get(letter) or {"role": "assistant", "content": None if calls else f"answer {i}"}
        if calls:
            message["tool_calls"] = [call(i, n) for n in range(calls)]
        if letter in "RQ":
            message["reasoning_content"] = f"thought {i}"
        return message

    return make
