"""Capture quality, pure: does what a system recorded equal what vLLM saw and sampled?

`bench/peers.py` plays the same episodes through molt-proxy and its peers, with a recording
tap (`bench/tap.py`) between each and vLLM. The tap's calls are the ground truth; each
system's record is turned into `Trace`s (molt-proxy: one per segment; a per-call tracer: one
per call) and `judge` compares the two. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Call:
    """One generation call as vLLM saw it (the tap's record)."""

    prompt_ids: list[int]
    """[P] the prompt ids vLLM was given."""
    sampled_ids: list[int]
    """[S] the ids it sampled."""
    logprobs: list[float]
    """[S] their logprobs as vLLM returned them."""


@dataclass(frozen=True, slots=True)
class Trace:
    """One token sequence a system keeps for training: a segment, or one call's trace."""

    ids: list[int]
    """[T] token ids."""
    sampled: list[bool]
    """[T] True where the system marks the id as sampled by the policy (its loss mask)."""
    logprobs: list[float] | None = None
    """[T] the rollout logprob at each sampled position (others ignored); None: none kept."""
    versions: list[object] | None = None
    """[T] the weight version at each sampled position; None: none kept."""


@dataclass(frozen=True, slots=True)
class Verdict:
    ids_exact: bool
    """Every call's prompt + sampled ids are the start of a trace, its sampled ids marked as
    sampled there, and no other position of any trace is marked sampled."""
    traces: int
    logprobs: str
    """"exact" (equal to vLLM's within the tolerance), "absent", or "differ (max Δ …)"."""
    versions: bool
    """A weight version at every sampled position."""
    chains: int = 0
    """How many token sequences the calls make when each call that extends the one before
    (its prompt starts with that call's prompt and sampled ids) is merged into it: 1 when the
    upstream saw one growing sequence, more where the history vLLM rendered differs from what
    it had sampled (a trainer of per-call traces then cannot merge them into one)."""
    why: str = ""
    """What broke `ids_exact`, for the report."""


def judge(calls: Sequence[Call], traces: Sequence[Trace], tolerance: float = 1e-6) -> Verdict:
    """Compare a system's traces of one episode with the calls vLLM served for it."""
    covered: list[set[int]] = [set() for _ in traces]
    matches: list[tuple[Call, int, int]] = []  # call, trace index, where its sampled ids start
    why = ""
    for n, call in enumerate(calls):
        start, end = len(call.prompt_ids), len(call.prompt_ids) + len(call.sampled_ids)
        whole = call.prompt_ids + call.sampled_ids
        found = next(
            (
                t
                for t, trace in enumerate(traces)
                if trace.ids[:end] == whole and all(trace.sampled[start:end])
            ),
            None,
        )
        if found is None:
            why = why or f"call {n + 1}: no trace starts with its prompt and sampled ids"
            continue
        covered[found] |= set(range(start, end))
        matches.append((call, found, start))
    for t, trace in enumerate(traces):
        marked = {i for i, flag in enumerate(trace.sampled) if flag}
        if marked != covered[t] and not why:
            why = f"trace {t + 1}: {len(marked ^ covered[t])} positions marked sampled wrongly"
    exact = bool(calls) and not why and len(matches) == len(calls)
    logprobs = "absent" if not matches else "exact"
    worst = 0.0
    for call, t, start in matches:
        kept = traces[t].logprobs
        if (
            kept is None
            or len(kept) < start + len(call.logprobs)
            or len(call.logprobs) != len(call.sampled_ids)
        ):
            logprobs = "absent"
            break
        for i, value in enumerate(call.logprobs):
            worst = max(worst, abs(kept[start + i] - value))
    if logprobs == "exact" and worst > tolerance:
        logprobs = f"differ (max Δ {worst:.2g})"
    versions = bool(matches) and all(
        _versions_kept(traces[t], start, len(c.sampled_ids)) for c, t, start in matches
    )
    return Verdict(exact, len(traces), logprobs, versions, chains(calls), why)


def chains(calls: Sequence[Call]) -> int:
    """See `Verdict.chains`."""
    count, before = 0, None
    for call in calls:
        if before is None or call.prompt_ids[: len(before)] != before:
            count += 1
        before = call.prompt_ids + call.sampled_ids
    return count


def _versions_kept(trace: Trace, start: int, count: int) -> bool:
    kept = trace.versions
    return (
        kept is not None
        and len(kept) >= start + count
        and all(v is not None for v in kept[start : start + count])
    )


def per_call(prompt_ids: list[int], completion_ids: list[int], logprobs: list[float] | None) -> Trace:
    """The trace of a per-call record (rLLM's gateway, Agent Lightning's spans): the prompt,
    then the completion marked sampled, its logprobs if the record kept any."""
    ids = prompt_ids + completion_ids
    sampled = [False] * len(prompt_ids) + [True] * len(completion_ids)
    kept = [0.0] * len(prompt_ids) + list(logprobs) if logprobs else None
    return Trace(ids, sampled, kept, None)
