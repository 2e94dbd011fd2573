"""Advantage estimators against arithmetic written out by hand."""

from __future__ import annotations

import math
import sys

import pytest

from trainer.advantage import (
    FLAT_RTOL,
    Estimator,
    compute_advantages,
    is_flat,
    turn_advantages,
    turn_returns,
    update_baseline,
)

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
@pytest.mark.parametrize("rewards", [[0.1] * 3, [0.7] * 8, [0.1 + 0.2, 0.3, 0.3]])
def test_a_flat_group_gets_exactly_zero_not_the_rounding_noise_of_its_mean(
    estimator: Estimator, rewards: list[float]
) -> None:
    # issue 26: the plain mean of [0.1] * 3 is 0.1 + 1.4e-17 and of [0.7] * 8 is 0.7 - 1.1e-16;
    # GRPO divided that noise by a std of the same noise plus eps and gave -1.4e-11 each
    # (0.1 + 0.2 is 0.30000000000000004, one ulp from 0.3)
    assert sum(rewards) / len(rewards) != rewards[-1]
    assert compute_advantages(rewards, estimator) == [0.0] * len(rewards)


def test_flat_means_equal_within_a_tolerance_relative_to_the_rewards_scale() -> None:
    assert FLAT_RTOL == 1e-9
    assert is_flat([1.0, 1.0 + 1e-10]) and not is_flat([1.0, 1.0 + 1e-8])
    assert is_flat([1e6, 1e6 + 1e-4]) and not is_flat([1e6, 1e6 + 1e-2])
    # relative: tiny rewards that differ by all of their size are not flat
    assert not is_flat([0.0, 1e-300]) and is_flat([0.0, 0.0]) and is_flat([5.0])
    # just outside the tolerance an estimator sees the difference: Dr.GRPO +-1e-8 / 2
    assert compute_advantages([1.0, 1.0 + 2e-9], Estimator.DR_GRPO) == pytest.approx([-1e-9, 1e-9], rel=1e-6)


def test_reinforce_baseline_gives_zero_for_a_reward_equal_to_the_baseline_within_the_tolerance() -> None:
    # 0.1 + 0.2 - 0.3 is 5.6e-17 in plain arithmetic: noise that Adam would make a full step of
    assert compute_advantages([0.1 + 0.2, 1.3], Estimator.REINFORCE_BASELINE, baseline=0.3) == [
        0.0,
        pytest.approx(1.0),
    ]


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


# Extreme rewards: every estimator is finite for every finite input (issue 26, item 2) -------

MAX = sys.float_info.max
EXTREMES = [
    [1e308, 1e308, 1.0],
    [1e155, 0.0, 1.0, 1.0],
    [MAX, -MAX],
    [MAX, -MAX, -MAX],
    [1e308, -1e308, 5e-324, 1e155],
    [5e-324, 0.0, 0.0],
    [-5e-324, 5e-324],
    [1e-300, 1e300, -1e-300],
    [-1e308] * 4,
    [1e308, 1e308, 1e308, MAX],
]


@pytest.mark.parametrize("estimator", list(Estimator))
@pytest.mark.parametrize("rewards", EXTREMES)
def test_every_estimator_is_finite_for_extreme_finite_rewards(
    estimator: Estimator, rewards: list[float]
) -> None:
    for baseline in (0.0, -1e308, MAX):
        values = compute_advantages(rewards, estimator, baseline=baseline)
        assert len(values) == len(rewards) and all(math.isfinite(v) for v in values), values
    assert math.isfinite(update_baseline(MAX, rewards, decay=0.9))
    assert math.isfinite(update_baseline(None, rewards, decay=0.9))


def test_grpo_of_huge_rewards_is_the_standardised_group_not_nan_or_an_overflow() -> None:
    # [R, R, r] with R >> r: deviations R/3, R/3, -2R/3, sample std R / sqrt(3); issue 26: nan
    third = 1 / math.sqrt(3)
    assert compute_advantages([1e308, 1e308, 1.0], Estimator.GRPO) == pytest.approx(
        [third, third, -2 * third], rel=1e-12
    )
    # [R, 0, 1, 1]: deviations 3R/4, -R/4 (x3), variance (9/16 + 3/16) R^2 / 3 = R^2 / 4, std R/2;
    # issue 26: OverflowError squaring 1e155's deviation
    assert compute_advantages([1e155, 0.0, 1.0, 1.0], Estimator.GRPO) == pytest.approx(
        [1.5, -0.5, -0.5, -0.5], rel=1e-12
    )
    # +-R cancel: mean ~0, deviations R, -R, ~0, ~0, variance 2R^2 / 3
    assert compute_advantages([1e308, -1e308, 5e-324, 1e155], Estimator.GRPO) == pytest.approx(
        [math.sqrt(1.5), -math.sqrt(1.5), 0.0, 0.0], rel=1e-12, abs=1e-150
    )


def test_grpo_of_subnormal_rewards_divides_by_eps_as_the_formula_says() -> None:
    # [t, 0, 0], t = 2^-1074: deviations 2t/3, -t/3, -t/3; the std (~t) is nothing beside eps,
    # so A = deviation / 1e-6 (subnormal, exact to its ulp 2^-1074 ~ 4.9e-324)
    t = 5e-324
    assert compute_advantages([t, 0.0, 0.0], Estimator.GRPO) == pytest.approx(
        [2 * t / 3 / 1e-6, -t / 3 / 1e-6, -t / 3 / 1e-6], rel=1e-5
    )
    # without eps only the ratios count: the binary pair's +-1/sqrt(2)
    assert compute_advantages([-t, t], Estimator.GRPO, eps=0.0) == pytest.approx([-0.70710678, 0.70710678])


def test_differences_past_the_largest_float_saturate_with_their_sign() -> None:
    # Dr.GRPO of [M, -M, -M]: mean -M/3, deviations 4M/3 (past M), -2M/3, -2M/3
    assert compute_advantages([MAX, -MAX, -MAX], Estimator.DR_GRPO) == [
        MAX,
        pytest.approx(-MAX / 3 * 2),
        pytest.approx(-MAX / 3 * 2),
    ]
    # Dr.GRPO of [R, R, 1]: deviations R/3, R/3, -2R/3, all representable
    assert compute_advantages([1e308, 1e308, 1.0], Estimator.DR_GRPO) == pytest.approx(
        [1e308 / 3, 1e308 / 3, -1e308 / 3 * 2], rel=1e-12
    )
    # RLOO of [R, -R]: R - (-R) = 2R > M; of [R, R, 1]: R - (R + 1) / 2 = R/2 and 1 - R
    assert compute_advantages([1e308, -1e308], Estimator.RLOO) == [MAX, -MAX]
    assert compute_advantages([1e308, 1e308, 1.0], Estimator.RLOO) == pytest.approx(
        [5e307, 5e307, -1e308], rel=1e-12
    )
    assert compute_advantages([1e308, -1e308], Estimator.REINFORCE_BASELINE, baseline=-1e308) == [MAX, 0.0]
    assert compute_advantages([1e308, -1e308, 5e-324], Estimator.REINFORCE) == [1e308, -1e308, 5e-324]


def test_the_baseline_of_huge_rewards_is_their_mean_not_inf() -> None:
    # plain sum([1e308, 1e308]) is inf
    assert update_baseline(None, [1e308, 1e308], decay=0.9) == 1e308
    assert update_baseline(None, [MAX, -MAX, 5e-324], decay=0.9) == pytest.approx(5e-324 / 3, abs=5e-324)
    assert update_baseline(MAX, [MAX], decay=0.9) == pytest.approx(MAX)


def test_turn_returns_of_huge_rewards_are_exact_where_representable_and_saturate_past_it() -> None:
    # r~ = 1e308, -1e308 + 1e308 = 0: G = 1e308 + 0, 0 (plain left-to-right: exact here too)
    assert turn_returns([1e308, -1e308], 1e308, discount=1.0) == [1e308, 0.0]
    # r~ = 1e308, 1e308 + 1e308: G_2 = 2e308 and G_1 = 3e308, past the largest float
    assert turn_returns([1e308, 1e308], 1e308, discount=1.0) == [MAX, MAX]
    # gamma 0.5, a final -1e308: r~ = 1e308, 0; G_2 = 0, G_1 = 1e308 + 0.5 * 0
    assert turn_returns([1e308, 1e308], -1e308, discount=0.5) == [pytest.approx(1e308), 0.0]
    assert turn_returns([5e-324, None], 5e-324, discount=1.0) == [1e-323, 5e-324]
    # per position over extreme returns: GRPO of each position's pair is +-1/sqrt(2)
    returns = [turn_returns([1e308, 1e308], 1e308, 1.0), turn_returns([None, None], -1e308, 1.0)]
    half = 1 / math.sqrt(2)
    assert turn_advantages(returns, Estimator.GRPO) == [
        [pytest.approx(half), pytest.approx(half)],
        [pytest.approx(-half), pytest.approx(-half)],
    ]
