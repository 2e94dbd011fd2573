"""The real `Trainer.run` on a tiny model, with the stream and the vLLM refresh stubbed: steps
that would change nothing are skipped and counted, stale groups dropped, versions count the
trainer steps and the optimizer steps are counted apart."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from devtools import build_tiny_model
from molt_proxy.types import Trajectory
from tests.trainer.builders import trajectory
from trainer import checkpoint, loop
from trainer.buffer import Group
from trainer.config import TrainerConfig
from trainer.loss import LossConfig
from trainer.metrics import read


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3", teach=False)


class Stream:
    """The proxy's stream as the loop sees it: these trajectories in order, then nothing."""

    def __init__(self, records: list[Trajectory]):
        self.records = list(records)

    def start(self) -> Stream:
        return self

    def get(self, timeout_s: float) -> tuple[int, Trajectory] | None:
        return (0, self.records.pop(0)) if self.records else None

    def stop(self) -> None:
        pass


def group(first_seq: int, name: str, rewards: tuple[float, float], version: int, logprob: float = -1.0):
    """Two episodes that share their prompt and differ in every sampled token. Identical ones with
    opposite advantages have a gradient of exactly 0 (their shared tokens are computed once):
    only rounding noise, which Adam's first step would blow up to a full step of lr."""
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


def test_steps_that_would_change_nothing_are_skipped_counted_and_their_data_consumed(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    records = [
        *group(1, "first", (1.0, 0.0), version=0),  # step 1 (version 0 -> 1)
        *group(3, "tie", (1.0, 1.0), version=1),  # every advantage 0
        *group(5, "masked", (1.0, 0.0), version=1, logprob=40.0),  # pi_old / mu ~ e^-50 < is_low
        *group(7, "stale", (1.0, 0.0), version=0),  # 1 version old, max_staleness 0
        *group(9, "second", (0.0, 1.0), version=1),  # step 2
    ]
    monkeypatch.setattr(loop, "TrajectoryStream", lambda *args, **kwargs: Stream(records))
    refreshed: list[int] = []
    monkeypatch.setattr(loop.Trainer, "_refresh", lambda self: refreshed.append(self.state.version) or 0.0)
    config = TrainerConfig(
        proxy_url="http://unused",
        model=str(model_dir),
        out_dir=tmp_path,
        group_size=2,
        groups_per_step=1,
        max_steps=4,  # taken and skipped: first, tie, masked, second
        lr=1e-3,
        ppo_epochs=2,
        loss=LossConfig(is_mode="mask", is_low=1e-9, is_high=1e9, max_staleness=0),
    )
    trainer = loop.Trainer(config)
    weights_before: list[dict[str, torch.Tensor]] = []
    ppo_step = trainer.policy.ppo_step

    def spy(*args, **kwargs):
        weights_before.append({k: v.clone() for k, v in trainer.policy.model.state_dict().items()})
        return ppo_step(*args, **kwargs)

    trainer.policy.ppo_step = spy

    assert trainer.run() == {"step": 2, "version": 2, "cursors": [10]}

    assert refreshed == [0, 1, 2]  # at start, then once per step taken: never for a skipped one
    assert len(weights_before) == 3  # first, masked, second: the tie and the stale group never ran
    masked, second = weights_before[1], weights_before[2]
    assert all(torch.equal(masked[name], tensor) for name, tensor in second.items())
    state, _ = checkpoint.load(tmp_path / "checkpoint")
    assert state.trained == [["first-0:0", "first-1:0"], ["second-0:0", "second-1:0"]]
    assert sorted(state.consumed) == [
        "masked-0:0",
        "masked-1:0",
        "stale-0:0",
        "stale-1:0",
        "tie-0:0",
        "tie-1:0",
    ]
    assert state.skipped_steps == {"zero_advantage": 1, "masked": 1} and state.dropped_stale_groups == 1
    assert state.optimizer_steps == 4  # two epochs per step taken; versions count steps
    records_written = read(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records_written] == [1, 2]
    last = records_written[-1]
    assert last["optimizer_steps"] == 2 and last["optimizer_steps_total"] == 4
    assert last["skipped_steps_masked"] == last["skipped_steps_zero_advantage"] == 1
    assert last["dropped_stale_groups"] == 1


def test_a_step_whose_every_token_is_stale_is_skipped_before_any_compute(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(loop.Trainer, "_refresh", lambda self: pytest.fail("refreshed on a skipped step"))
    config = TrainerConfig(proxy_url="http://unused", model=str(model_dir), out_dir=tmp_path, group_size=2)
    trainer = loop.Trainer(config)
    trainer.state.version = trainer.state.step = 9  # tokens of version 0 are 9 > max_staleness 4 old
    trainer.policy.ppo_step = lambda *args, **kwargs: pytest.fail("a step ran on stale tokens only")
    stale = Group("g", group(1, "g", (1.0, 0.0), version=0))

    trainer._step([stale], pending=[])

    assert (trainer.state.step, trainer.state.version, trainer.state.optimizer_steps) == (9, 9, 0)
    assert trainer.state.skipped_steps == {"stale": 1} and trainer.state.consumed == ["g-0:0", "g-1:0"]
    assert not (tmp_path / "metrics.jsonl").exists()


def test_flat_stale_and_eval_groups_are_dropped_before_a_step_and_counted(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A and B are in the checkpoint's pending work, so both are ready at once; the step on A
    moves the version to 1, which makes the waiting B (version 0, max_staleness 0) stale. C is
    flat (both episodes rewarded 1) and dropped; it counts a step's worth towards max_steps.
    E is an evaluation group: never trained on, its mean reward logged under its version."""
    waiting = [*group(1, "A", (1.0, 0.0), version=0), *group(3, "B", (0.0, 1.0), version=0)]
    records = [
        *group(5, "C", (1.0, 1.0), version=1),
        *group(7, "eval/E", (0.25, 0.75), version=1),
        *group(9, "D", (0.0, 1.0), version=1),
    ]
    monkeypatch.setattr(loop, "TrajectoryStream", lambda *args, **kwargs: Stream(records))
    monkeypatch.setattr(loop.Trainer, "_refresh", lambda self: 0.0)
    config = TrainerConfig(
        proxy_url="http://unused",
        model=str(model_dir),
        out_dir=tmp_path,
        group_size=2,
        groups_per_step=1,
        max_steps=3,  # A, C dropped (a step's worth), D
        lr=1e-3,
        drop_flat_groups=True,
        loss=LossConfig(max_staleness=0),
    )
    trainer = loop.Trainer(config)
    trainer.state.pending = waiting
    calls: list[int] = []
    ppo_step = trainer.policy.ppo_step

    def spy(*args, **kwargs):
        calls.append(trainer.state.version)
        return ppo_step(*args, **kwargs)

    trainer.policy.ppo_step = spy

    assert trainer.run() == {"step": 2, "version": 2, "cursors": [10]}

    state, _ = checkpoint.load(tmp_path / "checkpoint")
    assert state.trained == [["A-0:0", "A-1:0"], ["D-0:0", "D-1:0"]]
    assert sorted(state.consumed) == ["B-0:0", "B-1:0", "C-0:0", "C-1:0", "eval/E-0:0", "eval/E-1:0"]
    assert (state.dropped_stale_groups, state.dropped_flat_groups, state.skipped_steps) == (1, 1, {})
    assert calls == [0, 1]  # the policy stepped on A and D only
    last = read(tmp_path / "metrics.jsonl")[-1]
    assert (last["dropped_stale_groups"], last["dropped_flat_groups"]) == (1, 1)
    assert last["entropy"] > 0.0 and "kl_ref" not in last  # no reference without --kl-coef
    assert last["eval_reward"] == {"1": 0.5} and state.evaluations == []


def test_drop_flat_groups_needs_a_group_relative_estimator() -> None:
    with pytest.raises(ValueError, match="group-relative"):
        TrainerConfig(proxy_url="u", model="m", out_dir="o", drop_flat_groups=True, estimator="reinforce")
