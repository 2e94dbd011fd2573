"""The policy loss against values worked out by hand on batches of 2 sequences x 2-3 tokens.

Ratios are chosen first and turned into log probabilities around a base of -1, so every
expected number below is plain arithmetic on the ratios.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import Tensor

from trainer.loss import LossConfig, count_loss_tokens, kl_estimate, loss_denominator, policy_loss
from trainer.sampling import OUTSIDE_SUPPORT, TokenSampling, kept_tokens, processed_logprobs

BASE = -1.0
# Symmetric clipping and no staleness bound, for the tests that are about something else.
PLAIN = LossConfig(clip_low=0.2, clip_high=0.2, max_staleness=None)


def logprobs_at(ratios: list[list[float]], *, grad: bool = False) -> Tensor:
    """[B,T] log probabilities whose ratio to a constant BASE policy is `ratios`."""
    out = torch.tensor(ratios, dtype=torch.float64).log() + BASE
    return out.requires_grad_(grad)


def base(batch: int, length: int) -> Tensor:
    return torch.full((batch, length), BASE, dtype=torch.float64)


def ones(batch: int, length: int) -> Tensor:
    return torch.ones(batch, length, dtype=torch.long)


def adv(*values: float) -> Tensor:
    return torch.tensor(values, dtype=torch.float64)


def versions(mask: Tensor, version: int = 0) -> Tensor:
    """[B,T] weight versions: `version` on sampled tokens, -1 on prompt tokens."""
    return torch.where(mask.bool(), version, -1)


# On-policy: every ratio is 1 ---------------------------------------------------------------


def test_on_policy_loss_is_minus_mean_advantage_over_sampled_tokens() -> None:
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    logprobs = base(2, 3).requires_grad_()
    loss, metrics = policy_loss(logprobs, base(2, 3), adv(2.0, -1.0), mask, versions(mask), 0, PLAIN)
    # sampled tokens: two with A = 2, one with A = -1; (-2 - 2 + 1) / 3
    assert loss.item() == pytest.approx(-1.0)
    loss.backward()
    # d loss / d logprob = -A * r / N with r = 1, N = 3; prompt tokens get nothing
    expected = [[0.0, -2 / 3, -2 / 3], [0.0, 1 / 3, 0.0]]
    assert torch.allclose(logprobs.grad, torch.tensor(expected, dtype=torch.float64))
    assert metrics["kept_tokens"] == 3.0
    assert metrics["clip_frac_low"] == metrics["clip_frac_high"] == 0.0
    assert metrics["is_ratio_mean"] == metrics["is_ratio_max"] == pytest.approx(1.0)
    assert metrics["approx_kl"] == pytest.approx(0.0)


def test_per_token_advantages_match_broadcast_per_sequence_ones() -> None:
    mask = ones(2, 3)
    logprobs = logprobs_at([[1.5, 0.5, 1.0], [0.7, 1.1, 1.4]])
    per_seq, _ = policy_loss(logprobs, base(2, 3), adv(2.0, -1.0), mask, versions(mask), 0, PLAIN)
    per_token_adv = torch.tensor([[2.0] * 3, [-1.0] * 3], dtype=torch.float64)
    per_token, _ = policy_loss(logprobs, base(2, 3), per_token_adv, mask, versions(mask), 0, PLAIN)
    assert per_token.item() == pytest.approx(per_seq.item())


# PPO clipping -----------------------------------------------------------------------------


def test_clipping_on_both_sides_with_positive_and_negative_advantages() -> None:
    config = LossConfig(clip_low=0.2, clip_high=0.3, max_staleness=None)  # r kept in [0.8, 1.3]
    mask = ones(2, 2)
    # seq 0 has A = +2, seq 1 has A = -1; the old policy is also the rollout policy
    logprobs = logprobs_at([[1.5, 0.5], [0.5, 1.5]], grad=True)
    loss, metrics = policy_loss(
        logprobs,
        base(2, 2),
        adv(2.0, -1.0),
        mask,
        versions(mask),
        0,
        config,
        old_logprobs=base(2, 2),
    )
    # A=+2, r=1.5: min(3.0, 2.6) = 2.6   -> -2.6  clipped high at 1.3, no gradient
    # A=+2, r=0.5: min(1.0, 1.6) = 1.0   -> -1.0  unclipped
    # A=-1, r=0.5: min(-0.5, -0.8) = -0.8 -> +0.8  clipped low at 0.8, no gradient
    # A=-1, r=1.5: min(-1.5, -1.3) = -1.5 -> +1.5  unclipped: a bad token gets no trust region
    # (swapped bounds, [0.7, 1.2], would give (-2.4 - 1.0 + 0.7 + 1.5) / 4 instead)
    assert loss.item() == pytest.approx((-2.6 - 1.0 + 0.8 + 1.5) / 4)
    loss.backward()
    # unclipped: d(-A * r / 4) / d logprob = -A * r / 4
    expected = [[0.0, -2 * 0.5 / 4], [0.0, 1.5 / 4]]
    assert torch.allclose(logprobs.grad, torch.tensor(expected, dtype=torch.float64))
    assert metrics["clip_frac_high"] == pytest.approx(1 / 4)
    assert metrics["clip_frac_low"] == pytest.approx(1 / 4)


def test_loss_gradient_raises_good_tokens_and_lowers_bad_ones() -> None:
    # a tiny policy: uniform logits over 4 token ids at each of 2 x 3 positions
    logits = torch.zeros(2, 3, 4, dtype=torch.float64, requires_grad=True)
    tokens = torch.tensor([[0, 1, 2], [3, 3, 3]])

    def sampled_logprobs() -> Tensor:
        return logits.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

    rollout = sampled_logprobs().detach()  # log(1/4) everywhere
    mask = ones(2, 3)
    loss, _ = policy_loss(sampled_logprobs(), rollout, adv(1.0, -1.0), mask, versions(mask), 0, PLAIN)
    loss.backward()
    # d(-A * logp / 6) / d logit: sampled id -A * (1 - 1/4) / 6, every other id +A * (1/4) / 6
    assert logits.grad[0, 0, 0].item() == pytest.approx(-0.75 / 6)
    assert logits.grad[0, 0, 1].item() == pytest.approx(0.25 / 6)
    assert logits.grad[1, 0, 3].item() == pytest.approx(0.75 / 6)
    with torch.no_grad():
        logits -= 1.0 * logits.grad
    after = sampled_logprobs()
    assert (after[0] > rollout[0]).all()  # A > 0: more likely
    assert (after[1] < rollout[1]).all()  # A < 0: less likely


def test_sequence_ratio_clips_each_sequence_as_one_gspo() -> None:
    token_level = LossConfig(clip_low=0.2, clip_high=0.2, loss_agg="seq-mean-token-mean", max_staleness=None)
    config = dataclasses.replace(token_level, ratio_level="sequence")
    mask = ones(3, 2)
    # pi / pi_old per token; s = geometric mean per sequence: 1, 2, 0.5
    logprobs = logprobs_at([[2.0, 0.5], [4.0, 1.0], [0.25, 1.0]], grad=True)
    loss, metrics = policy_loss(
        logprobs, base(3, 2), adv(1.0, 1.0, -1.0), mask, versions(mask), 0, config, old_logprobs=base(3, 2)
    )
    # s=1, A=+1: -1 (token level would clip the 2 to 1.2: -(1.2 + 0.5) / 2)
    # s=2, A=+1: min(2, 1.2) -> -1.2, clipped high as a whole; s=0.5, A=-1: min(-0.5, -0.8) -> +0.8
    assert loss.item() == pytest.approx((-1 - 1.2 + 0.8) / 3)
    loss.backward()
    # only sequence 0 has a gradient: d(-s / 3) / d pi_t = -(s / 2) / 3 for each of its 2 tokens
    expected = [[-1 / 6, -1 / 6], [0.0, 0.0], [0.0, 0.0]]
    assert torch.allclose(logprobs.grad, torch.tensor(expected, dtype=torch.float64))
    assert metrics["clip_frac_high"] == pytest.approx(2 / 6)
    assert metrics["clip_frac_low"] == pytest.approx(2 / 6)

    advantages, old = adv(1.0, 1.0, -1.0), base(3, 2)
    per_token, _ = policy_loss(
        logprobs, base(3, 2), advantages, mask, versions(mask), 0, token_level, old_logprobs=old
    )
    # per token: (-(1.2 + 0.5) / 2 - (1.2 + 1) / 2 + (0.8 + 1) / 2) / 3
    assert per_token.item() == pytest.approx((-1.7 / 2 - 2.2 / 2 + 1.8 / 2) / 3)


# Train/rollout importance weights ------------------------------------------------------------


def test_token_truncation_caps_each_ratio_at_is_high() -> None:
    config = LossConfig(is_mode="truncate", is_level="token", is_high=2.0, max_staleness=None)
    mask = ones(2, 3)
    # pi = pi_old (no PPO clipping); pi_old / mu per token:
    old = logprobs_at([[3.0, 1.0, 0.5], [1.0, 1.0, 1.0]])
    logprobs = old.clone().requires_grad_()
    loss, metrics = policy_loss(
        logprobs, base(2, 3), adv(1.0, -1.0), mask, versions(mask), 0, config, old_logprobs=old
    )
    # weights min(ratio, 2) = [2, 1, 0.5], [1, 1, 1]; token loss -w * A
    assert loss.item() == pytest.approx((-2 - 1 - 0.5 + 1 + 1 + 1) / 6)
    loss.backward()
    assert logprobs.grad[0, 0].item() == pytest.approx(-2 / 6)  # the weight scales the gradient
    assert metrics["is_ratio_mean"] == pytest.approx((3 + 1 + 0.5 + 3) / 6)
    assert metrics["is_ratio_max"] == pytest.approx(3.0)
    assert metrics["is_truncated_frac"] == pytest.approx(1 / 6)
    assert metrics["is_masked_frac"] == 0.0


def test_token_mask_zeroes_tokens_outside_the_bounds_but_keeps_them_in_n() -> None:
    config = LossConfig(is_mode="mask", is_level="token", is_low=0.5, is_high=2.0, max_staleness=None)
    mask = ones(2, 3)
    old = logprobs_at([[3.0, 1.0, 0.4], [1.0, 1.5, 1.0]])
    loss, metrics = policy_loss(
        old.clone(), base(2, 3), adv(1.0, -1.0), mask, versions(mask), 0, config, old_logprobs=old
    )
    # weights [0, 1, 0], [1, 1.5, 1]: -1 + (1 + 1.5 + 1), still over all 6 tokens
    assert loss.item() == pytest.approx((-1 + 3.5) / 6)
    assert metrics["is_masked_frac"] == pytest.approx(2 / 6)
    assert metrics["is_truncated_frac"] == 0.0


def test_sequence_truncation_uses_the_geometric_mean_over_sampled_tokens() -> None:
    config = LossConfig(is_mode="truncate", is_level="sequence", is_high=2.0, max_staleness=None)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # seq 0: (4 * 1 * 0.25) ** (1/3) = 1, though one token alone is 4
    # seq 1: (9 * 1) ** (1/2) = 3, capped to 2; the 999 is a prompt token and must not count
    old = logprobs_at([[4.0, 1.0, 0.25], [9.0, 1.0, 999.0]])
    loss, metrics = policy_loss(
        old.clone(), base(2, 3), adv(1.0, 1.0), mask, versions(mask), 0, config, old_logprobs=old
    )
    assert loss.item() == pytest.approx((-1 * 3 - 2 * 2) / 5)
    assert metrics["is_ratio_mean"] == pytest.approx((1 * 3 + 3 * 2) / 5)
    assert metrics["is_ratio_max"] == pytest.approx(3.0)
    assert metrics["is_truncated_frac"] == pytest.approx(2 / 5)


def test_sequence_mask_drops_whole_sequences() -> None:
    config = LossConfig(is_mode="mask", is_level="sequence", is_low=0.5, is_high=2.0, max_staleness=None)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    old = logprobs_at([[4.0, 1.0, 0.25], [9.0, 1.0, 999.0]])
    loss, metrics = policy_loss(
        old.clone(), base(2, 3), adv(1.0, 1.0), mask, versions(mask), 0, config, old_logprobs=old
    )
    # seq 0 (ratio 1) is kept whole, though token level would drop its 4 and 0.25;
    # seq 1 (ratio 3) is dropped whole; N stays 5
    assert loss.item() == pytest.approx(-3 / 5)
    assert metrics["is_masked_frac"] == pytest.approx(2 / 5)


def test_without_old_logprobs_ppo_clips_against_the_rollout_and_weights_are_one() -> None:
    config = LossConfig(clip_low=0.2, clip_high=0.2, max_staleness=None)
    mask = ones(1, 2)
    loss, metrics = policy_loss(
        logprobs_at([[1.5, 1.0]]), base(1, 2), adv(1.0), mask, versions(mask), 0, config
    )
    # r = pi / mu = [1.5, 1]: min(1.5, 1.2) = 1.2 and 1
    assert loss.item() == pytest.approx(-(1.2 + 1.0) / 2)
    assert metrics["is_ratio_max"] == pytest.approx(1.0)
    assert metrics["clip_frac_high"] == pytest.approx(1 / 2)


def test_approx_kl_is_the_k3_estimate_against_the_rollout() -> None:
    mask = ones(1, 2)
    _, metrics = policy_loss(logprobs_at([[2.0, 1.0]]), base(1, 2), adv(1.0), mask, versions(mask), 0, PLAIN)
    # rho - 1 - log rho: 2 - 1 - log 2 = 0.3069 and 0
    assert metrics["approx_kl"] == pytest.approx((1 - math.log(2)) / 2)


def test_entropy_is_logged_and_its_bonus_subtracted_per_kept_token() -> None:
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    entropy = torch.tensor([[9.0, 1.0, 2.0], [9.0, 3.0, 9.0]], dtype=torch.float64, requires_grad=True)
    args = (base(2, 3), base(2, 3), adv(1.0, -1.0), mask, versions(mask), 0)
    loss, metrics = policy_loss(*args, PLAIN, entropy=entropy)
    # no bonus: (-1 - 1 + 1) / 3; the entropy mean is over the 3 sampled tokens, not the 9s
    assert loss.item() == pytest.approx(-1 / 3)
    assert metrics["entropy"] == pytest.approx((1 + 2 + 3) / 3)
    bonus, _ = policy_loss(*args, dataclasses.replace(PLAIN, entropy_coef=0.1), entropy=entropy)
    assert bonus.item() == pytest.approx(-1 / 3 - 0.1 * (1 + 2 + 3) / 3)
    bonus.backward()
    expected = [[0.0, -0.1 / 3, -0.1 / 3], [0.0, -0.1 / 3, 0.0]]  # d(-0.1 * H_t / 3) / d H_t
    assert torch.allclose(entropy.grad, torch.tensor(expected, dtype=torch.float64))


# KL to the reference -------------------------------------------------------------------------

LN2 = math.log(2)


@pytest.mark.parametrize(
    ("estimator", "expected"),
    # x = log ref - log pi = +log 2 and -log 2
    [("k1", [-LN2, LN2]), ("k2", [LN2**2 / 2, LN2**2 / 2]), ("k3", [2 - 1 - LN2, 0.5 - 1 + LN2])],
)
def test_kl_estimators(estimator: str, expected: list[float]) -> None:
    ref = logprobs_at([[2.0, 0.5]])
    assert kl_estimate(base(1, 2), ref, estimator)[0].tolist() == pytest.approx(expected)


def test_kl_in_the_loss_adds_beta_k_per_kept_token_and_is_logged_either_way() -> None:
    mask = torch.tensor([[0, 1, 1]])
    ref = logprobs_at([[99.0, 2.0, 0.5]])  # the prompt token's 99 must not count
    logprobs = base(1, 3).requires_grad_()
    config = LossConfig(kl_coef=0.1, kl_estimator="k3", max_staleness=None)
    loss, metrics = policy_loss(
        logprobs, base(1, 3), adv(0.0), mask, versions(mask), 0, config, ref_logprobs=ref
    )
    k3 = [2 - 1 - LN2, 0.5 - 1 + LN2]  # 0.3069 and 0.1931: mean 0.25
    assert loss.item() == pytest.approx(0.1 * sum(k3) / 2)
    assert metrics["kl_ref"] == pytest.approx(sum(k3) / 2)
    loss.backward()
    # d k3 / d log pi = 1 - ref / pi: -1 and 0.5, times beta / N
    assert torch.allclose(logprobs.grad, torch.tensor([[0.0, -0.1 / 2, 0.05 / 2]], dtype=torch.float64))

    in_reward = dataclasses.replace(config, kl_in="reward")
    loss, metrics = policy_loss(
        base(1, 3), base(1, 3), adv(0.0), mask, versions(mask), 0, in_reward, ref_logprobs=ref
    )
    assert loss.item() == 0.0 and metrics["kl_ref"] == pytest.approx(0.25)


# Staleness --------------------------------------------------------------------------------


def test_tokens_beyond_max_staleness_are_withheld_and_counted() -> None:
    config = LossConfig(max_staleness=2)
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    weight_versions = torch.tensor([[5, 3, 2], [-1, 4, 1]])
    # at version 5 the ages are [0, 2, 3], [-, 1, 4]: the ages 3 and 4 are too old
    logprobs = base(2, 3).requires_grad_()
    loss, metrics = policy_loss(logprobs, base(2, 3), adv(1.0, -1.0), mask, weight_versions, 5, config)
    assert metrics["stale_tokens"] == 2.0
    assert count_loss_tokens(mask, weight_versions, 5, config) == 3
    assert loss.item() == pytest.approx((-1 - 1 + 1) / 3)
    loss.backward()
    assert logprobs.grad[0, 2].item() == 0.0
    assert logprobs.grad[1, 2].item() == 0.0

    unbounded, metrics = policy_loss(base(2, 3), base(2, 3), adv(1.0, -1.0), mask, weight_versions, 5, PLAIN)
    assert metrics["stale_tokens"] == 0.0
    assert unbounded.item() == pytest.approx((-3 + 2) / 5)


def test_a_step_of_only_stale_tokens_gives_zero_loss_and_gradient() -> None:
    mask = ones(1, 2)
    logprobs = base(1, 2).requires_grad_()
    loss, metrics = policy_loss(logprobs, base(1, 2), adv(1.0), mask, versions(mask, 0), 9, LossConfig())
    loss.backward()
    assert loss.item() == 0.0
    assert logprobs.grad.abs().sum().item() == 0.0
    assert metrics["stale_tokens"] == 2.0
    assert metrics["is_ratio_max"] == 0.0


# Token-level aggregation across micro-batches ------------------------------------------------


def test_micro_batches_divide_by_the_step_token_count() -> None:
    # micro-batch 1: one token with loss -1; micro-batch 2: three tokens with loss +1 each
    mask_1, mask_2 = torch.tensor([[1, 0, 0]]), ones(1, 3)
    part_1, _ = policy_loss(
        base(1, 3), base(1, 3), adv(1.0), mask_1, versions(mask_1), 0, PLAIN, denominator=4
    )
    part_2, _ = policy_loss(
        base(1, 3), base(1, 3), adv(-1.0), mask_2, versions(mask_2), 0, PLAIN, denominator=4
    )
    # (-1 + 3) / 4, where averaging the two micro-batch means would give (-1 + 1) / 2 = 0
    assert (part_1 + part_2).item() == pytest.approx(0.5)


@pytest.mark.parametrize(
    "config",
    [
        LossConfig(max_staleness=1),
        LossConfig(is_mode="mask", is_level="sequence", is_low=0.8, is_high=1.25, max_staleness=1),
        LossConfig(max_staleness=1, loss_agg="seq-mean-token-sum"),
        LossConfig(max_staleness=1, loss_agg="seq-mean-token-mean"),
    ],
)
def test_micro_batch_losses_and_gradients_add_up_to_the_whole_batch(config: LossConfig) -> None:
    generator = torch.Generator().manual_seed(0)
    shape = (4, 5)
    logprobs = (-torch.rand(shape, generator=generator, dtype=torch.float64)).requires_grad_()
    old = logprobs.detach() + 0.5 * torch.randn(shape, generator=generator, dtype=torch.float64)
    rollout = old + 0.3 * torch.randn(shape, generator=generator, dtype=torch.float64)
    advantages = torch.randn(4, generator=generator, dtype=torch.float64)
    mask = torch.tensor([[0, 1, 0, 0, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 0], [0, 1, 1, 1, 1]])
    weight_versions = torch.where(mask.bool(), torch.tensor([[3], [2], [1], [3]]), -1)

    def run(rows: slice, num_tokens: int | None) -> tuple[Tensor, dict[str, float]]:
        return policy_loss(
            logprobs[rows],
            rollout[rows],
            advantages[rows],
            mask[rows],
            weight_versions[rows],
            3,
            config,
            old_logprobs=old[rows],
            denominator=num_tokens,
        )

    whole, metrics = run(slice(0, 4), None)
    assert metrics["stale_tokens"] == 4.0  # sequence 2 is two versions old
    (whole_grad,) = torch.autograd.grad(whole, logprobs)

    parts = [slice(0, 1), slice(1, 4)]
    step_tokens = sum(loss_denominator(mask[p], weight_versions[p], 3, config) for p in parts)
    # kept tokens 1 + 3 + 0 + 4, or the 3 sequences with a kept token (the stale one is not)
    assert step_tokens == (8 if config.loss_agg == "token-mean" else 3)
    summed = sum(run(p, step_tokens)[0] for p in parts)
    (summed_grad,) = torch.autograd.grad(summed, logprobs)
    assert summed.item() == pytest.approx(whole.item())
    assert torch.allclose(summed_grad, whole_grad)
    assert whole_grad.abs().sum() > 0

    # the naive mean of micro-batch means differs (1 token vs 7), so the test can fail
    naive = sum(run(p, None)[0] for p in parts) / len(parts)
    assert naive.item() != pytest.approx(whole.item())


# Loss aggregation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("agg", "expected_loss", "grads"),
    [
        # 4 kept tokens; terms -1, -1, -1 (A = 1) and +2 (A = -2), each over D = 4
        ("token-mean", (-3 + 2) / 4, (-1 / 4, 2 / 4)),
        # sums per sequence -3 and +2, over D = 2 sequences
        ("seq-mean-token-sum", (-3 + 2) / 2, (-1 / 2, 2 / 2)),
        # means per sequence -1 and +2, over D = 2: each token of seq 0 weighs 1/3
        ("seq-mean-token-mean", (-1 + 2) / 2, (-1 / 6, 2 / 2)),
    ],
)
def test_loss_aggregation_normalises_as_documented(
    agg: str, expected_loss: float, grads: tuple[float, float]
) -> None:
    config = LossConfig(clip_low=0.2, clip_high=0.2, max_staleness=None, loss_agg=agg)  # type: ignore[arg-type]
    mask = torch.tensor([[1, 1, 1], [0, 1, 0]])
    logprobs = base(2, 3).requires_grad_()
    loss, _ = policy_loss(logprobs, base(2, 3), adv(1.0, -2.0), mask, versions(mask), 0, config)
    assert loss.item() == pytest.approx(expected_loss)
    assert loss_denominator(mask, versions(mask), 0, config) == (4 if agg == "token-mean" else 2)
    loss.backward()
    seq_0, seq_1 = grads
    expected = [[seq_0, seq_0, seq_0], [0.0, seq_1, 0.0]]
    assert torch.allclose(logprobs.grad, torch.tensor(expected, dtype=torch.float64))


# Robustness and validation ----------------------------------------------------------------


@pytest.mark.parametrize("with_kl", [False, True])
def test_padding_with_extreme_values_leaves_loss_and_gradient_finite(with_kl: bool) -> None:
    mask = torch.tensor([[1, 0], [1, 0]])
    logprobs = torch.tensor([[BASE, 1e4], [BASE, -math.inf]], dtype=torch.float64, requires_grad=True)
    rollout = torch.tensor([[BASE, 0.0], [BASE, 0.0]], dtype=torch.float64)
    config = dataclasses.replace(PLAIN, kl_coef=0.1) if with_kl else PLAIN
    ref = rollout if with_kl else None
    loss, metrics = policy_loss(
        logprobs, rollout, adv(1.0, 1.0), mask, versions(mask), 0, config, ref_logprobs=ref
    )
    loss.backward()
    assert loss.item() == pytest.approx(-1.0)
    assert torch.isfinite(logprobs.grad).all()
    assert all(math.isfinite(v) for v in metrics.values())


def test_denominator_below_the_local_count_is_refused() -> None:
    mask = ones(1, 3)
    with pytest.raises(ValueError, match="denominator=2 is below"):
        policy_loss(base(1, 3), base(1, 3), adv(1.0), mask, versions(mask), 0, PLAIN, denominator=2)


def test_mismatched_shapes_are_refused() -> None:
    mask = ones(2, 3)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        policy_loss(base(2, 3), base(2, 2), adv(1.0, 1.0), mask, versions(mask), 0, PLAIN)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(base(2, 3), base(2, 3), adv(1.0, 1.0, 1.0), mask, versions(mask), 0, PLAIN)


@pytest.mark.parametrize(
    "fields",
    [
        {"clip_low": 1.0},
        {"clip_high": -0.1},
        {"is_mode": "clip"},
        {"is_level": "batch"},
        {"is_low": 1.5},
        {"is_high": 0.9},
        {"max_staleness": -1},
        {"loss_agg": "sum"},
        {"ratio_level": "batch"},
        {"entropy_coef": -0.01},
        {"kl_coef": -0.1},
        {"kl_estimator": "k4"},
        {"kl_in": "advantage"},
    ],
)
def test_invalid_config_is_refused(fields: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        LossConfig(**fields)  # type: ignore[arg-type]


# The KL under truncated sampling (issue 26) -----------------------------------------------------


def truncated_setting(positions: int, vocab: int) -> TokenSampling:
    """T = 0.7, top-p 0.9, top-k 20 on every position of one row."""
    return TokenSampling(
        temperature=torch.full((1, positions), 0.7),
        top_k=torch.full((1, positions), 20),
        top_p=torch.full((1, positions), 0.9),
        min_p=torch.zeros(1, positions),
        reproducible=torch.ones(1, positions, dtype=torch.bool),
        constrained=torch.zeros(1, positions, dtype=torch.bool),
    )


def extended_by_hand(logits: Tensor, targets: Tensor, sampling: TokenSampling) -> list[float]:
    """log p_t / sum over (kept set + t) of p, p = softmax(z / T) in float64, per position."""
    scaled = logits[0] / sampling.temperature[0].unsqueeze(-1)
    kept = kept_tokens(scaled, sampling.top_k[0], sampling.top_p[0], sampling.min_p[0])
    out = []
    for row, keep, t in zip(scaled.double(), kept, targets[0].tolist(), strict=True):
        support = keep.clone()
        support[t] = True
        out.append(float(row[t] - row[support].logsumexp(-1)))
    return out


def test_the_kl_under_top_k_top_p_at_t_07_is_finite_and_compares_what_both_support() -> None:
    """pi and ref over a 64-token vocabulary at 200 positions, ref = pi's logits plus noise,
    sampled at T = 0.7, top-p 0.9, top-k 20: half the tokens drawn from pi's processed
    distribution (some outside ref's kept set: log ref was the -87.3 sentinel, k2 ~ 3.7e3 with a
    gradient 86 times normal), half from ref's (a sampler behind the trained policy: some
    outside pi's, k3 was e^86 ~ 2e37)."""
    generator = torch.Generator().manual_seed(0)
    positions, vocab = 200, 64
    pi_logits = (3.0 * torch.randn(1, positions, vocab, generator=generator)).requires_grad_()
    ref_logits = pi_logits.detach() + torch.randn(1, positions, vocab, generator=generator)
    sampling = truncated_setting(positions, vocab)
    targets = torch.empty(1, positions, dtype=torch.long)
    for half, source in ((slice(0, 100), pi_logits.detach()), (slice(100, 200), ref_logits)):
        scaled = source[0, half] / 0.7
        kept = kept_tokens(scaled, sampling.top_k[0, half], sampling.top_p[0, half], sampling.min_p[0, half])
        probs = scaled.masked_fill(~kept, -math.inf).softmax(-1)
        targets[0, half] = torch.multinomial(probs, 1, generator=generator).squeeze(-1)

    # the sentinel case is there: the logprobs the PPO ratio takes
    sentinel_pi = processed_logprobs(pi_logits, targets, sampling)
    sentinel_ref = processed_logprobs(ref_logits, targets, sampling)
    outside_ref = int((sentinel_ref[0, :100] == OUTSIDE_SUPPORT).sum())
    outside_pi = int((sentinel_pi[0, 100:] == OUTSIDE_SUPPORT).sum())
    assert (outside_ref, outside_pi) == (12, 13)
    assert (
        float(kl_estimate(sentinel_pi, sentinel_ref, "k3").detach().max()) > 1e36
    )  # e^86: the 2.3e36 loss

    pi = processed_logprobs(pi_logits, targets, sampling, extend_support=True)
    ref = processed_logprobs(ref_logits, targets, sampling, extend_support=True)
    # the extended logprobs, against a float64 computation over each kept set plus the token
    assert pi[0].tolist() == pytest.approx(extended_by_hand(pi_logits.detach(), targets, sampling), abs=2e-5)
    assert ref[0].tolist() == pytest.approx(extended_by_hand(ref_logits, targets, sampling), abs=2e-5)
    # where a token is inside its distribution's kept set, nothing changed
    inside = sentinel_pi != OUTSIDE_SUPPORT
    assert torch.equal(pi[inside], sentinel_pi[inside])

    for estimator in ("k1", "k2", "k3"):
        k = kl_estimate(pi, ref, estimator)
        pi_logits.grad = None
        k.mean().backward(retain_graph=True)
        assert torch.isfinite(k).all() and torch.isfinite(pi_logits.grad).all()

    # sane: as large as the KL between the untruncated tempered distributions, which no
    # truncation can make infinite; the sentinel's k2 gradient was 20 times that
    plain = dataclasses.replace(
        sampling, top_k=torch.zeros_like(sampling.top_k), top_p=torch.ones(1, positions)
    )
    untruncated = (
        processed_logprobs(pi_logits, targets, plain),
        processed_logprobs(ref_logits, targets, plain),
    )

    def k3_mean_and_k2_gradient(pi: Tensor, ref: Tensor) -> tuple[float, float]:
        """The mean k3, and the largest |d k2_t / d z| over the logits of each position."""
        pi_logits.grad = None
        kl_estimate(pi, ref, "k2").sum().backward(retain_graph=True)
        return float(kl_estimate(pi, ref, "k3").detach().mean()), float(pi_logits.grad.abs().max())

    assert k3_mean_and_k2_gradient(pi, ref) == (
        pytest.approx(1.5745, abs=1e-4),
        pytest.approx(5.642, abs=1e-3),
    )
    assert k3_mean_and_k2_gradient(*untruncated) == (
        pytest.approx(1.5469, abs=1e-4),
        pytest.approx(5.568, abs=1e-3),
    )
    old_k3, old_gradient = k3_mean_and_k2_gradient(sentinel_pi, sentinel_ref)
    assert old_k3 > 1e36 and old_gradient == pytest.approx(115.14, abs=1e-2)
