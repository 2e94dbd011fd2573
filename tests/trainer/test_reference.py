"""The frozen reference of the KL penalty on a real (tiny, random) Qwen3 model: loaded only
when asked for, KL 0 before the first update and above 0 after it, and the penalty in the
reward computed from it exactly; the entropy is logged with every update."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from devtools import build_tiny_model
from molt_proxy.types import Sampling, Trajectory, Turn
from tests.trainer.builders import trajectory
from trainer.batch import collate
from trainer.credit import reward_kl
from trainer.loss import LossConfig, kl_estimate
from trainer.policy import Policy, token_logprobs
from trainer.sampling import OUTSIDE_SUPPORT


@pytest.fixture(scope="module")
def qwen3_vocab_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Qwen3 with the real 151k-token vocabulary, for the one test whose point
    is the size of the vocabulary (a top-k of 20 leaves out nearly all of it); the others
    run on `small_model`."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3", teach=False)


def two_turns(seq: int, ids: list[int]) -> Trajectory:
    """Prompt ids[:2], a turn sampling ids[2:4], a prompt token ids[4], a turn sampling ids[5:]."""
    record = trajectory(seq, f"s{seq}", token_ids=ids, logprobs=[-1.0] * (len(ids) - 2))
    record.loss_mask = [0, 0, 1, 1, 0] + [1] * (len(ids) - 5)
    record.weight_versions = [-1 if m == 0 else 0 for m in record.loss_mask]
    record.turns = [
        Turn("c0", 0, 2, 4, "stop", sampling=Sampling()),
        Turn("c1", 4, 5, len(ids), "stop", sampling=Sampling()),
    ]
    return record


def test_no_reference_is_loaded_without_a_kl_penalty(small_model: Path) -> None:
    assert Policy(small_model).reference is None


def test_the_reference_gives_kl_zero_before_the_first_update_and_above_zero_after(small_model: Path) -> None:
    policy = Policy(small_model, lr=1e-3, reference=True)
    loss = LossConfig(kl_coef=0.1, max_staleness=None)
    batch = collate([two_turns(0, [5, 6, 7, 8, 9, 10, 11])], [1.0])
    first = policy.train_step([batch], 0, loss)
    assert first["kl_ref"] == 0.0  # the same weights, the same forward: every k3 is e^0 - 1 - 0
    assert 0.0 < first["entropy"] <= math.log(policy.model.config.vocab_size)
    second = policy.train_step([batch], 0, loss)
    assert second["kl_ref"] > 0.0
    assert second["optimizer_steps"] == 1.0
    initial = Policy(small_model).model.state_dict()
    assert all(torch.equal(initial[name], p) for name, p in policy.reference.state_dict().items())


def test_kl_in_the_reward_is_beta_times_the_sum_of_k_per_turn(small_model: Path) -> None:
    policy = Policy(small_model, reference=True)
    records = [two_turns(0, [5, 6, 7, 8, 9, 10, 11, 12]), two_turns(1, [12, 13, 14, 15, 16, 17])]
    batch = collate(records, [0.0, 0.0])
    with torch.no_grad():
        ref = policy.reference_logprobs(batch)
    # the sampler was twice as likely as the reference on every sampled token: x = -log 2
    batch.rollout_logprobs = torch.where(batch.loss_mask.bool(), ref + math.log(2), 0.0)
    loss = LossConfig(kl_coef=0.5, kl_in="reward")

    penalties, mean = reward_kl(policy, batch, records, loss, rows_per_pass=1)

    k3 = 0.5 - 1 + math.log(2)  # e^x - 1 - x = 0.1931 per token
    assert mean == pytest.approx(k3, abs=1e-5)
    # turns of 2 and 3 sampled tokens, then 2 and 1
    expected = [[0.5 * 2 * k3, 0.5 * 3 * k3], [0.5 * 2 * k3, 0.5 * 1 * k3]]
    assert penalties == [[pytest.approx(e, abs=1e-5) for e in row] for row in expected]


def test_a_kl_penalty_under_top_k_top_p_stays_finite_where_the_reference_truncated_the_token(
    qwen3_vocab_model: Path,
) -> None:
    """Sampled at T = 0.7, top-p 0.9, top-k 20 by a policy that has moved away from the
    reference (its lm_head perturbed): the policy's greedy tokens are in its own kept set but
    mostly outside the reference's, where the reference's processed logprob is the -87.3
    sentinel (k1 = 86, k2's gradient 86). Against the extended logprobs the KL in the loss
    and in the reward is finite and of the size of a real divergence."""
    policy = Policy(qwen3_vocab_model, lr=1e-3, reference=True)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        head = policy.model.lm_head.weight
        head.add_(10 * head.std() * torch.randn(head.shape, generator=generator))
        ids = [5, 6]
        for _ in range(8):  # greedy: the most likely token, which every truncation keeps
            ids.append(int(policy.model(torch.tensor([ids])).logits[0, -1].argmax()))
    record = trajectory(0, "s", token_ids=ids, logprobs=[-1.0] * 8)
    record.turns = [
        Turn("c0", 0, 2, len(ids), "stop", sampling=Sampling(temperature=0.7, top_p=0.9, top_k=20))
    ]
    batch = collate([record], [0.0])
    sampled = batch.loss_mask.bool()
    with torch.no_grad():
        pi = policy.logprobs(batch)
        ref = policy.reference_logprobs(batch)
        sentinel = token_logprobs(policy.reference, batch.input_ids, batch.attention_mask, batch.sampling)
    assert int((sentinel[sampled] == OUTSIDE_SUPPORT).sum()) == 8  # all of them
    assert bool((pi[sampled] > OUTSIDE_SUPPORT).all()) and bool((ref[sampled] > -30).all())
    k3 = kl_estimate(pi, ref, "k3")[sampled]
    # measured: k3 0.55 to 1.79 per token; against the sentinel k2 was 3.6e3 to 3.7e3
    assert float(k3.max()) < 2.0 and float(kl_estimate(pi, sentinel, "k2")[sampled].min()) > 3600.0

    loss = LossConfig(kl_coef=0.1, kl_estimator="k3", max_staleness=None)
    metrics = policy.train_step([batch], 0, loss)  # every advantage 0: the KL term alone
    assert metrics["kl_ref"] == pytest.approx(float(k3.mean()), rel=1e-5)
    assert metrics["loss"] == pytest.approx(0.1 * float(k3.mean()), rel=1e-5)
    assert math.isfinite(metrics["grad_norm"]) and metrics["optimizer_steps"] == 1.0

    batch.rollout_logprobs = pi  # the sampler's mu: this policy, before its update
    penalties, mean = reward_kl(policy, batch, [record], LossConfig(kl_coef=0.5, kl_in="reward"), 1)
    assert mean == pytest.approx(float(k3.mean()), rel=1e-5)
    assert penalties == [[pytest.approx(0.5 * float(k3.sum()), rel=1e-5)]]
