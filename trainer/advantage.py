"""Advantage estimators: one scalar reward per trajectory in, one advantage per trajectory out.

Owns only the arithmetic over a group of rewards (the trajectories that share a `group_id`,
i.e. several attempts at the same task). It does not decide which trajectories form a group,
skip unrewarded ones or spread advantages over tokens; the caller and the loss do that.

A group of one gets advantage 0 from every group-relative estimator (GRPO, Dr.GRPO, RLOO):
with nothing to compare against there is no signal. Use `reinforce` or `reinforce_baseline`
when rollouts are not grouped.

Per-turn credit (`--turn-discount gamma`): an episode i of K_i turns (its segments in order,
each segment's turns in order) has per-turn rewards r_ik (`Turn.reward`, posted with the
turn's completion id and `final: false`; 0 where none was posted) and the final reward R_i,
which belongs to its last turn. Each turn's return is its discounted reward-to-go

    G_ik = sum_{j=k..K_i} gamma^(j-k) * (r_ij + [j = K_i] * R_i)

and its advantage is the estimator applied, per turn position k, to the returns G_.k of the
group's episodes that have a k-th turn:

    A_ik = estimator({G_jk : episodes j of the group with K_j >= k})_i

so a turn is compared with the same turn of the other attempts at the task. Every sampled
token of turn k gets A_ik. With gamma = 1 and no per-turn rewards every G_ik is R_i and the
first turn's advantage is the episode-level one; a turn position reached by only one episode
of the group gets 0 from the group-relative estimators, as a group of one does.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence


class Estimator(enum.StrEnum):
    GRPO = "grpo"
    """(r - mean) / (std + eps), std of the group with Bessel's correction."""
    DR_GRPO = "dr_grpo"
    """r - mean: GRPO without dividing by the std, which over-weights groups that are nearly
    all right or all wrong (Liu et al. 2025, "Understanding R1-Zero-Like Training")."""
    RLOO = "rloo"
    """r_i - mean of the other rewards of the group: a baseline independent of the sample."""
    REINFORCE = "reinforce"
    """r itself: no baseline, highest variance."""
    REINFORCE_BASELINE = "reinforce_baseline"
    """r - b, with b a running mean of past rewards kept by the caller (`update_baseline`)."""


def compute_advantages(
    rewards: Sequence[float],
    estimator: Estimator | str,
    *,
    baseline: float = 0.0,
    eps: float = 1e-6,
) -> list[float]:
    """Advantages for one group, in the order of `rewards`.

    rewards: [G] one finite reward per trajectory of the group.
    estimator: an `Estimator` or its name (as written in a config file).
    baseline: the running baseline b, read only by `reinforce_baseline`. Pass the value from
        *before* this group is folded in, so that b does not depend on the rewards it is
        subtracted from (which would bias the gradient).
    eps: keeps GRPO finite when all rewards are equal (std 0, advantages 0).

    GRPO divides by the sample std (n - 1), as `torch.std` does in TRL and verl, so that our
    numbers match runs made with them; for a group of one that std is undefined and we use 0.
    """
    estimator = Estimator(estimator)
    if not rewards:
        raise ValueError("a group needs at least one reward")
    if not all(math.isfinite(r) for r in rewards):
        raise ValueError(f"rewards must be finite, got {list(rewards)}")
    n = len(rewards)
    mean = sum(rewards) / n
    if estimator is Estimator.GRPO:
        var = sum((r - mean) ** 2 for r in rewards) / (n - 1) if n > 1 else 0.0
        return [(r - mean) / (math.sqrt(var) + eps) for r in rewards]
    if estimator is Estimator.DR_GRPO:
        return [r - mean for r in rewards]
    if estimator is Estimator.RLOO:
        if n == 1:
            return [0.0]
        total = sum(rewards)
        return [r - (total - r) / (n - 1) for r in rewards]
    if estimator is Estimator.REINFORCE:
        return [float(r) for r in rewards]
    return [r - baseline for r in rewards]  # Estimator.REINFORCE_BASELINE


def update_baseline(baseline: float | None, rewards: Sequence[float], decay: float) -> float:
    """Fold a group's mean reward into the running baseline of `reinforce_baseline`.

    An exponential moving average (as the moving-average baseline of Ahmadian et al., 2024,
    "Back to Basics"): b <- decay * b + (1 - decay) * mean(rewards). `None` means no group
    has been seen yet; the first group's mean seeds it. The trainer keeps b in its checkpoint.
    """
    if not rewards:
        raise ValueError("a group needs at least one reward")
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"decay must be in [0, 1), got {decay}")
    mean = sum(rewards) / len(rewards)
    if baseline is None:
        return mean
    return decay * baseline + (1.0 - decay) * mean


def turn_returns(turn_rewards: Sequence[float | None], final_reward: float, discount: float) -> list[float]:
    """G_k, the discounted reward-to-go of each turn (formula above); None rewards count 0."""
    if not 0.0 <= discount <= 1.0:
        raise ValueError(f"discount must be in [0, 1], got {discount}")
    rewards = [r or 0.0 for r in turn_rewards]
    if rewards:
        rewards[-1] += final_reward
    returns, future = [], 0.0
    for reward in reversed(rewards):
        future = reward + discount * future
        returns.append(future)
    return returns[::-1]


def turn_advantages(
    returns: Sequence[Sequence[float]], estimator: Estimator | str, *, baseline: float = 0.0
) -> list[list[float]]:
    """A_ik for one group: `returns` [episodes][turns] (episodes may have different numbers of
    turns); the estimator runs over each turn position's returns."""
    advantages: list[list[float]] = [[] for _ in returns]
    for k in range(max((len(r) for r in returns), default=0)):
        present = [i for i, r in enumerate(returns) if len(r) > k]
        values = compute_advantages([returns[i][k] for i in present], estimator, baseline=baseline)
        for i, value in zip(present, values, strict=True):
            advantages[i].append(value)
    return advantages
