"""Evaluation episodes: sessions created with `{"train": false}`, or in a group `eval/...`
(`molt_proxy/wire/control.py`). The trainer never trains on them; it logs their mean reward
per weight version that sampled them (`eval_reward: {"<version>": mean}` in metrics.jsonl,
one `eval_reward` curve at step = version in TensorBoard, dots on the reward curve).

Their rewards wait in the checkpointed state for the next metrics record. The final weights
can only be evaluated after the last step (an evaluator starts when it sees the last step's
record), so a run that has had evaluation episodes reads on after its last step until none
came for `WAIT_S`, and adds them to the last record (`Trainer._wind_down`). It does not decide
which episodes evaluate: whoever creates the session does.
"""

from __future__ import annotations

from molt_proxy.types import Trajectory
from molt_proxy.wire.control import EVAL_GROUP_PREFIX
from trainer.checkpoint import TrainerState

WAIT_S = 5.0
"""After the last step, how long the trainer waits for an evaluation episode (the first, or
the next): enough for an evaluator that polls metrics.jsonl to start and finish one."""


def is_evaluation(trajectory: Trajectory) -> bool:
    return trajectory.group_id.startswith(EVAL_GROUP_PREFIX)


def take(state: TrainerState, trajectory: Trajectory) -> None:
    """Consume an evaluation episode; its reward (once per session) waits in `state` under the
    weight version that sampled it, the latest of its tokens'."""
    state.consumed.append(trajectory.trajectory_id)
    sampled = [v for v, m in zip(trajectory.weight_versions, trajectory.loss_mask, strict=True) if m]
    if trajectory.reward is not None and trajectory.segment == 0 and sampled:
        state.evaluations.append((max(sampled), trajectory.reward))


def means(evaluations: list[tuple[int, float]]) -> dict[str, float]:
    """{version: mean reward} of (version, reward) pairs, by version."""
    by_version: dict[int, list[float]] = {}
    for version, reward in evaluations:
        by_version.setdefault(int(version), []).append(reward)
    return {str(v): sum(rewards) / len(rewards) for v, rewards in sorted(by_version.items())}
