"""What each trajectory's sampled tokens are credited with: the advantages of a step.

Owns the step from rewards to advantages: by default a session's reward (less a KL penalty
when `--kl-in reward`) is compared within its group by the estimator (`advantage.py`), and
every sampled token of every segment of the session shares the result. With
`--turn-discount`, each turn of a session gets its own advantage from per-turn returns
(`advantage.py` has the formula), shared by that turn's sampled tokens. It does not decide
which groups train (the loop) or weigh tokens in the loss (`loss.py`).

KL in the reward (`--kl-coef beta --kl-in reward`): a trajectory's penalty is beta times the
sum of k_t (`loss.kl_estimate`) over its sampled tokens, with pi there the sampler's mu (the
policy that drew them; no extra forward of the trained model) and ref the frozen reference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from molt_proxy.types import Trajectory
from trainer.advantage import (
    Estimator,
    bounded,
    compute_advantages,
    turn_advantages,
    turn_returns,
)
from trainer.advantage import is_flat as rewards_flat
from trainer.batch import Batch
from trainer.buffer import Group
from trainer.config import LossConfig
from trainer.loss import kl_estimate

if TYPE_CHECKING:
    from trainer.policy import Policy

_FLOAT32_MAX = torch.finfo(torch.float32).max


def group_advantages(
    groups: list[Group],
    estimator: Estimator,
    baseline: float | None,
    *,
    penalties: list[list[float]] | None = None,
) -> list[float]:
    """One advantage per trajectory (in the groups' order): computed over the group's sessions
    (one reward each, less the penalties of all its segments' turns) and shared by all
    segments of a session. penalties: [trajectories][turns], aligned with the groups'
    trajectories; None: none."""
    trajectories = [t for g in groups for t in g.trajectories]
    penalty = dict.fromkeys((t.seq for t in trajectories), 0.0)
    if penalties is not None:
        penalty = {t.seq: bounded(sum(p)) for t, p in zip(trajectories, penalties, strict=True)}
    advantages = []
    for group in groups:
        rewards: dict[str, float] = {}
        for t in group.trajectories:
            rewards[t.session_id] = bounded(rewards.get(t.session_id, t.reward) - penalty[t.seq])
        sessions = list(rewards)
        values = compute_advantages([rewards[s] for s in sessions], estimator, baseline=baseline or 0.0)
        by_session = dict(zip(sessions, values, strict=True))
        advantages += [by_session[t.session_id] for t in group.trajectories]
    return advantages


def step_advantages(
    groups: list[Group],
    estimator: Estimator,
    baseline: float | None,
    turn_discount: float | None,
    length: int,
    *,
    penalties: list[list[float]] | None = None,
) -> Tensor:
    """The step's advantages as the loss takes them: [B] one per trajectory, or with
    `turn_discount` [B,T] (T = `length`) one per turn on its sampled tokens.

    float32, as the loss computes: an advantage past float32's largest (~3.4e38, a Dr.GRPO or
    RLOO of rewards beyond it) saturates there instead of becoming inf (or, on a turn's
    tokens, a RuntimeError). The loss and its gradient scale with it all the same: the proxy
    bounds rewards (`--reward-range`, +-1e6 by default) long before that."""
    if turn_discount is None:
        values = group_advantages(groups, estimator, baseline, penalties=penalties)
        return torch.tensor([_float32(v) for v in values])
    trajectories = [t for g in groups for t in g.trajectories]
    per_turn = group_turn_advantages(groups, estimator, baseline, turn_discount, penalties=penalties)
    advantages = torch.zeros(len(trajectories), length)
    for row, (t, values) in enumerate(zip(trajectories, per_turn, strict=True)):
        for turn, value in zip(t.turns, values, strict=True):
            advantages[row, turn.completion_start : turn.completion_end] = _float32(value)
    return advantages


def _float32(value: float) -> float:
    """`value` clamped to the finite float32 range."""
    return max(-_FLOAT32_MAX, min(_FLOAT32_MAX, value))


def group_turn_advantages(
    groups: list[Group],
    estimator: Estimator,
    baseline: float | None,
    discount: float,
    *,
    penalties: list[list[float]] | None = None,
) -> list[list[float]]:
    """[trajectories][turns] A_ik (`advantage.py`): a session's turns run over its segments in
    order; per-turn rewards less the turn's penalty, the final reward on the last turn."""
    trajectories = [t for g in groups for t in g.trajectories]
    if penalties is None:
        penalties = [[0.0] * len(t.turns) for t in trajectories]
    penalty = {t.seq: p for t, p in zip(trajectories, penalties, strict=True)}
    out: list[list[float]] = []
    for group in groups:
        rewards: dict[str, list[float]] = {}
        for t in group.trajectories:
            turns = rewards.setdefault(t.session_id, [])
            turns += [
                bounded((turn.reward or 0.0) - p) for turn, p in zip(t.turns, penalty[t.seq], strict=True)
            ]
        finals = {t.session_id: t.reward for t in group.trajectories}
        sessions = list(rewards)
        returns = [turn_returns(rewards[s], finals[s], discount) for s in sessions]
        advantages = dict(
            zip(sessions, turn_advantages(returns, estimator, baseline=baseline or 0.0), strict=True)
        )
        taken = dict.fromkeys(sessions, 0)
        for t in group.trajectories:
            start = taken[t.session_id]
            out.append(advantages[t.session_id][start : start + len(t.turns)])
            taken[t.session_id] = start + len(t.turns)
    return out


def is_flat(group: Group, *, by_turn: bool) -> bool:
    """Whether every session of the group had the same outcome: the same final reward, and
    with `by_turn` (per-turn credit) the same number of turns and the same per-turn rewards,
    turn by turn (a turn without a reward counts 0, as in its return). "The same" is within
    `advantage.FLAT_RTOL` of the values' scale, as the estimators judge a group flat: a
    group-relative estimator then gives every token exactly advantage 0 (a group of one
    session is flat)."""
    outcomes: dict[str, list[float]] = {}
    for t in group.trajectories:
        outcome = outcomes.setdefault(t.session_id, [t.reward or 0.0])
        if by_turn:
            outcome += [turn.reward or 0.0 for turn in t.turns]
    if len({len(o) for o in outcomes.values()}) > 1:
        return False
    return all(rewards_flat(position) for position in zip(*outcomes.values(), strict=True))


def turn_sums(values: Tensor, loss_mask: Tensor, trajectories: list[Trajectory]) -> list[list[float]]:
    """[B][turns] the sum of `values` [B,T] over each turn's sampled tokens (loss_mask 1)."""
    masked = torch.where(loss_mask.bool(), values, torch.zeros_like(values))
    return [
        [float(masked[row, turn.completion_start : turn.completion_end].sum()) for turn in t.turns]
        for row, t in enumerate(trajectories)
    ]


def reward_kl(
    policy: Policy, batch: Batch, trajectories: list[Trajectory], loss: LossConfig, rows_per_pass: int
) -> tuple[list[list[float]], float]:
    """(beta * sum of k_t per turn of each trajectory, the mean k_t over the sampled tokens):
    the reference's logprobs over `batch` (rows aligned with `trajectories`), `rows_per_pass`
    rows per forward pass."""
    ref = torch.zeros_like(batch.rollout_logprobs)
    for start in range(0, len(batch), rows_per_pass):
        rows = list(range(start, min(start + rows_per_pass, len(batch))))
        part = policy.reference_logprobs(batch.select(rows)).cpu()
        ref[start : start + len(rows), : part.shape[1]] = part
    k = kl_estimate(batch.rollout_logprobs, ref, loss.kl_estimator)
    sampled = batch.loss_mask.bool()
    mean = float(k[sampled].sum()) / max(int(sampled.sum()), 1)
    return [[loss.kl_coef * s for s in row] for row in turn_sums(k, batch.loss_mask, trajectories)], mean
