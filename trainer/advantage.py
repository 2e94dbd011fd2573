"""Advantage estimators: one scalar reward per trajectory in, one advantage per trajectory out.

Owns only the arithmetic over a group of rewards (the trajectories that share a `group_id`,
i.e. several attempts at the same task). It does not decide which trajectories form a group,
skip unrewarded ones or spread advantages over tokens; the caller and the loss do that.

A group of one gets advantage 0 from every group-relative estimator (GRPO, Dr.GRPO, RLOO):
with nothing to compare against there is no signal. Use `reinforce` or `reinforce_baseline`
when rollouts are not grouped. A flat group, whose rewards are equal within `FLAT_RTOL` of
their scale, gets exactly 0 too. Every estimator is finite for any finite rewards (section 1).

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
import sys
from collections.abc import Sequence

FLAT_RTOL = 1e-9
"""Rewards equal within this share of their largest magnitude are equal: a group whose
max - min <= FLAT_RTOL * max |r| is flat, and every group-relative estimator gives each of
its trajectories exactly 0. Float64 arithmetic leaves rewards that should be equal a few ulps
(~1e-16 relative) apart (a mean of [0.7] * 8 is not 0.7; per-turn returns summed in another
order differ in their last bit), and such noise, divided by a std of the same noise or
handed to Adam, which normalises the gradient away, made a full-size step out of nothing
(issue 26: advantages of 1e-11, weights moved 6.7e-4). 1e-9 is far above that noise and far
below any difference a reward means to make. `reinforce_baseline` treats r within it of b
alike."""

_MAX = sys.float_info.max


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


# 1. Finite arithmetic on any finite rewards ----------------------------------------------------
#
# A reward may be any finite float (the proxy bounds them to +-1e6 by default, `--reward-range`,
# but an offline export or another proxy may not). Squares of 1e155 raise OverflowError, sums of
# 1e308 are inf and inf - inf is nan; so the group arithmetic runs on the rewards divided by a
# power of two 2^e at least max |r| (`_exponent`): every scaled value is in [-1, 1], no square or
# sum can overflow, and the division is exact (but for rewards 2^1022 times smaller than the
# largest, which lose bits they could not matter by), so ordinary rewards give the plain
# formulas' values up to the last bit. A result that is a difference of rewards (Dr.GRPO, RLOO,
# r - b, a return) may truly exceed the largest float (1e308 - (-1e308)); it saturates at
# +-1.8e308 (`bounded`), keeping its sign. GRPO's advantages are at most (n - 1) / sqrt(n).


def bounded(value: float) -> float:
    """`value` clamped to the finite floats: inf (an overflowed sum or difference of finite
    numbers) becomes +-sys.float_info.max; nan is not expected here and is refused."""
    if math.isnan(value):
        raise ValueError("nan where only finite numbers or an overflow can be")
    return max(-_MAX, min(_MAX, value))


def is_flat(rewards: Sequence[float], rtol: float = FLAT_RTOL) -> bool:
    """Whether `rewards` (finite) are all equal within `rtol` of their largest magnitude
    (`FLAT_RTOL`); an empty or one-reward group is flat."""
    if len(rewards) < 2:
        return True
    spread = max(rewards) - min(rewards)  # inf when it overflows: then not flat
    return spread <= rtol * max(abs(r) for r in rewards)


def _exponent(values: Sequence[float]) -> int:
    """e with max |v| <= 2^e: dividing by 2^e brings every value into [-1, 1], exactly."""
    return math.frexp(max(abs(v) for v in values))[1]


def _unscaled(value: float, exponent: int) -> float:
    """value * 2^exponent, saturated at +-sys.float_info.max."""
    try:
        return math.ldexp(value, exponent)
    except OverflowError:
        return math.copysign(_MAX, value)


def _mean(values: Sequence[float]) -> float:
    """The mean of finite values, finite: the correctly rounded sum (`fsum`) of the scaled values, / n."""
    e = _exponent(values)
    return _unscaled(math.fsum(math.ldexp(v, -e) for v in values) / len(values), e)


def _difference(a: float, b: float, rtol: float = FLAT_RTOL) -> float:
    """a - b, saturated; exactly 0 when a and b are equal within `rtol` of the larger."""
    if is_flat([a, b], rtol):
        return 0.0
    return bounded(a - b)


# 2. The estimators -----------------------------------------------------------------------------


def compute_advantages(
    rewards: Sequence[float],
    estimator: Estimator | str,
    *,
    baseline: float = 0.0,
    eps: float = 1e-6,
) -> list[float]:
    """Advantages for one group, in the order of `rewards`; finite for any finite rewards.

    rewards: [G] one finite reward per trajectory of the group.
    estimator: an `Estimator` or its name (as written in a config file).
    baseline: the running baseline b, read only by `reinforce_baseline`. Pass the value from
        *before* this group is folded in, so that b does not depend on the rewards it is
        subtracted from (which would bias the gradient).
    eps: keeps GRPO finite when all rewards are equal (std 0, advantages 0).

    GRPO divides by the sample std (n - 1), as `torch.std` does in TRL and verl, so that our
    numbers match runs made with them; for a group of one that std is undefined and we use 0.
    A flat group (`is_flat`: rewards equal within `FLAT_RTOL` of their scale) gets exactly 0
    from GRPO, Dr.GRPO and RLOO, never the rounding noise of its mean.
    """
    estimator = Estimator(estimator)
    if not rewards:
        raise ValueError("a group needs at least one reward")
    if not all(math.isfinite(r) for r in rewards):
        raise ValueError(f"rewards must be finite, got {list(rewards)}")
    n = len(rewards)
    if estimator is Estimator.REINFORCE:
        return [float(r) for r in rewards]
    if estimator is Estimator.REINFORCE_BASELINE:
        return [_difference(r, baseline) for r in rewards]
    if is_flat(rewards):  # a group of one too
        return [0.0] * n
    e = _exponent(rewards)
    scaled = [math.ldexp(r, -e) for r in rewards]  # in [-1, 1]
    total = math.fsum(scaled)
    if estimator is Estimator.RLOO:
        return [_unscaled(x - (total - x) / (n - 1), e) for x in scaled]
    deviations = [x - total / n for x in scaled]  # in [-2, 2]
    if estimator is Estimator.DR_GRPO:
        return [_unscaled(d, e) for d in deviations]
    # GRPO: (r - mean) / (std + eps) = d / (std of the scaled rewards + eps / 2^e)
    std = math.sqrt(math.fsum(d * d for d in deviations) / (n - 1))
    shift = _unscaled(eps, -e)
    if shift == _MAX:  # rewards of ~1e-300 and below: std is nothing beside eps, A = d 2^e / eps
        return [bounded(_unscaled(d / eps, e)) for d in deviations]
    return [d / (std + shift) for d in deviations]


def update_baseline(baseline: float | None, rewards: Sequence[float], decay: float) -> float:
    """Fold a group's mean reward into the running baseline of `reinforce_baseline`.

    An exponential moving average (as the moving-average baseline of Ahmadian et al., 2024,
    "Back to Basics"): b <- decay * b + (1 - decay) * mean(rewards). `None` means no group
    has been seen yet; the first group's mean seeds it. The trainer keeps b in its checkpoint.
    Finite for finite rewards (the mean of [1e308, 1e308] is 1e308, not inf).
    """
    if not rewards:
        raise ValueError("a group needs at least one reward")
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"decay must be in [0, 1), got {decay}")
    mean = _mean(rewards)
    if baseline is None:
        return mean
    return bounded(decay * baseline + (1.0 - decay) * mean)


def turn_returns(turn_rewards: Sequence[float | None], final_reward: float, discount: float) -> list[float]:
    """G_k, the discounted reward-to-go of each turn (formula above); None rewards count 0.

    Computed on the rewards scaled as the estimators scale them (section 1), so a sum of
    rewards near the largest float saturates only where the true return exceeds it.
    """
    if not 0.0 <= discount <= 1.0:
        raise ValueError(f"discount must be in [0, 1], got {discount}")
    rewards = [r or 0.0 for r in turn_rewards]
    if not rewards:
        return []
    e = _exponent([*rewards, final_reward])
    # the final reward is added to the last turn's after scaling: their sum may exceed 1e308
    scaled = [math.ldexp(r, -e) for r in rewards]
    scaled[-1] += math.ldexp(final_reward, -e)
    returns, future = [], 0.0
    for reward in reversed(scaled):
        future = reward + discount * future  # at most len(rewards) + 1 in magnitude
        returns.append(_unscaled(future, e))
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
