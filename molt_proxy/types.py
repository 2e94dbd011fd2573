"""The data contract of molt-proxy: turns, segments and trajectories.

Imports nothing from the package. Every list in a segment is aligned 1:1 with `token_ids`;
shapes are written as `[T]` for the segment length.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any

# A prompt token was not sampled by any policy; its weight version says so.
NOT_SAMPLED = -1


class SessionStatus(enum.StrEnum):
    OPEN = "open"
    REWARDED = "rewarded"
    UNREWARDED = "unrewarded"  # closed by TTL or shutdown without a final reward


@dataclass(slots=True)
class Turn:
    """One completion inside a segment; offsets index the segment's `token_ids`."""

    completion_id: str
    prompt_start: int
    """Index of the first token this request appended (its new prompt suffix)."""
    completion_start: int
    """Index of the first sampled token."""
    completion_end: int
    """One past the last sampled token."""
    finish_reason: str
    created: float = 0.0
    reward: float | None = None
    """A per-turn reward (`POST /v1/rewards` with this completion id and `final: false`)."""


@dataclass(slots=True)
class Segment:
    """The exact token record of one unbroken stretch of a conversation."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    """[T] every id the model saw or sampled, in order."""
    loss_mask: list[int] = field(default_factory=list)
    """[T] 1 where the policy sampled the token, 0 for prompt tokens."""
    logprobs: list[float] = field(default_factory=list)
    """[T] rollout logprob of each sampled token (processed distribution); 0.0 where mask is 0."""
    weight_versions: list[int] = field(default_factory=list)
    """[T] weight version that sampled each token; NOT_SAMPLED (-1) where mask is 0."""
    turns: list[Turn] = field(default_factory=list)
    text: bytes = b""
    """The bytes `token_ids` decode to: the prefix a continuing request must start with."""

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class Trajectory:
    """A finalized segment with its session's reward: what the trainer reads.

    The JSON form (`to_json`) is the schema documented in the README, used by the HTTP
    stream, the exports and the trainer alike.
    """

    seq: int
    trajectory_id: str
    session_id: str
    segment: int
    group_id: str
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    turns: list[Turn]
    reward: float | None
    info: dict[str, Any]
    status: SessionStatus
    model: str
    created: float

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["status"] = self.status.value
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Trajectory:
        fields = dict(data)
        fields["turns"] = [Turn(**t) for t in data["turns"]]
        fields["status"] = SessionStatus(data["status"])
        return cls(**fields)


@dataclass(slots=True)
class Generation:
    """What vLLM sampled for one prompt (upstream's typed result)."""

    token_ids: list[int]
    """[N] sampled ids, the stop token included when the model emitted it."""
    logprobs: list[float]
    """[N] logprob of each sampled id under the processed sampling distribution."""
    weight_versions: list[int]
    """[N] weight version that sampled each id."""
    finish_reason: str
    prompt_token_ids: list[int] | None = None
    """The prompt ids vLLM reports it received, when it reports them."""
