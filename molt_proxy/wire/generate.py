"""vLLM's answers on its token-in/token-out generate route, read: sampled ids, their logprobs,
the most likely alternatives and per-token weight versions (`upstream.py` speaks the HTTP).
Kept apart as the other wire formats are: pure functions of vLLM's JSON, tested without a server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from molt_proxy.errors import UpstreamError
from molt_proxy.types import Generation

# vLLM labels the weights it booted with "default"; later versions are set by the proxy as
# integers (`/update_weight_version`), so "default" is version 0.
_INITIAL_VERSION = "default"


def parse_versions(spans: list[dict[str, Any]] | None, n: int) -> list[int]:
    """Expand vLLM's `[{version, start, end}]` spans into one int per sampled token.

    Every sampled token must be covered. A token without a version is an `UpstreamError`,
    not a guess: labelled 0 it would look stale (withheld, or trained as old policy), labelled
    anything else it could look fresh. vLLM's generate route covers every token it samples, so
    a gap means the upstream changed and the record cannot be trusted.
    """
    versions: list[int | None] = [None] * n
    for span in spans or []:
        label = span["version"]
        if label == _INITIAL_VERSION:
            version = 0
        elif str(label).isdigit():
            version = int(label)
        else:
            raise UpstreamError(f"vLLM reported a non-integer weight version {label!r}")
        if not 0 <= span["start"] <= span["end"] <= n:
            raise UpstreamError(f"vLLM reported a weight-version span {span} outside {n} sampled tokens")
        versions[span["start"] : span["end"]] = [version] * (span["end"] - span["start"])
    missing = [i for i, version in enumerate(versions) if version is None]
    if missing:
        raise UpstreamError(
            f"vLLM reported no weight version for {len(missing)} of {n} sampled tokens (first: {missing[0]})"
        )
    return [version for version in versions if version is not None]


def parse_tokens(choice: dict[str, Any]) -> tuple[list[int], list[float]]:
    """The sampled ids of one choice (or one streamed chunk of it) and their logprobs."""
    ids = choice.get("token_ids") or []
    content = (choice.get("logprobs") or {}).get("content") or []
    logprobs = [entry.get("logprob") for entry in content]
    if len(logprobs) != len(ids) or not all(isinstance(lp, int | float) for lp in logprobs):
        raise UpstreamError("vLLM returned no logprob for some sampled tokens")
    return list(ids), logprobs


def top_asked(sampling: dict[str, Any]) -> dict[str, Any]:
    """The sampling fields as sent to vLLM: `logprobs` k > 0 (an agent's `top_logprobs`) asks
    for k + 1. vLLM lists the sampled id first, then the most likely ones, and cuts the list at
    the count asked: a sampled id outside the top k would push the k-th out of a list of k."""
    k = sampling.get("logprobs") or 0
    return {**sampling, "logprobs": k + 1} if k else sampling


def parse_top(choice: dict[str, Any], k: int) -> list[list[tuple[int, float]]]:
    """The k most likely ids at each sampled position, most likely first, from vLLM's lists of
    k + 1 (`top_asked`); candidates of equal logprob keep vLLM's order."""
    content = (choice.get("logprobs") or {}).get("content") or []
    top = []
    for entry in content:
        candidates = [(c["token_id"], c["logprob"]) for c in entry.get("top_logprobs") or []]
        if not candidates:
            raise UpstreamError("vLLM returned no top logprobs for a sampled token")
        top.append(sorted(candidates, key=lambda c: -c[1])[:k])
    return top


def parse_generation(body: dict[str, Any], top: int) -> Generation:
    """vLLM's whole (not streamed) answer to one generate request; `top`: the k most likely
    ids asked for at each position (0: none)."""
    choice = body["choices"][0]
    ids, logprobs = parse_tokens(choice)
    return Generation(
        token_ids=ids,
        logprobs=logprobs,
        weight_versions=parse_versions(choice.get("weight_versions"), len(ids)),
        finish_reason=choice.get("finish_reason") or "stop",
        prompt_token_ids=body.get("prompt_token_ids"),
        top_logprobs=parse_top(choice, top) if top else None,
    )


@dataclass(slots=True, frozen=True)
class TokenDelta:
    """Ids vLLM sampled since the previous streamed chunk, with their logprobs."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """As `Generation.top_logprobs`, for these ids."""
    prompt_token_ids: list[int] | None = None
    """The prompt ids vLLM read, on the first delta of a stream that asked for them
    (`return_token_ids`: vLLM echoes them on its first chunk only); None on the others."""
