"""The real `Trainer.run` on a tiny model, with the stream and the vLLM refresh stubbed: steps
that would change nothing are skipped and counted, stale groups dropped, versions count the
trainer steps and the optimizer steps are counted apart; per-turn credit reaches the step;
evaluations, the final weights' too, and every metric reach metrics.jsonl and TensorBoard."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from molt_proxy.types import Trajectory
from tests.trainer.builders import episodes, trajectory, turns
from trainer import checkpoint, loop
from trainer.batch import Batch
from trainer.buffer import Group, GroupBuffer
from trainer.config import TrainerConfig
from trainer.loss import LossConfig
from trainer.metrics import eval_points, progress_line, read, scalars, summary_line


class Clock:
    """`trainer.loop`'s `time`: its intervals pass only as the test moves them; a record's
    wall-clock `time` is the real one."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return time.time()


class Stream:
    """The proxy's stream as the loop sees it: these trajectories in order, then nothing."""

    def __init__(self, records: list[Trajectory], clock: Clock):
        self.records = list(records)
        self.clock = clock

    def start(self) -> Stream:
        return self

    def get(self, timeout_s: float) -> tuple[int, Trajectory] | None:
        if not self.records:
            self.clock.now += timeout_s  # as the real one waits, on the loop's clock
            return None
        return 0, self.records.pop(0)

    def stop(self) -> None:
        pass


def follow(monkeypatch: pytest.MonkeyPatch, records: list[Trajectory]) -> None:
    """The loop reads `records` from its stream, on a clock that moves only while it waits
    for more (`Stream.get`): the wait for evaluations after the last step
    (`evaluation.WAIT_S`, 5 s) passes at once."""
    clock = Clock()
    monkeypatch.setattr(loop, "time", clock)
    monkeypatch.setattr(loop, "TrajectoryStream", lambda *args, **kwargs: Stream(records, clock))


def test_steps_that_would_change_nothing_are_skipped_counted_and_their_data_consumed(
    small_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    records = [
        *episodes(1, "first", (1.0, 0.0), version=0),  # step 1 (version 0 -> 1)
        *episodes(3, "tie", (1.0, 1.0), version=1),  # every advantage 0
        *episodes(5, "masked", (1.0, 0.0), version=1, logprob=40.0),  # pi_old / mu ~ e^-50 < is_low
        *episodes(7, "stale", (1.0, 0.0), version=0),  # 1 version old, max_staleness 0
        *episodes(9, "second", (0.0, 1.0), version=1),  # step 2
    ]
    follow(monkeypatch, records)
    refreshed: list[int] = []
    monkeypatch.setattr(loop.Trainer, "_refresh", lambda self: refreshed.append(self.state.version) or 0.0)
    config = TrainerConfig(
        proxy_url="http://unused",
        model=str(small_model),
        out_dir=tmp_path,
        group_size=2,
        groups_per_step=1,
        max_steps=4,  # taken and skipped: first, tie, masked, second
        # At 1e-3 the first step's first epoch moved every ratio past the clip, leaving its
        # second epoch no gradient (and no optimizer step) on this model's small vocabulary.
        lr=1e-4,
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
    # the progress counts steps done, as max_steps does: the two skipped ones are named
    assert [r["steps_done"] for r in records_written] == [1, 4]
    assert progress_line(last, 4).startswith("step    4/4 (2 skipped or dropped) ████████████████████ ")
    assert summary_line(tmp_path) == (
        "2 steps taken, 2 skipped (1 masked, 1 zero advantage: nothing to learn, weights unchanged)"
    )


def test_a_step_whose_every_token_is_stale_is_skipped_before_any_compute(
    small_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(loop.Trainer, "_refresh", lambda self: pytest.fail("refreshed on a skipped step"))
    config = TrainerConfig(proxy_url="http://unused", model=str(small_model), out_dir=tmp_path, group_size=2)
    trainer = loop.Trainer(config)
    trainer.state.version = trainer.state.step = 9  # tokens of version 0 are 9 > max_staleness 4 old
    trainer.policy.ppo_step = lambda *args, **kwargs: pytest.fail("a step ran on stale tokens only")
    stale = Group("g", episodes(1, "g", (1.0, 0.0), version=0))

    trainer._step([stale], pending=[])

    assert (trainer.state.step, trainer.state.version, trainer.state.optimizer_steps) == (9, 9, 0)
    assert trainer.state.skipped_steps == {"stale": 1} and trainer.state.consumed == ["g-0:0", "g-1:0"]
    assert not (tmp_path / "metrics.jsonl").exists()


def test_flat_stale_and_eval_groups_are_dropped_before_a_step_and_counted(
    small_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A and B are in the checkpoint's pending work, so both are ready at once; the step on A
    moves the version to 1, which makes the waiting B (version 0, max_staleness 0) stale. C is
    flat (both episodes rewarded 1) and dropped; it counts a step's worth towards max_steps.
    E is an evaluation group: never trained on, its mean reward logged under its version. F
    evaluates the final weights and arrives after the last step, with G to train on: the run
    waits for F and adds it to the last record; G is pending work in the checkpoint."""
    waiting = [*episodes(1, "A", (1.0, 0.0), version=0), *episodes(3, "B", (0.0, 1.0), version=0)]
    records = [
        *episodes(5, "C", (1.0, 1.0), version=1),
        *episodes(7, "eval/E", (0.25, 0.75), version=1),
        *episodes(9, "D", (0.0, 1.0), version=1),
        *episodes(11, "G", (1.0, 0.0), version=2),
        *episodes(13, "eval/F", (1.0, 0.5), version=2),
    ]
    follow(monkeypatch, records)
    monkeypatch.setattr(loop.Trainer, "_refresh", lambda self: 0.0)
    config = TrainerConfig(
        proxy_url="http://unused",
        model=str(small_model),
        out_dir=tmp_path,
        group_size=2,
        groups_per_step=1,
        max_steps=3,  # A, C dropped (a step's worth), D
        lr=1e-3,
        drop_flat_groups=True,
        loss=LossConfig(max_staleness=0),
        tensorboard=tmp_path / "tb",
    )
    trainer = loop.Trainer(config)
    trainer.state.pending = waiting
    calls: list[int] = []
    ppo_step = trainer.policy.ppo_step

    def spy(*args, **kwargs):
        calls.append(trainer.state.version)
        return ppo_step(*args, **kwargs)

    trainer.policy.ppo_step = spy

    assert trainer.run() == {"step": 2, "version": 2, "cursors": [14]}

    state, _ = checkpoint.load(tmp_path / "checkpoint")
    assert state.trained == [["A-0:0", "A-1:0"], ["D-0:0", "D-1:0"]]
    assert sorted(state.consumed) == [
        "B-0:0", "B-1:0", "C-0:0", "C-1:0", "eval/E-0:0", "eval/E-1:0", "eval/F-0:0", "eval/F-1:0"
    ]  # fmt: skip
    assert [t.trajectory_id for t in state.pending] == ["G-0:0", "G-1:0"] and state.cursors == [14]
    assert (state.dropped_stale_groups, state.dropped_flat_groups, state.skipped_steps) == (1, 1, {})
    assert calls == [0, 1]  # the policy stepped on A and D only
    records = read(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]  # one record per step taken, evaluations or not
    last = records[-1]
    assert (last["dropped_stale_groups"], last["dropped_flat_groups"]) == (1, 1)
    assert last["entropy"] > 0.0 and "kl_ref" not in last  # no reference without --kl-coef
    assert last["eval_reward"] == {"1": 0.5, "2": 0.75} and state.evaluations == []
    assert eval_points(records) == [(1, 0.5), (2, 0.75)]  # the reward curve's dots
    assert (tmp_path / "reward_curve.png").stat().st_size > 0

    # TensorBoard holds every numeric field of each step's record at that step, and one
    # eval_reward curve by weight version, as TensorBoard's own reader reads the event file.
    board = EventAccumulator(str(tmp_path / "tb"))
    board.Reload()
    expected: dict[str, list[tuple[int, float]]] = {"eval_reward": [(1, 0.5), (2, 0.75)]}
    for record in records:
        for name, value in scalars(
            {k: v for k, v in record.items() if k not in ("step", "time", "eval_reward")}
        ):
            expected.setdefault(name, []).append((record["step"], float32(value)))
    assert sorted(board.Tags()["scalars"]) == sorted(expected)
    assert {"reward_mean", "entropy", "is_ratio_mean", "replicas_behind"} <= set(expected)
    for tag, points in expected.items():
        assert [(s.step, s.value) for s in board.Scalars(tag)] == points, tag
    assert [s.wall_time for s in board.Scalars("reward_mean")] == [r["time"] for r in records]


def test_per_turn_credit_reaches_the_step_as_each_turns_advantage_on_its_tokens(
    small_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`turn_discount` through the loop: session a's 3 turns arrive in 2 segments after b's
    single one; the buffer makes them one group, and the step trains on each turn's advantage,
    on that turn's sampled tokens. By hand, gamma 0.5, Dr.GRPO:
      a: turn rewards 1, none, 0.5, final 1 -> r~ = 1, 0, 1.5 -> G = 1.375, 0.75, 1.5
      b: turn rewards 0, 0.5, none, final 0 -> r~ = 0, 0.5, 0 -> G = 0.25, 0.5, 0
      per turn position, G - mean (0.8125, 0.625, 0.75): a +0.5625, +0.125, +0.75; b the negatives.
    Each turn is [p s s]: turn k's sampled tokens are positions 3k+1, 3k+2."""
    records = [
        turns(1, "b", [0.0, 0.5, None], 0.0),
        turns(2, "a", [1.0, None], 1.0, segment=0, segments=2),
        turns(3, "a", [0.5], 1.0, segment=1, segments=2),
    ]
    follow(monkeypatch, records)
    monkeypatch.setattr(loop.Trainer, "_refresh", lambda self: 0.0)
    config = TrainerConfig(
        proxy_url="http://unused",
        model=str(small_model),
        out_dir=tmp_path,
        group_size=2,
        groups_per_step=1,
        max_steps=1,
        lr=1e-3,
        estimator="dr_grpo",
        turn_discount=0.5,
    )
    trainer = loop.Trainer(config)
    trained: list[list[list[Batch]]] = []
    ppo_step = trainer.policy.ppo_step

    def spy(mini_batches: list[list[Batch]], *args, **kwargs):
        trained.append(mini_batches)
        return ppo_step(mini_batches, *args, **kwargs)

    trainer.policy.ppo_step = spy

    assert trainer.run() == {"step": 1, "version": 1, "cursors": [3]}

    a0, a1, a2 = 0.5625, 0.125, 0.75
    [[[batch]]] = trained  # one step, one mini-batch, one micro-batch
    assert batch.input_ids.tolist() == [
        list(range(1, 10)),
        [1, 2, 3, 4, 5, 6, 0, 0, 0],
        [1, 2, 3, 0, 0, 0, 0, 0, 0],
    ]
    assert batch.advantages.tolist() == [
        [0.0, -a0, -a0, 0.0, -a1, -a1, 0.0, -a2, -a2],  # b: its 3 turns
        [0.0, a0, a0, 0.0, a1, a1, 0.0, 0.0, 0.0],  # a's segment 0: turns 1 and 2
        [0.0, a2, a2, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # a's segment 1: turn 3
    ]
    assert torch.equal(batch.advantages != 0, batch.loss_mask.bool())
    state, _ = checkpoint.load(tmp_path / "checkpoint")
    assert state.trained == [["b:0", "a:0", "a:1"]]


def test_an_evaluator_that_never_stops_does_not_keep_the_run_alive(
    small_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the last step the trainer waits for evaluations while they keep coming, but no
    longer than `group_timeout_s` in all; what it took is in the checkpoint. The loop's clock
    moves 1/8 s per evaluation taken, so it stops after exactly 8, well inside the quiet
    window (`evaluation.WAIT_S`) that each of them renews."""

    clock = Clock()  # seconds pass only as evaluations arrive
    monkeypatch.setattr(loop, "time", clock)

    class Endless:
        def __init__(self) -> None:
            self.seq = 0

        def get(self, timeout_s: float) -> tuple[int, Trajectory]:
            clock.now += 0.125
            self.seq += 1
            return 0, episodes(self.seq, f"eval/{self.seq}", (1.0, 1.0), version=0)[0]

    config = TrainerConfig(
        proxy_url="http://unused", model=str(small_model), out_dir=tmp_path, group_size=2, group_timeout_s=1.0
    )
    trainer = loop.Trainer(config)
    trainer.evaluating = True
    stream = Endless()

    trainer._wind_down(stream, GroupBuffer(2, 1.0), [])

    assert stream.seq == 8
    state, _ = checkpoint.load(tmp_path / "checkpoint")
    assert state.cursors == [8] and len(state.consumed) == 8 and state.evaluations == []


def float32(value: float) -> float:
    """`value` as TensorBoard stores a scalar (a float32)."""
    return struct.unpack("f", struct.pack("f", value))[0]


def test_drop_flat_groups_needs_a_group_relative_estimator() -> None:
    with pytest.raises(ValueError, match="group-relative"):
        TrainerConfig(proxy_url="u", model="m", out_dir="o", drop_flat_groups=True, estimator="reinforce")


def run_one_group(
    small_model: Path,
    out_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    records: list[Trajectory],
    *,
    perturb: bool = False,
    **settings,
) -> tuple[loop.Trainer, bool]:
    """`Trainer.run` for one step's worth of `records` (a group of 2 sessions); whether the
    step's optimizer moved the weights. `perturb`: the policy starts away from its reference."""
    follow(monkeypatch, records)
    monkeypatch.setattr(loop.Trainer, "_refresh", lambda self: 0.0)
    config = TrainerConfig(
        proxy_url="http://unused",
        model=str(small_model),
        out_dir=out_dir,
        group_size=2,
        groups_per_step=1,
        max_steps=1,
        lr=1e-3,
        **settings,
    )
    trainer = loop.Trainer(config)
    if perturb:
        with torch.no_grad():
            head = trainer.policy.model.lm_head.weight
            head.add_(head.std() * torch.randn(head.shape, generator=torch.Generator().manual_seed(0)))
    before = {k: v.clone() for k, v in trainer.policy.model.state_dict().items()}
    trainer.run()
    after = trainer.policy.model.state_dict()
    return trainer, any(not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize(
    ("loss", "perturb", "steps"),
    [
        (LossConfig(), False, 0),  # advantages 0 and nothing else in the loss: skipped
        (LossConfig(entropy_coef=0.01), False, 1),  # the entropy bonus acts whatever the advantage
        (LossConfig(kl_coef=0.1), True, 1),  # the pull towards the reference too
    ],
)
def test_a_flat_group_steps_only_for_the_entropy_or_kl_terms_of_the_loss(
    small_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    loss: LossConfig,
    perturb: bool,
    steps: int,
) -> None:
    """Rewards 0.1 + 0.2 and 0.3, one ulp apart: a flat group (issue 26), advantages exactly 0.
    Before, GRPO gave them +-1e-11 advantages and Adam a full step; and a step skipped for
    zero advantages skipped the entropy bonus and the KL penalty with it."""
    records = episodes(1, "near", (0.1 + 0.2, 0.3), version=0)
    trainer, moved = run_one_group(small_model, tmp_path, monkeypatch, records, perturb=perturb, loss=loss)
    skipped = {"zero_advantage": 1} if steps == 0 else {}
    assert (trainer.state.step, trainer.state.skipped_steps, moved) == (steps, skipped, steps == 1)
    if steps:
        [record] = read(tmp_path / "metrics.jsonl")
        assert record["optimizer_steps"] == 1 and record["grad_norm"] > 0.0


def test_reward_mean_and_the_baseline_average_sessions_not_segments(
    small_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Session a of 2 segments rewarded 1, session b of 1 segment rewarded 0: the sessions'
    mean is 0.5 (the segments' 2/3 was logged before). With reinforce_baseline (b = 0 before
    the first group) the advantages are 1, 1, 0 and the baseline is seeded with 0.5."""
    records = [
        trajectory(1, "a", "g", 1.0, segment=0, num_segments=2, token_ids=[1, 2, 3, 4]),
        trajectory(2, "a", "g", 1.0, segment=1, num_segments=2, token_ids=[1, 2, 5, 6]),
        trajectory(3, "b", "g", 0.0, token_ids=[1, 2, 7, 8]),
    ]
    trainer, moved = run_one_group(
        small_model, tmp_path, monkeypatch, records, estimator="reinforce_baseline"
    )
    [record] = read(tmp_path / "metrics.jsonl")
    assert (record["reward_mean"], record["reward_max"], record["trajectories"]) == (0.5, 1.0, 3)
    assert trainer.state.baseline == 0.5 and moved
    assert loop.session_rewards(records) == [1.0, 0.0]
