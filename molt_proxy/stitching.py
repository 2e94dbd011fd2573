"""Token accounting: continue one of a session's chains or open a new one (DESIGN §2).

A session holds several chains (segments), all open: a request continues the one whose bytes
its render extends furthest, or opens a new one when it extends none (a rewritten history,
a sub-agent with a system prompt of its own); the others stay as they are and may be
continued later. Pure: no I/O, no locks. A turn matches its render against the chains once,
when it is admitted (`match`: the chains it continues, which its claim then keeps as they
are), plans on that match before generation (`plan_match`) and commits (`commit_to`) only
after generation succeeded, so a failed or retried request never double-appends. Which chain
a turn joins is decided once, by its plan, and becomes a segment index (`segment_index`) that
the live turn and a restart's replay both commit to.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from molt_proxy.types import NOT_SAMPLED, EchoView, Generation, Sampling, Segment, Turn


class TokenText(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def ids_bytes(self, ids: list[int]) -> bytes: ...


@dataclass(slots=True, frozen=True)
class PromptPlan:
    """The exact ids to send for one request and how they join the record."""

    ids: Sequence[int]
    """Full prompt sent to vLLM: a continued chain's packed ids and the new ones (an `array`
    of int32, which `upstream.py` encodes without a Python int per id: a list of the whole
    prompt each turn was most of the stitch's cost at 30k tokens), else the render's ids."""
    new_ids: list[int]
    """Ids this request appends before the completion (mask 0)."""
    new_text: bytes
    """The exact bytes of `new_ids`, computed with the plan (in the worker thread that plans a
    large request) rather than at commit time on the event loop."""
    segment: int | None
    """The index of the chain the turn continues; None: the render extends no chain (a
    rewritten history, another system prompt, a first turn) and the turn opens a new segment
    from the full render."""

    @property
    def continues(self) -> bool:
        return self.segment is not None


def continued_length(segment: Segment | None, rendered: bytes) -> int | None:
    """How many bytes of `rendered` the segment stands for, when `rendered` continues it: it
    starts with the segment's exact bytes, or with its echo view (each reply as the proxy
    returned it, `echo.py`, less what the template leaves out of the history), whose bytes map
    back to the same ids. None: it does not."""
    if segment is None or not segment.turns:
        return None
    if rendered.startswith(segment.text):
        return len(segment.text)
    if segment.echo is not None and rendered.startswith(segment.echo):
        return len(segment.echo)
    return None


@dataclass(slots=True, frozen=True)
class Match:
    """A render against a session's chains (`match`): the ones it continues, the furthest
    first, each with the number of bytes of `rendered` it stands for (`continued_length`);
    among equal lengths the newest chain first."""

    rendered: bytes
    chains: list[tuple[int, Segment]]
    indices: frozenset[int]
    """The chains a turn on this render appends to one of: what its claim holds."""
    furthest: int | None
    """How many bytes the furthest chain stands for; None: the render continues none."""


def match(segments: Sequence[Segment], rendered: bytes) -> Match:
    found = [(n, s) for s in segments if (n := continued_length(s, rendered)) is not None]
    chains = sorted(found, key=lambda m: (m[0], m[1].index), reverse=True)
    indices = frozenset(segment.index for _, segment in chains)
    return Match(rendered, chains, indices, chains[0][0] if chains else None)


def plan_prompt(segments: Sequence[Segment], rendered: str, tokenizer: TokenText) -> PromptPlan:
    """`plan_match` on the chains `segments` that `rendered` continues."""
    return plan_match(match(segments, rendered.encode()), rendered, tokenizer)


def plan_match(matched: Match, rendered: str, tokenizer: TokenText) -> PromptPlan:
    """Continue the chain the render extends furthest (`matched.rendered` is `rendered`'s
    bytes): the prompt is that segment's ids and the rest of the render tokenized; if it
    extends none, open a new one.

    Bytes, not str: a segment may end inside a multi-byte character (a length cut), and
    decode would hide that. A suffix that does not start on a character boundary cannot be
    tokenized on its own, so that chain is not continued (a shorter one may be).
    """
    full = matched.rendered
    for length, segment in matched.chains:
        try:
            suffix = full[length:].decode()
        except UnicodeDecodeError:
            continue
        new_ids = tokenizer.encode(suffix) if suffix else []
        prompt = segment.token_ids + array("i", new_ids)
        return PromptPlan(prompt, new_ids, tokenizer.ids_bytes(new_ids), segment.index)
    ids = tokenizer.encode(rendered)
    return PromptPlan(ids, ids, tokenizer.ids_bytes(ids), None)


def segment_index(segments: Sequence[Segment], plan: PromptPlan) -> int:
    """The index of the segment a planned turn joins: the chain it continues, else a new one
    after the last (indices are 0, 1, ... in the order chains opened). The one place the plan
    becomes a record; a stored turn keeps the index, so a restart replays the same choice."""
    if plan.segment is not None:
        return plan.segment
    return segments[-1].index + 1 if segments else 0


def commit_to(
    segments: list[Segment],
    index: int,
    new_ids: list[int],
    new_text: bytes,
    generation: Generation,
    completion_id: str,
    tokenizer: TokenText,
    sampling: Sampling | None = None,
    echo: EchoView | None = None,
) -> Turn:
    """Append a turn to the segment `index` of `segments`, or to a new one opened after the
    others when there is none yet. Serves a live turn and a replayed stored one alike."""
    segment = next((s for s in segments if s.index == index), None)
    if segment is None:
        segment = Segment(index=index)
        segments.append(segment)
    return _append(segment, new_ids, new_text, generation, completion_id, tokenizer, sampling, echo)


def commit_turn(
    segment: Segment,
    plan: PromptPlan,
    generation: Generation,
    completion_id: str,
    tokenizer: TokenText,
    sampling: Sampling | None = None,
    echo: EchoView | None = None,
) -> Turn:
    """Append the planned turn to `segment`: the chain it continues when `plan.continues`,
    else a fresh empty one."""
    return _append(segment, plan.new_ids, plan.new_text, generation, completion_id, tokenizer, sampling, echo)


def _append(
    segment: Segment,
    new_ids: list[int],
    new_text: bytes,
    generation: Generation,
    completion_id: str,
    tokenizer: TokenText,
    sampling: Sampling | None,
    echo: EchoView | None,
) -> Turn:
    """The request's new prompt ids (mask 0), then the sampled ids (mask 1). `sampling` is
    what vLLM sampled the ids with, kept on the turn; `echo`, the reply's echo view (None:
    its sampled bytes), extends the segment's echo bytes in place of the sampled bytes, and
    of the end of the prompt it stands for too."""
    prompt_start = len(segment.token_ids)
    segment.token_ids.extend(new_ids)
    segment.add_run(len(new_ids), NOT_SAMPLED)
    completion_start = len(segment.token_ids)
    segment.token_ids.extend(generation.token_ids)
    segment.sampled_logprobs.extend(generation.logprobs)
    segment.add_versions(generation.weight_versions)
    sampled = tokenizer.ids_bytes(generation.token_ids)
    if echo is not None and segment.echo is None:
        segment.echo = segment.text
    if segment.echo is not None:
        if echo is None:
            segment.echo += new_text + sampled
        else:
            segment.echo += new_text.removesuffix(echo.dropped) + echo.view
    segment.text += new_text + sampled
    turn = Turn(
        completion_id=completion_id,
        prompt_start=prompt_start,
        completion_start=completion_start,
        completion_end=len(segment.token_ids),
        finish_reason=generation.finish_reason,
        created=time.time(),
        sampling=sampling,
        constrained=generation.constrained,
    )
    segment.turns.append(turn)
    return turn
