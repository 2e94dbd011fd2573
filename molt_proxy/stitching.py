"""Token accounting: continue the open segment or start a new one (DESIGN §2).

Pure: no I/O, no locks. The session layer calls `plan_prompt` before generation and
`commit_to` only after generation succeeded, so a failed or retried request never
double-appends. Continue-or-seal is decided once, by `plan_prompt`, and becomes a segment
index (`segment_index`) that the live turn and a restart's replay both commit to.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from molt_proxy.types import NOT_SAMPLED, Generation, Sampling, Segment, Turn


class TokenText(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def ids_bytes(self, ids: list[int]) -> bytes: ...


@dataclass(slots=True, frozen=True)
class PromptPlan:
    """The exact ids to send for one request and how they join the record."""

    ids: list[int]
    """Full prompt sent to vLLM."""
    new_ids: list[int]
    """Ids this request appends before the completion (mask 0)."""
    new_text: bytes
    """The exact bytes of `new_ids`, computed with the plan (in the worker thread that plans a
    large request) rather than at commit time on the event loop."""
    continues: bool
    """True: appended to the open segment. False: the history was rewritten (or there is no
    open segment) and the turn opens a new segment from the full render."""


def continued_length(segment: Segment | None, rendered: bytes) -> int | None:
    """How many bytes of `rendered` the segment stands for, when `rendered` continues it: it
    starts with the segment's exact bytes, or with its echo view (each reply as the proxy
    returned it, `echo.py`), whose bytes map back to the same sampled ids. None: it does not."""
    if segment is None or not segment.turns:
        return None
    if rendered.startswith(segment.text):
        return len(segment.text)
    if segment.echo is not None and rendered.startswith(segment.echo):
        return len(segment.echo)
    return None


def plan_prompt(segment: Segment | None, rendered: str, tokenizer: TokenText) -> PromptPlan:
    """Continue `segment` when the render starts with its bytes (`continued_length`): the
    prompt is the segment's ids and the rest of the render tokenized; otherwise start over.

    Bytes, not str: a segment may end inside a multi-byte character (a length cut), and
    decode would hide that. A suffix that does not start on a character boundary cannot be
    tokenized on its own, so it starts a new segment too.
    """
    full = rendered.encode()
    matched = continued_length(segment, full)
    if segment is not None and matched is not None:
        try:
            suffix = full[matched:].decode()
        except UnicodeDecodeError:
            suffix = None
        if suffix is not None:
            new_ids = tokenizer.encode(suffix) if suffix else []
            return PromptPlan(segment.token_ids + new_ids, new_ids, tokenizer.ids_bytes(new_ids), True)
    ids = tokenizer.encode(rendered)
    return PromptPlan(ids, ids, tokenizer.ids_bytes(ids), False)


def segment_index(open_segment: Segment | None, plan: PromptPlan) -> int:
    """The index of the segment a planned turn joins: the open one if the plan continues it,
    else the next (the turn seals the open segment). The one place `continues` becomes a
    record; a stored turn keeps the index, so a restart replays the same choice."""
    if open_segment is None:
        return 0
    return open_segment.index if plan.continues else open_segment.index + 1


def commit_to(
    segments: list[Segment],
    index: int,
    new_ids: list[int],
    new_text: bytes,
    generation: Generation,
    completion_id: str,
    tokenizer: TokenText,
    sampling: Sampling | None = None,
    echo: bytes | None = None,
) -> Turn:
    """Append a turn to the segment `index` of `segments`: the last one when it has that
    index, else a new one opened after it. Serves a live turn and a replayed stored one alike."""
    if not segments or segments[-1].index != index:
        segments.append(Segment(index=index))
    return _append(segments[-1], new_ids, new_text, generation, completion_id, tokenizer, sampling, echo)


def commit_turn(
    segment: Segment,
    plan: PromptPlan,
    generation: Generation,
    completion_id: str,
    tokenizer: TokenText,
    sampling: Sampling | None = None,
    echo: bytes | None = None,
) -> Turn:
    """Append the planned turn to `segment`: the open segment when `plan.continues`, else a
    fresh empty one."""
    return _append(segment, plan.new_ids, plan.new_text, generation, completion_id, tokenizer, sampling, echo)


def _append(
    segment: Segment,
    new_ids: list[int],
    new_text: bytes,
    generation: Generation,
    completion_id: str,
    tokenizer: TokenText,
    sampling: Sampling | None,
    echo: bytes | None,
) -> Turn:
    """The request's new prompt ids (mask 0), then the sampled ids (mask 1). `sampling` is
    what vLLM sampled the ids with, kept on the turn; `echo`, the reply's echo view where it
    differs from the sampled bytes, extends the segment's echo bytes."""
    prompt_start = len(segment.token_ids)
    segment.token_ids += new_ids
    segment.loss_mask += [0] * len(new_ids)
    segment.logprobs += [0.0] * len(new_ids)
    segment.weight_versions += [NOT_SAMPLED] * len(new_ids)
    completion_start = len(segment.token_ids)
    segment.token_ids += generation.token_ids
    segment.loss_mask += [1] * len(generation.token_ids)
    segment.logprobs += generation.logprobs
    segment.weight_versions += generation.weight_versions
    sampled = tokenizer.ids_bytes(generation.token_ids)
    if echo is not None and segment.echo is None:
        segment.echo = segment.text
    if segment.echo is not None:
        segment.echo += new_text + (sampled if echo is None else echo)
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
