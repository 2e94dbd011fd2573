"""What each trajectory's sampled tokens are credited with: the advantages of a step.

Owns the step from rewards to advantages: what the advantage sees (`shape`: the rewards
`--reward-shaping` makes, less a KL penalty when `--kl-in reward`), the advantage plug-in run
on each group and its result checked (`advantages`), and the result laid on the tokens
(`advantage_tensor`). By default that plug-in is the built-in estimator (`algorithms.py`): a
session's reward compared within its group (`advantage.py`), shared by every sampled token of
every segment of the session; with `--turn-discount`, each turn of a session gets its own
advantage from per-turn returns, shared by that turn's sampled tokens. It does not decide
which groups train (the loop) or weigh tokens in the loss (`loss.py`).

KL in the reward (`--kl-coef beta --kl-in reward`): a trajectory's penalty is beta times the
sum of k_t (`loss.kl_estimate`) over its sampled tokens, with pi there the sampler's mu (the
policy that drew them; no extra forward of the trained model) and ref the frozen reference.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor

from molt_proxy.types import Trajectory
from trainer import plugins
from trainer.advantage import Estimator, bounded
from trainer.algorithms import drop_flat
from trainer.batch import Batch
from trainer.buffer import Group, final_reward
from trainer.config import LossConfig
from trainer.loss import kl_estimate
from trainer.plugins import Plugin, PluginError

if TYPE_CHECKING:
    from trainer.policy import Policy

_FLOAT32_MAX = torch.finfo(torch.float32).max


# 1. What the advantage sees --------------------------------------------------------------------


def shape(
    groups: list[Group],
    shaping: Plugin | None = None,
    penalties: list[list[float]] | None = None,
    *,
    by_turn: bool = False,
    step: int = 0,
) -> list[list[Trajectory]]:
    """Each group's trajectories as the advantage sees them: copies whose rewards are
    `--reward-shaping`'s (a float replaces the reward, a list the per-turn rewards) less the
    KL penalties ([trajectories][turns], aligned with the groups' trajectories; `--kl-in
    reward`). The records themselves keep the posted rewards.

    A session's segments share one reward, so a change made per segment adds up over the
    session: its reward is R + sum over its segments of (shaped - R), on all its segments.
    The penalties are taken once: from each turn's reward (a turn without one counts 0) when
    the advantage is per turn (`by_turn`, whose returns add them up), else from the session's
    reward, all its segments' turns together."""
    trajectories = [t for g in groups for t in g.trajectories]
    if penalties is None:
        penalties = [[0.0] * len(t.turns) for t in trajectories]
    out: list[list[Trajectory]] = []
    rows = iter(zip(trajectories, penalties, strict=True))
    for group in groups:
        copies: list[Trajectory] = []
        session_rewards: dict[str, float] = {}
        for t, penalty in (next(rows) for _ in group.trajectories):
            final = final_reward(t)
            reward, turn_rewards = final, [turn.reward for turn in t.turns]
            if shaping is not None:
                reward, turn_rewards = _shaped(shaping, t, step, group.group_id)
            total = bounded(session_rewards.get(t.session_id, final) + (reward - final))
            session_rewards[t.session_id] = total if by_turn else bounded(total - sum(penalty))
            if by_turn and any(penalty):
                turn_rewards = [bounded((r or 0.0) - p) for r, p in zip(turn_rewards, penalty, strict=True)]
            turns = [replace(turn, reward=r) for turn, r in zip(t.turns, turn_rewards, strict=True)]
            copies.append(replace(t, turns=turns))
        for copy in copies:
            copy.reward = session_rewards[copy.session_id]
        out.append(copies)
    return out


def _shaped(shaping: Plugin, t: Trajectory, step: int, group: str) -> tuple[float, list[float | None]]:
    """(reward, per-turn rewards) of `t` under the shaping plug-in, its result checked."""
    value = plugins.call(shaping, t, f"step {step}, group {group}, trajectory {t.trajectory_id}")
    if isinstance(value, int | float) and math.isfinite(value):
        return float(value), [turn.reward for turn in t.turns]
    if isinstance(value, list | tuple) and len(value) == len(t.turns) and _finite(value):
        return final_reward(t), [float(v) for v in value]
    raise PluginError(
        f"{shaping} returned {value!r} for trajectory {t.trajectory_id} (step {step}, group {group}): "
        f"a finite reward, or one per turn ({len(t.turns)})"
    )


def _finite(values: Sequence[object]) -> bool:
    return all(isinstance(v, int | float) and math.isfinite(v) for v in values)


# 2. Advantages --------------------------------------------------------------------------------


def builtin_advantage(
    estimator: Estimator | str, baseline: float | None, turn_discount: float | None
) -> Plugin:
    """The built-in that `--estimator` (and `--turn-discount`) name, with what the loop
    keeps for it bound: the running baseline, the discount."""
    estimator = Estimator(estimator)
    if turn_discount is not None:
        plugin = plugins.resolve("advantage", "turn_credit")
        bound = partial(plugin.fn, estimator=estimator, discount=turn_discount, baseline=baseline or 0.0)
        return Plugin("advantage", f"turn_credit (--turn-discount {turn_discount})", bound)
    plugin = plugins.resolve("advantage", estimator.value)
    if estimator is Estimator.REINFORCE_BASELINE:
        return Plugin("advantage", plugin.spec, partial(plugin.fn, baseline=baseline or 0.0))
    return plugin


def advantages(plugin: Plugin, groups: list[list[Trajectory]], step: int = 0) -> list[float | list[float]]:
    """The plug-in's advantages of every group, in order, each checked: one finite number per
    trajectory, or a list of one per turn; anything else stops the run, naming the group."""
    out: list[float | list[float]] = []
    for group in groups:
        where = f"step {step}, group {group[0].group_id}"
        values = plugins.call(plugin, group, where)
        if not isinstance(values, list | tuple) or len(values) != len(group):
            count = len(values) if isinstance(values, list | tuple) else type(values).__name__
            raise PluginError(
                f"{plugin} returned {count} advantages for the {len(group)} trajectories of {where}: "
                "one per trajectory, or one list per trajectory with one per turn"
            )
        for t, value in zip(group, values, strict=True):
            if isinstance(value, list | tuple):
                if len(value) != len(t.turns) or not _finite(value):
                    raise PluginError(
                        f"{plugin} returned {list(value)} for trajectory {t.trajectory_id} of {len(t.turns)} "
                        f"turns ({where}): one finite advantage per turn"
                    )
                out.append([float(v) for v in value])
            elif isinstance(value, int | float) and math.isfinite(value):
                out.append(float(value))
            else:
                raise PluginError(f"{plugin} returned {value!r} for {t.trajectory_id} ({where}): not finite")
    return out


def advantage_tensor(
    values: list[float | list[float]], trajectories: list[Trajectory], length: int
) -> Tensor:
    """The loss's advantages: [B] when every trajectory has one, else [B,T] (T = `length`):
    per-turn values on their turn's sampled tokens, a per-trajectory one on its whole row.

    float32, as the loss computes: an advantage past float32's largest (~3.4e38, a Dr.GRPO or
    RLOO of rewards beyond it) saturates there instead of becoming inf (or, on a turn's
    tokens, a RuntimeError). The loss and its gradient scale with it all the same: the proxy
    bounds rewards (`--reward-range`, +-1e6 by default) long before that."""
    if all(isinstance(v, float) for v in values):
        return torch.tensor([_float32(v) for v in cast(list[float], values)])
    out = torch.zeros(len(trajectories), length)
    for row, (t, value) in enumerate(zip(trajectories, values, strict=True)):
        if isinstance(value, float):
            out[row] = _float32(value)
            continue
        for turn, v in zip(t.turns, value, strict=True):
            out[row, turn.completion_start : turn.completion_end] = _float32(v)
    return out


def group_advantages(
    groups: list[Group],
    estimator: Estimator,
    baseline: float | None,
    *,
    penalties: list[list[float]] | None = None,
) -> list[float]:
    """One advantage per trajectory (in the groups' order) by the built-in estimator, over
    the groups' sessions less the penalties ([trajectories][turns]; None: none)."""
    values = advantages(builtin_advantage(estimator, baseline, None), shape(groups, None, penalties))
    return cast(list[float], values)  # no turn discount: one number per trajectory


def step_advantages(
    groups: list[Group],
    estimator: Estimator,
    baseline: float | None,
    turn_discount: float | None,
    length: int,
    *,
    penalties: list[list[float]] | None = None,
) -> Tensor:
    """The built-in estimators' advantages as the loss takes them: [B] one per trajectory,
    or with `turn_discount` [B,T] (T = `length`) one per turn on its sampled tokens."""
    plugin = builtin_advantage(estimator, baseline, turn_discount)
    values = advantages(plugin, shape(groups, None, penalties, by_turn=turn_discount is not None))
    if turn_discount is None:
        return advantage_tensor(values, [], length)
    return advantage_tensor(values, [t for g in groups for t in g.trajectories], length)


def _float32(value: float) -> float:
    """`value` clamped to the finite float32 range."""
    return max(-_FLOAT32_MAX, min(_FLOAT32_MAX, value))


def is_flat(group: Group, *, by_turn: bool) -> bool:
    """Whether every session of the group had the same outcome (`algorithms.drop_flat`): the
    same final reward, and with `by_turn` (per-turn credit) the same number of turns and the
    same per-turn rewards, turn by turn (a turn without a reward counts 0, as in its return).
    "The same" is within `advantage.FLAT_RTOL` of the values' scale, as the estimators judge
    a group flat: a group-relative estimator then gives every token exactly advantage 0 (a
    group of one session is flat)."""
    return not drop_flat(group.trajectories, by_turn=by_turn)


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
