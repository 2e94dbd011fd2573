"""Advantage estimators against arithmetic written out by hand."""

from __future__ import annotations

import math

import pytest

from trainer.advantage import Estimator, compute_advantages, turn_advantages, turn_returns, update_baseline

# A group of four rewards used throughout: mean 3, deviations -2, -1, 0, 3.
REWARDS = [1.0, 2.0, 3.0, 6.0]


def test_grpo_divides_by_the_sample_std() -> None:
    # squared deviations 4 + 1 + 0 + 9 = 14; sample variance 14 / (4 - 1)
    std = math.sqrt(14 / 3)
    expected = [-2 / std, -1 / std, 0.0, 3 / std]
    assert compute_advantages(REWARDS, Estimator.GRPO, eps=0.0) == pytest.approx(expected)
    # the population std, sqrt(14 / 4), would give 3 / 1.8708 = 1.6036 for the last one
    assert compute_advantages(REWARDS, Estimator.GRPO, eps=0.0)[3] == pytest.approx(1.3887, abs=1e-4)


def test_grpo_binary_pair_gives_plus_minus_one_over_sqrt_two() -> None:
    # mean 0.5, deviations -0.5 / +0.5, sample std sqrt((0.25 + 0.25) / 1) = 0.7071
    assert compute_advantages([0.0, 1.0], "grpo", eps=0.0) == pytest.approx([-0.7071, 0.7071], abs=1e-4)


def test_grpo_eps_is_added_to_the_std() -> None:
    # std of [0, 1] is sqrt(0.5); with eps = 0.5 the divisor is 0.7071 + 0.5 = 1.2071
    assert compute_advantages([0.0, 1.0], Estimator.GRPO, eps=0.5)[1] == pytest.approx(0.5 / 1.2071, abs=1e-4)


def test_dr_grpo_subtracts_the_mean_only() -> None:
    assert compute_advantages(REWARDS, Estimator.DR_GRPO) == pytest.approx([-2.0, -1.0, 0.0, 3.0])


def test_rloo_subtracts_the_mean_of_the_others() -> None:
    # sum 12: 1 - 11/3, 2 - 10/3, 3 - 9/3, 6 - 6/3
    expected = [1 - 11 / 3, 2 - 10 / 3, 0.0, 6 - 2.0]
    assert compute_advantages(REWARDS, Estimator.RLOO) == pytest.approx(expected)
    # which is n / (n - 1) times the Dr.GRPO advantage: 4/3 * [-2, -1, 0, 3]
    assert compute_advantages(REWARDS, Estimator.RLOO) == pytest.approx([-8 / 3, -4 / 3, 0.0, 4.0])


def test_reinforce_is_the_reward() -> None:
    assert compute_advantages([1.0, -2.0, 0.5], Estimator.REINFORCE) == [1.0, -2.0, 0.5]


def test_reinforce_baseline_subtracts_the_given_baseline() -> None:
    assert compute_advantages([1.0, 3.0, 6.0], Estimator.REINFORCE_BASELINE, baseline=2.0) == (
        pytest.approx([-1.0, 1.0, 4.0])
    )


def test_update_baseline_is_an_ema_of_group_means_seeded_by_the_first() -> None:
    # group mean (1 + 3 + 6) / 3 = 10/3
    assert update_baseline(None, [1.0, 3.0, 6.0], decay=0.9) == pytest.approx(10 / 3)
    # 0.9 * 2 + 0.1 * 10/3 = 1.8 + 0.3333
    assert update_baseline(2.0, [1.0, 3.0, 6.0], decay=0.9) == pytest.approx(2.1333, abs=1e-4)


@pytest.mark.parametrize("estimator", [Estimator.GRPO, Estimator.DR_GRPO, Estimator.RLOO])
def test_group_relative_estimators_give_zero_when_all_rewards_are_equal(
    estimator: Estimator,
) -> None:
    # 0.1 * 3 is not exactly 0.3 in floating point: the result must still be ~0, not noise / eps
    assert compute_advantages([0.1, 0.1, 0.1], estimator) == pytest.approx([0.0, 0.0, 0.0], abs=1e-9)


@pytest.mark.parametrize("estimator", [Estimator.GRPO, Estimator.DR_GRPO, Estimator.RLOO])
def test_group_relative_estimators_give_zero_for_a_group_of_one(estimator: Estimator) -> None:
    assert compute_advantages([3.0], estimator) == [0.0]


def test_reinforce_keeps_the_signal_of_a_group_of_one() -> None:
    assert compute_advantages([3.0], Estimator.REINFORCE) == [3.0]
    assert compute_advantages([3.0], Estimator.REINFORCE_BASELINE, baseline=1.0) == [2.0]


def test_empty_group_non_finite_reward_and_unknown_estimator_are_refused() -> None:
    with pytest.raises(ValueError):
        compute_advantages([], Estimator.GRPO)
    with pytest.raises(ValueError):
        compute_advantages([1.0, math.nan], Estimator.RLOO)
    with pytest.raises(ValueError):
        compute_advantages([1.0], "ppo")
    with pytest.raises(ValueError):
        update_baseline(0.0, [1.0], decay=1.0)


def test_turn_returns_are_the_discounted_reward_to_go_with_the_final_reward_on_the_last_turn() -> None:
    # rewards 1, none, 0.5 and a final 1: 1, 0, 1.5; G_3 = 1.5, G_2 = 0 + 0.5 * 1.5, G_1 = 1 + 0.5 * 0.75
    assert turn_returns([1.0, None, 0.5], 1.0, discount=0.5) == [1.375, 0.75, 1.5]
    assert turn_returns([None, None], 2.0, discount=1.0) == [2.0, 2.0]
    assert turn_returns([], 2.0, discount=1.0) == []
    with pytest.raises(ValueError):
        turn_returns([1.0], 0.0, discount=1.5)


def test_turn_advantages_compare_each_turn_position_across_the_group() -> None:
    # episodes of 3, 3 and 1 turns; Dr.GRPO per position: means 1, 3 and 5
    returns = [[0.0, 2.0, 5.0], [2.0, 4.0, 5.0], [1.0]]
    assert turn_advantages(returns, Estimator.DR_GRPO) == [[-1.0, -1.0, 0.0], [1.0, 1.0, 0.0], [0.0]]
