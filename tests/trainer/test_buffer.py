"""Whole sessions, complete groups, stragglers, unrewarded sessions, and the checkpoint's
exactly-once state."""

from __future__ import annotations

import json

import pytest

from tests.trainer.builders import session, trajectory
from trainer import checkpoint
from trainer.advantage import Estimator
from trainer.buffer import GroupBuffer
from trainer.credit import group_advantages


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_group_is_released_when_it_has_group_size_sessions():
    buffer = GroupBuffer(group_size=2, timeout_s=10, clock=Clock())
    for t in session(1, "s1", "g", 1.0, segments=2):
        buffer.add(t)
    assert buffer.pop_ready() == []
    buffer.add(trajectory(3, "s2", "g"))
    [group] = buffer.pop_ready()
    assert [t.seq for t in group.trajectories] == [1, 2, 3] and group.sessions == ["s1", "s2"]
    assert buffer.pending() == []


def test_a_group_is_released_only_with_every_segment_of_its_sessions():
    """group_size 2, session a (1 segment), session b (3 segments): one group, all of b in it,
    each segment with b's advantage (not [a:0, b:0] now and [b:1, b:2] later at advantage 0)."""
    buffer = GroupBuffer(group_size=2, timeout_s=10, clock=Clock())
    released = []
    for t in session(1, "a", "g", 1.0, segments=1) + session(2, "b", "g", 0.0, segments=3):
        buffer.add(t)
        released += buffer.pop_ready()  # as the loop does, after every trajectory
    [group] = released
    assert [(t.session_id, t.segment) for t in group.trajectories] == [("a", 0), ("b", 0), ("b", 1), ("b", 2)]
    assert group_advantages(released, Estimator.DR_GRPO, None) == [0.5, -0.5, -0.5, -0.5]
    assert buffer.pending() == []


def test_a_session_still_arriving_is_pending_and_not_counted():
    buffer = GroupBuffer(group_size=1, timeout_s=0, clock=Clock())
    first, second = session(7, "b", "g", 1.0, segments=2)
    buffer.add(first)
    assert buffer.pop_ready() == [] and buffer.pending() == [first]  # even past the timeout
    buffer.add(second)
    [group] = buffer.pop_ready()
    assert group.trajectories == [first, second]


def test_stragglers_are_released_after_the_timeout_and_counted():
    clock = Clock()
    buffer = GroupBuffer(group_size=3, timeout_s=5, clock=clock)
    buffer.add(trajectory(1, "s1", "slow"))
    clock.now = 4.9
    assert buffer.pop_ready() == []
    clock.now = 5.0
    [group] = buffer.pop_ready()
    assert group.group_id == "slow" and buffer.timed_out == 1


def test_unrewarded_trajectories_are_never_buffered():
    buffer = GroupBuffer(group_size=1, timeout_s=5, clock=Clock())
    buffer.add(trajectory(1, "s1", "g", reward=None))
    assert buffer.pop_ready() == [] and buffer.skipped_unrewarded == 1


def test_advantages_are_per_session_and_shared_by_its_segments():
    buffer = GroupBuffer(group_size=2, timeout_s=5, clock=Clock())
    for t in session(1, "a", "g", 1.0, segments=2) + session(3, "b", "g", 0.0, segments=1):
        buffer.add(t)
    groups = buffer.pop_ready()
    # Dr.GRPO: r - mean over the two sessions (1.0, 0.0) -> +0.5 / -0.5; "a" has two segments.
    assert group_advantages(groups, Estimator.DR_GRPO, None) == [0.5, 0.5, -0.5]


def test_a_kl_penalty_in_the_reward_is_subtracted_per_session_before_the_baseline():
    buffer = GroupBuffer(group_size=2, timeout_s=5, clock=Clock())
    for t in session(1, "a", "g", 1.0, segments=2) + session(3, "b", "g", 0.0, segments=1):
        buffer.add(t)
    groups = buffer.pop_ready()
    # a: 1.0 - (0.1 + 0.2) = 0.7 over its two segments; b: 0.0 - 0.1; mean 0.3
    penalties = [[0.1], [0.2], [0.1]]
    advantages = group_advantages(groups, Estimator.DR_GRPO, None, penalties=penalties)
    assert advantages == pytest.approx([0.4, 0.4, -0.4])


def test_checkpoint_round_trip_keeps_cursor_pending_and_history(tmp_path):
    state = checkpoint.TrainerState(
        step=3,
        version=3,
        optimizer_steps=6,
        cursors=[42, 7],
        pending=session(40, "s", "g", 1.0, segments=2),
        trained=[["s1:0", "s2:0"]],
        consumed=["s3:0"],
        skipped_steps={"stale": 1},
        dropped_stale_groups=2,
    )
    checkpoint.save(tmp_path / "ckpt", state, {"weights": [1.0, 2.0]})
    restored, policy_state = checkpoint.load(tmp_path / "ckpt")
    assert restored == state and policy_state == {"weights": [1.0, 2.0]}
    assert restored.pending[1].num_segments == 2  # Trajectory objects, not the JSON dicts
    state.step = 4
    checkpoint.save(tmp_path / "ckpt", state, {"weights": [3.0]})  # replaces the previous one whole
    assert checkpoint.load(tmp_path / "ckpt")[0].step == 4
    assert not (tmp_path / "ckpt.tmp").exists() and not (tmp_path / "ckpt.old").exists()


def test_a_single_cursor_checkpoint_loads_as_the_first_proxys_and_a_proxy_added_reads_from_its_start(
    tmp_path,
):
    """A checkpoint from before several proxies (one `cursor`, seqs as ids): the cursor is the
    first proxy's; a proxy added at the end starts at 0; following fewer proxies is refused
    (a cursor, and where that proxy's stream was left, would be lost)."""
    old = {
        "step": 2,
        "version": 2,
        "cursor": 17,
        "pending": [trajectory(16, "s16").to_json()],
        "trained": [[1, 2], [5, 6]],
        "consumed": [3, 4],
    }
    folder = tmp_path / "ckpt"
    checkpoint.save(folder, checkpoint.TrainerState(), {"weights": [1.0]})
    (folder / "state.json").write_text(json.dumps(old))
    state, _ = checkpoint.load(folder)
    assert (state.cursors, state.step, state.trained, state.consumed) == ([17], 2, [[1, 2], [5, 6]], [3, 4])
    assert [t.seq for t in state.pending] == [16]
    state.follow(1)
    assert state.cursors == [17]
    state.follow(3)
    assert state.cursors == [17, 0, 0]
    with pytest.raises(ValueError, match="the checkpoint follows 3 proxies and this run 2"):
        state.follow(2)
    fresh = checkpoint.TrainerState()
    fresh.follow(2)
    assert fresh.cursors == [0, 0]


def test_no_checkpoint_means_a_fresh_start(tmp_path):
    assert checkpoint.load(tmp_path / "none") is None


def test_group_size_must_be_positive():
    with pytest.raises(ValueError):
        GroupBuffer(group_size=0, timeout_s=1)
