"""The built-in algorithms, registered as plug-ins exactly as a researcher's own would be
(`trainer/plugins.py` has the four plug points): read them as examples.

A group is every segment of every session of one task's attempts, whole: a session's
segments arrive together and in order, all carrying the session's reward (`reward` below is
what `--reward-shaping` and `--kl-in reward` made of it, `credit.shape`). The estimators'
arithmetic is `advantage.py`'s; here it meets the contract: one reward per session, the
result shared by the session's segments, or per turn along the session's turns.
"""

from __future__ import annotations

from molt_proxy.types import Trajectory
from trainer.advantage import Estimator, compute_advantages, turn_advantages, turn_returns
from trainer.advantage import is_flat as rewards_flat
from trainer.buffer import final_reward
from trainer.loss import clipped_surrogate
from trainer.plugins import register

# 1. Advantages: one per trajectory ------------------------------------------------------------


def by_session(group: list[Trajectory], estimator: Estimator, baseline: float = 0.0) -> list[float]:
    """The estimator over the group's sessions (one reward each, in order of first
    appearance: a session's segments are one attempt), shared by each session's segments."""
    rewards: dict[str, float] = {}
    for t in group:
        rewards.setdefault(t.session_id, final_reward(t))
    values = compute_advantages(list(rewards.values()), estimator, baseline=baseline)
    by_id = dict(zip(rewards, values, strict=True))
    return [by_id[t.session_id] for t in group]


@register("advantage", "grpo")
def grpo(group: list[Trajectory]) -> list[float]:
    """(R - mean) / (std + eps) over the group's sessions (Shao et al. 2024)."""
    return by_session(group, Estimator.GRPO)


@register("advantage", "dr_grpo")
def dr_grpo(group: list[Trajectory]) -> list[float]:
    """R - mean: without the std, which over-weights nearly solved or unsolved groups."""
    return by_session(group, Estimator.DR_GRPO)


@register("advantage", "rloo")
def rloo(group: list[Trajectory]) -> list[float]:
    """R - the mean of the other sessions' rewards."""
    return by_session(group, Estimator.RLOO)


@register("advantage", "reinforce")
def reinforce(group: list[Trajectory]) -> list[float]:
    """R itself: no baseline."""
    return by_session(group, Estimator.REINFORCE)


@register("advantage", "reinforce_baseline")
def reinforce_baseline(group: list[Trajectory], baseline: float = 0.0) -> list[float]:
    """R - b. b is a running mean over past steps, state the loop keeps in its checkpoint
    and binds here each step (`credit.builtin_advantage`), not something a group shows."""
    return by_session(group, Estimator.REINFORCE_BASELINE, baseline)


# 2. Advantages: one per turn ------------------------------------------------------------------


@register("advantage", "turn_credit")
def turn_credit(
    group: list[Trajectory], estimator: str = "grpo", discount: float = 1.0, baseline: float = 0.0
) -> list[list[float]]:
    """`--turn-discount`: each turn's discounted reward-to-go over its session's turns (all
    segments, in order; per-turn rewards, the final reward on the last turn), compared by the
    estimator with the same turn position of the group's other sessions (`advantage.py`)."""
    turns: dict[str, list[float]] = {}
    finals: dict[str, float] = {}
    for t in group:
        turns.setdefault(t.session_id, []).extend(turn.reward or 0.0 for turn in t.turns)
        finals[t.session_id] = final_reward(t)
    returns = [turn_returns(turns[s], finals[s], discount) for s in turns]
    per_session = dict(zip(turns, turn_advantages(returns, estimator, baseline=baseline), strict=True))
    out, taken = [], dict.fromkeys(turns, 0)
    for t in group:
        start = taken[t.session_id]
        out.append(per_session[t.session_id][start : start + len(t.turns)])
        taken[t.session_id] = start + len(t.turns)
    return out


# 3. Group filters -----------------------------------------------------------------------------


@register("group_filter", "drop_flat")
def drop_flat(group: list[Trajectory], by_turn: bool = False) -> bool:
    """`--drop-flat-groups`, DAPO's dynamic sampling: keep a group unless every session had
    the same outcome (final reward, and with `by_turn` the same per-turn rewards, turn by
    turn), which a group-relative estimator gives advantage 0 everywhere."""
    outcomes: dict[str, list[float]] = {}
    for t in group:
        outcome = outcomes.setdefault(t.session_id, [t.reward or 0.0])
        if by_turn:
            outcome += [turn.reward or 0.0 for turn in t.turns]
    if len({len(o) for o in outcomes.values()}) > 1:
        return True
    return not all(rewards_flat(position) for position in zip(*outcomes.values(), strict=True))


# 4. The loss ----------------------------------------------------------------------------------

register("loss", "ppo")(clipped_surrogate)
