"""The trainer's sampling processing (`trainer/sampling.py`) against hand computations and
against vLLM's own truncation code; which tokens it leaves out of the loss, and that a batch
carries the record through collate and split."""

from __future__ import annotations

import math

import pytest
import torch

from molt_proxy.types import Sampling, Turn
from tests.trainer.builders import trajectory
from trainer.batch import collate
from trainer.sampling import (
    OUTSIDE_SUPPORT,
    TokenSampling,
    kept_tokens,
    processed_logprobs,
    processed_logprobs_and_entropy,
    token_sampling,
)

PROBS = [0.5, 0.3, 0.15, 0.05]
"""A distribution whose truncations are easy to do by hand."""


def logprob(target: int, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, probs=PROBS) -> float:
    """log pi(target) of one position whose logits are log(probs)."""
    logits = torch.tensor([[probs]], dtype=torch.float32).log()
    sampling = TokenSampling(
        temperature=torch.tensor([[temperature]], dtype=torch.float32),
        top_k=torch.tensor([[top_k]]),
        top_p=torch.tensor([[top_p]], dtype=torch.float32),
        min_p=torch.tensor([[min_p]], dtype=torch.float32),
        reproducible=torch.tensor([[True]]),
        constrained=torch.tensor([[False]]),
    )
    return float(processed_logprobs(logits, torch.tensor([[target]]), sampling)[0, 0])


def test_temperature_divides_the_logits_before_the_softmax() -> None:
    tempered = [p**2 for p in PROBS]  # T = 0.5: p^(1/T), renormalised
    assert logprob(1, temperature=0.5) == pytest.approx(math.log(tempered[1] / sum(tempered)), abs=1e-6)
    assert logprob(1) == pytest.approx(math.log(0.3), abs=1e-6)


def test_greedy_tokens_get_their_untruncated_temperature_one_logprob() -> None:
    # vLLM reports a greedy token's logprob at T = 1, whatever top_k was sent
    assert logprob(1, temperature=0.0) == pytest.approx(math.log(0.3), abs=1e-6)


def test_top_k_keeps_the_k_most_likely_and_renormalises() -> None:
    assert logprob(1, top_k=2) == pytest.approx(math.log(0.3 / 0.8), abs=1e-6)
    assert logprob(2, top_k=2) == pytest.approx(OUTSIDE_SUPPORT)


def test_top_p_keeps_the_smallest_set_that_reaches_p_including_the_token_that_crosses_it() -> None:
    # ascending cumulative: 0.05, 0.20, 0.50, 1.0; drop where <= 1 - 0.75: the two least likely
    assert logprob(1, top_p=0.75) == pytest.approx(math.log(0.3 / 0.8), abs=1e-6)
    assert logprob(0, top_p=0.75) == pytest.approx(math.log(0.5 / 0.8), abs=1e-6)
    assert logprob(2, top_p=0.75) == pytest.approx(OUTSIDE_SUPPORT)


def test_top_p_applies_to_what_top_k_kept() -> None:
    # top_k=3 leaves [0.5, 0.3, 0.15] / 0.95; ascending cumulative 0.158, 0.474: 0.15 goes
    assert logprob(0, top_k=3, top_p=0.75) == pytest.approx(math.log(0.5 / 0.8), abs=1e-6)


def test_min_p_drops_tokens_below_a_share_of_the_most_likely_one() -> None:
    # min_p 0.2 of 0.5: the 0.05 token goes
    assert logprob(2, min_p=0.2) == pytest.approx(math.log(0.15 / 0.95), abs=1e-6)
    assert logprob(3, min_p=0.2) == pytest.approx(OUTSIDE_SUPPORT)


def test_truncation_follows_the_temperature() -> None:
    # at T = 0.5 the probabilities are p^2 / sum: 0.25, 0.09, 0.0225, 0.0025 (/0.365)
    tempered = [p**2 / sum(q**2 for q in PROBS) for p in PROBS]
    # ascending cumulative: 0.007, 0.068, 0.315, 1.0; top_p 0.9 drops where <= 0.1
    assert logprob(1, temperature=0.5, top_p=0.9) == pytest.approx(
        math.log(tempered[1] / (tempered[0] + tempered[1])), abs=1e-6
    )


def test_gradient_is_finite_and_reaches_only_the_kept_logits() -> None:
    logits = torch.tensor([[PROBS, PROBS]], dtype=torch.float32).log().requires_grad_()
    sampling = TokenSampling(
        temperature=torch.tensor([[0.7, 1.0]]),
        top_k=torch.tensor([[2, 2]]),
        top_p=torch.tensor([[1.0, 1.0]]),
        min_p=torch.tensor([[0.0, 0.0]]),
        reproducible=torch.ones(1, 2, dtype=torch.bool),
        constrained=torch.zeros(1, 2, dtype=torch.bool),
    )
    # the second position's target is outside the kept set
    processed_logprobs(logits, torch.tensor([[1, 3]]), sampling).sum().backward()
    grad = logits.grad[0]
    assert torch.isfinite(grad).all()
    assert grad[0, 2:].abs().sum() == 0 and grad[0, :2].abs().sum() > 0
    assert grad[1].abs().sum() == 0


@pytest.mark.parametrize(("top_k", "top_p"), [(20, 1.0), (0, 0.9), (20, 0.9), (0, 0.5), (1, 1.0)])
def test_kept_tokens_equal_vllm_own_truncation_on_random_logits(top_k: int, top_p: float) -> None:
    topk_topp = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 4096, generator=gen) * 3
    k = torch.full((6,), top_k, dtype=torch.long) if top_k else None
    p = torch.full((6,), top_p, dtype=torch.float32) if top_p < 1 else None
    theirs = topk_topp.apply_top_k_top_p_pytorch(logits.clone(), k, p, allow_cpu_sync=True)
    ours = kept_tokens(logits, torch.full((6,), top_k), torch.full((6,), top_p), torch.zeros(6))
    assert torch.equal(ours, torch.isfinite(theirs))
    reference = theirs.log_softmax(dim=-1, dtype=torch.float32)
    mine = logits.masked_fill(~ours, -math.inf).log_softmax(dim=-1, dtype=torch.float32)
    assert torch.equal(mine[ours], reference[ours])


def test_kept_tokens_with_min_p_equal_vllm_min_p_processor() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 4096, generator=gen) * 3
    min_p = torch.tensor([0.05, 0.1, 0.0, 0.3])
    probs = logits.softmax(dim=-1)  # vLLM's `MinPLogitsProcessor.apply`, written out
    theirs = ~(probs < probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(-1))
    ours = kept_tokens(logits, torch.zeros(4, dtype=torch.long), torch.ones(4), min_p)
    assert torch.equal(ours, theirs)


def turn(start: int, end: int, sampling: Sampling | None) -> Turn:
    return Turn("c", start, start, end, "stop", sampling=sampling)


def test_the_record_covers_each_turns_sampled_tokens_with_its_own_sampling() -> None:
    record = token_sampling(
        [
            [turn(2, 4, Sampling(temperature=0.7, top_k=20)), turn(6, 8, Sampling(top_p=0.9, min_p=0.1))],
            [turn(1, 3, Sampling(temperature=0.0, top_k=20))],
        ],
        length=9,
    )
    assert record.temperature[0].tolist() == pytest.approx([1, 1, 0.7, 0.7, 1, 1, 1, 1, 1])
    assert record.top_k[0].tolist() == [0, 0, 20, 20, 0, 0, 0, 0, 0]
    assert record.top_p[0].tolist() == pytest.approx([1, 1, 1, 1, 1, 1, 0.9, 0.9, 1])
    assert record.min_p[0].tolist() == pytest.approx([0, 0, 0, 0, 0, 0, 0.1, 0.1, 0])
    # greedy: temperature 0 (its logprob is at T = 1) and never truncated
    assert record.temperature[1, 1:3].tolist() == [0.0, 0.0] and record.top_k[1].sum() == 0
    assert record.reproducible.all()


@pytest.mark.parametrize(
    "sampling",
    [
        None,  # recorded before turns recorded their sampling
        Sampling(presence_penalty=0.5),
        Sampling(frequency_penalty=-0.1),
        Sampling(repetition_penalty=1.1),
        Sampling(logit_bias={5: 2.0}),
    ],
)
def test_turns_whose_distribution_cannot_be_reproduced_are_masked_and_counted(sampling) -> None:
    record = token_sampling([[turn(1, 4, Sampling()), turn(5, 7, sampling)]], length=8)
    assert record.reproducible[0].tolist() == [True] * 5 + [False, False, True]
    loss_mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 0]])
    assert record.trainable(loss_mask, train_greedy=True).tolist() == [[0, 1, 1, 1, 0, 0, 0, 0]]
    assert record.counts() == {"greedy_tokens": 0.0, "unreproducible_tokens": 2.0, "constrained_tokens": 0.0}


def test_only_the_first_min_tokens_of_a_turn_are_unreproducible() -> None:
    # vLLM holds the stop tokens at -inf until the turn is min_tokens long
    record = token_sampling([[turn(1, 6, Sampling(min_tokens=2))]], length=6)
    assert record.reproducible[0].tolist() == [True, False, False, True, True, True]


def test_greedy_tokens_leave_the_loss_unless_train_greedy() -> None:
    greedy, sampled = trajectory(0, token_ids=[1, 2, 3, 4]), trajectory(1, token_ids=[1, 2, 3, 4, 5])
    greedy.turns[0].sampling = Sampling(temperature=0.0)
    batch = collate([greedy, sampled], [1.0, 1.0])
    assert batch.loss_mask.tolist() == [[0, 0, 0, 0, 0], [0, 0, 1, 1, 1]]
    assert batch.sampling.counts() == {
        "greedy_tokens": 2.0,
        "unreproducible_tokens": 0.0,
        "constrained_tokens": 0.0,
    }
    trained = collate([greedy, sampled], [1.0, 1.0], train_greedy=True)
    assert trained.loss_mask.tolist() == [[0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]


def test_split_carries_each_rows_sampling() -> None:
    # row i: 3 + i tokens (2 of prompt), sampled at T = 0.5 + i / 10
    rows = [trajectory(i, token_ids=list(range(1, 4 + i))) for i in range(3)]
    for i, t in enumerate(rows):
        t.turns[0].sampling = Sampling(temperature=0.5 + i / 10)
    parts = collate(rows, [1.0] * 3).split(2)
    assert sorted(len(part) for part in parts) == [1, 2]
    for part in parts:
        for row in range(len(part)):
            i = int(part.attention_mask[row].sum()) - 3
            sampled = part.sampling.temperature[row, 2 : 3 + i]
            assert sampled.tolist() == pytest.approx([0.5 + i / 10] * (1 + i))


def test_entropy_is_that_of_the_processed_distribution_each_token_was_drawn_from() -> None:
    logits = torch.tensor([[PROBS, PROBS]], dtype=torch.float32).log().requires_grad_()
    sampling = TokenSampling(
        temperature=torch.tensor([[1.0, 1.0]]),
        top_k=torch.tensor([[0, 2]]),  # the second position keeps 0.5 and 0.3: 0.625, 0.375
        top_p=torch.tensor([[1.0, 1.0]]),
        min_p=torch.tensor([[0.0, 0.0]]),
        reproducible=torch.ones(1, 2, dtype=torch.bool),
        constrained=torch.zeros(1, 2, dtype=torch.bool),
    )
    targets = torch.tensor([[0, 1]])
    everywhere = torch.ones(1, 2, dtype=torch.bool)
    logprobs, entropy, _ = processed_logprobs_and_entropy(
        logits, targets, sampling, everywhere, entropy_grad=True
    )
    whole = -sum(p * math.log(p) for p in PROBS)  # 1.1437
    truncated = -(0.625 * math.log(0.625) + 0.375 * math.log(0.375))  # 0.6616
    assert entropy.tolist() == [[pytest.approx(whole, abs=1e-6), pytest.approx(truncated, abs=1e-6)]]
    assert logprobs.tolist() == [[pytest.approx(math.log(0.5)), pytest.approx(math.log(0.375))]]
    entropy.sum().backward()
    assert torch.isfinite(logits.grad).all()
    assert logits.grad[0, 1, 2:].tolist() == [0.0, 0.0]  # dropped tokens get no gradient
    _, logged, _ = processed_logprobs_and_entropy(logits, targets, sampling, everywhere, entropy_grad=False)
    assert not logged.requires_grad and torch.allclose(logged, entropy.detach())
    for first, second in ((True, False), (False, True)):  # only at the positions asked for
        positions = torch.tensor([[first, second]])
        _, some, _ = processed_logprobs_and_entropy(logits, targets, sampling, positions, entropy_grad=False)
        assert torch.equal(some, torch.where(positions, logged, 0.0))


def test_for_the_kl_a_token_truncation_dropped_gets_its_share_of_the_kept_set_plus_itself() -> None:
    """`extend_support`: top_k=2 keeps 0.5 and 0.3; the dropped 0.15 gets 0.15 / (0.8 + 0.15)
    instead of the sentinel, with a gradient; a kept token is unchanged (0.3 / 0.8)."""
    logits = torch.tensor([[PROBS, PROBS]], dtype=torch.float32).log().requires_grad_()
    sampling = TokenSampling(
        temperature=torch.tensor([[1.0, 0.5]]),
        top_k=torch.tensor([[2, 2]]),
        top_p=torch.tensor([[1.0, 1.0]]),
        min_p=torch.tensor([[0.0, 0.0]]),
        reproducible=torch.ones(1, 2, dtype=torch.bool),
        constrained=torch.zeros(1, 2, dtype=torch.bool),
    )
    targets = torch.tensor([[2, 3]])
    assert processed_logprobs(logits, targets, sampling).tolist() == [[pytest.approx(OUTSIDE_SUPPORT)] * 2]
    extended = processed_logprobs(logits, targets, sampling, extend_support=True)
    # T = 0.5: p^2 kept 0.25 + 0.09, the dropped 0.05 -> 0.0025 / (0.34 + 0.0025)
    assert extended.tolist() == [
        [pytest.approx(math.log(0.15 / 0.95), abs=1e-6), pytest.approx(math.log(0.0025 / 0.3425), abs=1e-6)]
    ]
    inside = processed_logprobs(logits, torch.tensor([[1, 1]]), sampling, extend_support=True)
    assert inside[0, 0].item() == pytest.approx(math.log(0.3 / 0.8), abs=1e-6)
    extended[0, 0].backward()
    # d/dz_v of z_t - logsumexp over {0, 1, t}: 1 - 0.15/0.95 at t, -0.5/0.95 and -0.3/0.95 at 0 and 1
    expected = [-0.5 / 0.95, -0.3 / 0.95, 1 - 0.15 / 0.95, 0.0]
    assert logits.grad[0, 0].tolist() == pytest.approx(expected, abs=1e-6)
