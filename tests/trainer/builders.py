"""Small builders of the records the trainer reads: `Trajectory` objects, as the stream gives."""

from __future__ import annotations

from molt_proxy.types import NOT_SAMPLED, Sampling, SessionStatus, Trajectory, Turn


def trajectory(
    seq: int,
    session: str = "s",
    group: str = "g",
    reward: float | None = 1.0,
    *,
    segment: int = 0,
    num_segments: int = 1,
    token_ids: list[int] | None = None,
    prompt: int = 2,
    logprobs: list[float] | None = None,
    version: int = 0,
) -> Trajectory:
    """A trajectory of `prompt` prompt tokens then sampled ones (all sampled by `version`);
    `logprobs` are the sampled tokens' rollout logprobs (default -1.0 each)."""
    ids = token_ids if token_ids is not None else [1, 2, 3, 4]
    sampled = len(ids) - prompt
    rollout = logprobs if logprobs is not None else [-1.0] * sampled
    return Trajectory(
        seq=seq,
        trajectory_id=f"{session}:{segment}",
        session_id=session,
        segment=segment,
        num_segments=num_segments,
        group_id=group,
        token_ids=list(ids),
        loss_mask=[0] * prompt + [1] * sampled,
        logprobs=[0.0] * prompt + list(rollout),
        weight_versions=[NOT_SAMPLED] * prompt + [version] * sampled,
        turns=[Turn(f"c{seq}", 0, prompt, len(ids), "stop", sampling=Sampling())],
        reward=reward,
        info={},
        status=SessionStatus.REWARDED if reward is not None else SessionStatus.UNREWARDED,
        model="tiny",
        created=0.0,
    )


def session(first_seq: int, name: str, group: str, reward: float, segments: int) -> list[Trajectory]:
    """Every segment of one session, at consecutive seqs (as the store finalizes them)."""
    return [
        trajectory(first_seq + i, name, group, reward, segment=i, num_segments=segments)
        for i in range(segments)
    ]


def episodes(first_seq: int, name: str, rewards: tuple[float, float], version: int, logprob: float = -1.0):
    """A group `name` of two episodes that share their prompt and differ in every sampled token.
    Identical ones with opposite advantages have a gradient of exactly 0 (their shared tokens
    are computed once): only rounding noise, which Adam's first step would blow up to a full
    step of lr."""
    return [
        trajectory(
            first_seq + i,
            f"{name}-{i}",
            name,
            reward,
            token_ids=[1, 2, 3 + 2 * i, 4 + 2 * i],
            version=version,
            logprobs=[logprob, logprob],
        )
        for i, reward in enumerate(rewards)
    ]


def turns(
    seq: int, session: str, rewards: list[float | None], final: float, *, segment: int = 0, segments: int = 1
) -> Trajectory:
    """A segment of len(rewards) turns (per-turn rewards `rewards`), each one prompt token then
    two sampled ones: [p s s p s s ...]; turn k samples positions 3k+1 and 3k+2."""
    n = len(rewards)
    record = trajectory(seq, session, reward=final, segment=segment, num_segments=segments)
    record.token_ids = list(range(1, 3 * n + 1))
    record.loss_mask = [0, 1, 1] * n
    record.logprobs = [0.0, -1.0, -1.0] * n
    record.weight_versions = [NOT_SAMPLED, 0, 0] * n
    record.turns = [
        Turn(f"c{seq}-{k}", 3 * k, 3 * k + 1, 3 * k + 3, "stop", reward=r, sampling=Sampling())
        for k, r in enumerate(rewards)
    ]
    return record
