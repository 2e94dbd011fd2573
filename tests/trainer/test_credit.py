"""Per-turn credit (`--turn-discount`) on a 3-turn episode against values worked out by hand:
the returns run over a session's segments, each turn position is compared across the group,
and every sampled token of a turn carries its turn's advantage."""

from __future__ import annotations

import pytest
import torch

from tests.trainer.builders import turns
from trainer.advantage import Estimator
from trainer.buffer import Group
from trainer.credit import is_flat, step_advantages


def test_a_three_turn_episode_gets_per_turn_advantages_on_its_tokens() -> None:
    # session a: 3 turns over 2 segments, turn rewards 1, none | 0.5, final 1
    #   r~ = 1, 0, 1.5 -> G (gamma 0.5) = 1.375, 0.75, 1.5
    # session b: 3 turns in one segment, turn rewards 0, 0.5, none, final 0
    #   r~ = 0, 0.5, 0 -> G = 0.25, 0.5, 0
    group = Group(
        "g",
        [
            turns(1, "a", [1.0, None], 1.0, segment=0, segments=2),
            turns(2, "a", [0.5], 1.0, segment=1, segments=2),
            turns(3, "b", [0.0, 0.5, None], 0.0),
        ],
    )
    advantages = step_advantages([group], Estimator.DR_GRPO, None, 0.5, length=9)
    # Dr.GRPO per position: means 0.8125, 0.625, 0.75 -> a: +0.5625, +0.125, +0.75; b: the negatives
    a0, a1, a2 = 0.5625, 0.125, 0.75
    expected = [
        [0.0, a0, a0, 0.0, a1, a1, 0.0, 0.0, 0.0],  # segment 0 of a: turns 1 and 2, padded to 9
        [0.0, a2, a2, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # segment 1 of a: its turn 3
        [0.0, -a0, -a0, 0.0, -a1, -a1, 0.0, -a2, -a2],
    ]
    assert advantages.tolist() == [[pytest.approx(v) for v in row] for row in expected]


def test_a_turn_penalty_lowers_that_turns_reward_and_without_a_discount_credit_is_per_episode() -> None:
    group = Group("g", [turns(1, "a", [None, None], 1.0), turns(2, "b", [None, None], 0.0)])
    # gamma 1, no turn rewards: every return is the final reward
    flat = step_advantages([group], Estimator.DR_GRPO, None, 1.0, length=6)
    assert flat.tolist() == [[0.0, 0.5, 0.5, 0.0, 0.5, 0.5], [0.0, -0.5, -0.5, 0.0, -0.5, -0.5]]
    # a KL penalty of 0.2 on a's first turn: G_a = 0.8, 1.0; positions: means 0.4, 0.5
    penalised = step_advantages(
        [group], Estimator.DR_GRPO, None, 1.0, length=6, penalties=[[0.2, 0.0], [0.0, 0.0]]
    )
    assert penalised[0].tolist() == pytest.approx([0.0, 0.4, 0.4, 0.0, 0.5, 0.5])
    per_episode = step_advantages([group], Estimator.DR_GRPO, None, None, length=6)
    assert per_episode.tolist() == [0.5, -0.5] and per_episode.dim() == 1
    assert torch.equal(per_episode, step_advantages([group], Estimator.DR_GRPO, None, None, length=99))


def test_a_group_is_flat_when_every_episode_had_the_same_outcome() -> None:
    same = Group("g", [turns(1, "a", [None, None], 1.0), turns(2, "b", [None, None], 1.0)])
    assert is_flat(same, by_turn=False) and is_flat(same, by_turn=True)
    differs = Group("g", [turns(1, "a", [None], 1.0), turns(2, "b", [None], 0.0)])
    assert not is_flat(differs, by_turn=False)
    # the same final reward, different per-turn rewards: flat only for episode-level credit
    by_turn = Group("g", [turns(1, "a", [0.5, None], 1.0), turns(2, "b", [None, None], 1.0)])
    assert is_flat(by_turn, by_turn=False) and not is_flat(by_turn, by_turn=True)
    alone = Group(
        "g",
        [turns(1, "a", [None], 1.0, segment=0, segments=2), turns(2, "a", [0.5], 1.0, segment=1, segments=2)],
    )
    assert is_flat(alone, by_turn=True)  # one session: nothing to compare with
