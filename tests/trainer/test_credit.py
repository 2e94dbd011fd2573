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


def test_extreme_turn_rewards_and_an_overflowed_penalty_give_finite_advantages() -> None:
    # a: turn rewards 1e308, 1e308, final 1e308 -> G = 3e308, 2e308, both past the largest
    # float: saturated at M; b: none, none, final -1e308 -> G = -1e308, -1e308. GRPO of each
    # position's pair is +-1/sqrt(2) whatever its size.
    group = Group("g", [turns(1, "a", [1e308, 1e308], 1e308), turns(2, "b", [None, None], -1e308)])
    half = 0.7071067690849304  # 1/sqrt(2) in float32, as the step's tensor holds it
    per_turn = step_advantages([group], Estimator.GRPO, None, 1.0, length=6)
    assert per_turn.tolist() == [[0.0, half, half, 0.0, half, half], [0.0, -half, -half, 0.0, -half, -half]]
    # a penalty that overflowed to inf (a float32 sum of KL terms) counts as the largest float:
    # a's reward 1 - M, not -inf (and nan in the estimator); a is then the worse of the pair
    plain = Group("g", [turns(1, "a", [None, None], 1.0), turns(2, "b", [None, None], 0.0)])
    penalties = [[float("inf"), 0.0], [0.0, 0.0]]
    per_episode = step_advantages([plain], Estimator.GRPO, None, None, length=6, penalties=penalties)
    assert per_episode.tolist() == [-half, half]
    # per turn, Dr.GRPO: G_a = 1 - M, 1 and G_b = 0, 0; position 1: -M/2 and +M/2, past float32's
    # largest F, where the step's float32 tensor saturates; position 2: +-0.5
    per_turn = step_advantages([plain], Estimator.DR_GRPO, None, 1.0, length=6, penalties=penalties)
    big = torch.finfo(torch.float32).max
    assert per_turn.tolist() == [[0.0, -big, -big, 0.0, 0.5, 0.5], [0.0, big, big, 0.0, -0.5, -0.5]]


def test_a_group_whose_outcomes_differ_only_by_rounding_is_flat() -> None:
    # 0.1 + 0.2 is 0.30000000000000004, one ulp from 0.3: the same outcome, as the estimators see it
    near = Group("g", [turns(1, "a", [0.1 + 0.2, None], 1.0), turns(2, "b", [0.3, 0.0], 1.0 - 1e-12)])
    assert is_flat(near, by_turn=True) and is_flat(near, by_turn=False)
    assert step_advantages([near], Estimator.GRPO, None, 1.0, length=6).tolist() == [[0.0] * 6] * 2
    apart = Group("g", [turns(1, "a", [0.3, None], 1.0), turns(2, "b", [0.3, None], 1.0 - 1e-6)])
    assert not is_flat(apart, by_turn=False)
    # a different number of turns is a different outcome, whatever the rewards
    longer = Group("g", [turns(1, "a", [None], 1.0), turns(2, "b", [None, None], 1.0)])
    assert is_flat(longer, by_turn=False) and not is_flat(longer, by_turn=True)
