"""What each trajectory's sampled tokens are credited with: the advantages of a step.

Owns the step from rewards to one advantage per trajectory: a session's reward (less a KL
penalty when `--kl-in reward`) is compared within its group by the estimator
(`advantage.py`), and every segment of the session shares the result. It does not decide which
groups train (the loop) or weigh tokens in the loss (`loss.py`).

KL in the reward (`--kl-coef beta --kl-in reward`): a trajectory's penalty is beta times the
sum of k_t (`loss.kl_estimate`) over its sampled tokens, with pi there the sampler's mu (the
policy that drew them; no extra forward of the trained model) and ref the frozen reference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from molt_proxy.types import Trajectory
from trainer.advantage import Estimator, compute_advantages
from trainer.batch import Batch
from trainer.buffer import Group
from trainer.config import LossConfig
from trainer.loss import kl_estimate

if TYPE_CHECKING:
    from trainer.policy import Policy


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
        penalty = {t.seq: sum(p) for t, p in zip(trajectories, penalties, strict=True)}
    advantages = []
    for group in groups:
        rewards: dict[str, float] = {}
        for t in group.trajectories:
            rewards[t.session_id] = rewards.get(t.session_id, t.reward) - penalty[t.seq]
        sessions = list(rewards)
        values = compute_advantages([rewards[s] for s in sessions], estimator, baseline=baseline or 0.0)
        by_session = dict(zip(sessions, values, strict=True))
        advantages += [by_session[t.session_id] for t in group.trajectories]
    return advantages


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
