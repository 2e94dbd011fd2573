"""The sampled tokens of constrained turns leave the loss by default (`--constrained-turns
skip`) and are counted; `train` keeps them. vLLM records them under the grammar-masked
distribution, which the trainer cannot recompute (bench/RESULTS.md, block 10)."""

from __future__ import annotations

import pytest

from molt_proxy.cli import parser
from molt_proxy.types import Sampling, Trajectory, Turn
from tests.trainer.builders import trajectory
from trainer.batch import collate
from trainer.config import TrainerConfig, config_from_args


def two_turns() -> Trajectory:
    """Prompt [1, 2], a plain turn sampling [3, 4], a new prompt token [5] and a constrained
    turn sampling [6, 7, 8]."""
    record = trajectory(0, token_ids=[1, 2, 3, 4, 5, 6, 7, 8], logprobs=[-1.0] * 6)
    record.loss_mask = [0, 0, 1, 1, 0, 1, 1, 1]
    record.logprobs = [0.0, 0.0, -1.0, -1.0, 0.0, 0.0, 0.0, -0.5]
    record.weight_versions = [-1, -1, 0, 0, -1, 0, 0, 0]
    record.turns = [
        Turn("c0", 0, 2, 4, "stop", sampling=Sampling()),
        Turn("c1", 4, 5, 8, "stop", sampling=Sampling(), constrained=True),
    ]
    return record


def test_constrained_tokens_leave_the_loss_by_default_and_are_counted():
    batch = collate([two_turns()], [1.0])
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1, 0, 0, 0, 0]]
    assert batch.sampling.constrained.tolist() == [[False] * 5 + [True] * 3]
    assert batch.sampling.counts()["constrained_tokens"] == 3.0


def test_train_keeps_constrained_tokens_in_the_loss_and_still_counts_them():
    batch = collate([two_turns()], [1.0], train_constrained=True)
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1, 0, 1, 1, 1]]
    assert batch.sampling.counts()["constrained_tokens"] == 3.0


def test_the_flag_reaches_the_config_and_skip_is_the_default():
    assert TrainerConfig(proxy_url="u", model="m", out_dir="o").constrained_turns == "skip"
    args = parser().parse_args(["serve", "--model", "m", "--constrained-turns", "train"])
    assert config_from_args(args, "u", "m").constrained_turns == "train"
    with pytest.raises(SystemExit):
        parser().parse_args(["serve", "--model", "m", "--constrained-turns", "mask"])
    with pytest.raises(ValueError, match="constrained_turns must be 'train' or 'skip'"):
        TrainerConfig(proxy_url="u", model="m", out_dir="o", constrained_turns="mask")  # type: ignore[arg-type]


def test_the_trajectory_json_carries_constrained_and_older_records_read_false():
    record = two_turns()
    data = record.to_json()
    assert [turn["constrained"] for turn in data["turns"]] == [False, True]
    assert [turn.constrained for turn in Trajectory.from_json(data).turns] == [False, True]
    for turn in data["turns"]:
        del turn["constrained"]  # a record from before the field
    assert [turn.constrained for turn in Trajectory.from_json(data).turns] == [False, False]
