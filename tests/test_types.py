"""The contract's JSON form: what the stream, the exports and the trainer's checkpoint carry."""

from __future__ import annotations

from molt_proxy.types import SessionStatus, Trajectory, Turn
from tests.trainer.builders import trajectory


def test_a_trajectory_survives_its_json_form_as_the_same_typed_record():
    record = trajectory(5, "s", "g", 0.5, segment=1, num_segments=3)
    back = Trajectory.from_json(record.to_json())
    assert back == record
    assert isinstance(back.turns[0], Turn) and back.status is SessionStatus.REWARDED


def test_keys_a_newer_proxy_adds_are_ignored_and_a_record_without_num_segments_reads_one():
    data = trajectory(5).to_json()
    data["a_future_field"] = 1
    data["turns"][0]["a_future_turn_field"] = {"x": 1}
    del data["num_segments"]
    back = Trajectory.from_json(data)
    assert back.num_segments == 1 and back.turns == trajectory(5).turns
