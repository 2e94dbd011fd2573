"""`--tensorboard DIR` (issue 15, item 3): every numeric metrics.jsonl field of a step is a
TensorBoard scalar at that step, and evaluation rewards one curve by weight version, read back
with TensorBoard's own event reader. (Through a real `Trainer` run: tests/trainer/test_loop.py.)"""

from __future__ import annotations

import logging
import struct
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from molt_proxy.cli import parser
from trainer.config import config_from_args
from trainer.metrics import MetricsLog, read


def float32(value: float) -> float:
    """`value` as TensorBoard stores a scalar (a float32)."""
    return struct.unpack("f", struct.pack("f", value))[0]


def test_every_numeric_field_of_every_step_reads_back_as_a_scalar(tmp_path: Path):
    records = [
        {"step": 1, "time": 1_700_000_000.5, "reward_mean": 0.125, "approx_kl": 1e-4, "tokens_per_s": 812.3,
         "is_ratio": {"mean": 1.01, "max": 1.7}, "skipped_steps_zero_gradient": 0, "greedy": False,
         "estimator": "grpo", "lag": None, "eval_reward": {"0": 0.25}},
        {"step": 2, "time": 1_700_000_030.25, "reward_mean": 0.5, "approx_kl": 3e-4, "tokens_per_s": 790.0,
         "is_ratio": {"mean": 0.98, "max": 1.2}, "skipped_steps_zero_gradient": 1, "greedy": True,
         "estimator": "grpo", "lag": None, "eval_reward": {"1": 0.5}},
    ]  # fmt: skip
    log = MetricsLog(tmp_path / "metrics.jsonl", tensorboard=tmp_path / "tb")
    for record in records:
        log.write(record)
    assert read(tmp_path / "metrics.jsonl") == records  # the JSON lines are unchanged

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    numeric = {
        "reward_mean": [0.125, 0.5],
        "approx_kl": [1e-4, 3e-4],
        "tokens_per_s": [812.3, 790.0],
        "is_ratio/mean": [1.01, 0.98],
        "is_ratio/max": [1.7, 1.2],
        "skipped_steps_zero_gradient": [0.0, 1.0],
        "greedy": [0.0, 1.0],
    }
    assert sorted(events.Tags()["scalars"]) == sorted([*numeric, "eval_reward"])
    for tag, values in numeric.items():
        scalars = events.Scalars(tag)
        assert [(s.step, s.wall_time, s.value) for s in scalars] == [
            (1, 1_700_000_000.5, float32(values[0])),
            (2, 1_700_000_030.25, float32(values[1])),
        ]
    # One curve, at step = the weight version evaluated, at the time of the record it came in.
    evaluated = [(s.step, s.wall_time, s.value) for s in events.Scalars("eval_reward")]
    assert evaluated == [(0, 1_700_000_000.5, 0.25), (1, 1_700_000_030.25, 0.5)]


def test_evaluations_after_the_last_record_are_merged_into_it_and_added_to_the_curve(tmp_path: Path):
    """The final weights' evaluations come after the last step: metrics.jsonl keeps one record
    per step (the last one's `eval_reward` takes them; a version in both takes the new mean),
    and the TensorBoard curve gets the new points."""
    first = {"step": 1, "time": 1_700_000_000.5, "reward_mean": 0.125}
    last = {"step": 2, "time": 1_700_000_030.25, "reward_mean": 0.5, "eval_reward": {"1": 0.5}}
    log = MetricsLog(tmp_path / "metrics.jsonl", tensorboard=tmp_path / "tb")
    log.write(first)
    log.write(last)

    log.add_evaluations({"1": 0.75, "2": 1.0})

    assert read(tmp_path / "metrics.jsonl") == [first, {**last, "eval_reward": {"1": 0.75, "2": 1.0}}]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(s.step, s.value) for s in events.Scalars("eval_reward")] == [(1, 0.5), (1, 0.75), (2, 1.0)]
    assert [(s.step, s.value) for s in events.Scalars("reward_mean")] == [(1, 0.125), (2, 0.5)]


def test_the_tensorboard_flag_reaches_the_trainer_config(tmp_path: Path):
    args = parser().parse_args(["serve", "--model", "m", "--train", "--tensorboard", str(tmp_path / "tb")])
    assert config_from_args(args, "http://proxy", "m").tensorboard == tmp_path / "tb"
    args = parser().parse_args(["serve", "--model", "m", "--train"])
    assert config_from_args(args, "http://proxy", "m").tensorboard is None


def test_evaluations_with_no_step_taken_go_to_the_log_and_the_curve(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """metrics.jsonl holds one record per step taken: none taken, it stays absent."""
    log = MetricsLog(tmp_path / "metrics.jsonl", tensorboard=tmp_path / "tb")
    with caplog.at_level(logging.INFO, logger="trainer.metrics"):
        log.add_evaluations({"0": 0.25})

    assert not (tmp_path / "metrics.jsonl").exists()
    assert [r.getMessage() for r in caplog.records] == [
        "evaluation reward by weight version, no step taken: {'0': 0.25}"
    ]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(s.step, s.value) for s in events.Scalars("eval_reward")] == [(0, 0.25)]
