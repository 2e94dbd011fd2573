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
from trainer.loss import LossConfig
from trainer.policy import Policy


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
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


def test_no_reference_is_loaded_without_a_kl_penalty(model_dir: Path) -> None:
    assert Policy(model_dir).reference is None


def test_the_reference_gives_kl_zero_before_the_first_update_and_above_zero_after(model_dir: Path) -> None:
    policy = Policy(model_dir, lr=1e-3, reference=True)
    loss = LossConfig(kl_coef=0.1, max_staleness=None)
    batch = collate([two_turns(0, [5, 6, 7, 8, 9, 10, 11])], [1.0])
    first = policy.train_step([batch], 0, loss)
    assert first["kl_ref"] == 0.0  # the same weights, the same forward: every k3 is e^0 - 1 - 0
    assert 0.0 < first["entropy"] <= math.log(policy.model.config.vocab_size)
    second = policy.train_step([batch], 0, loss)
    assert second["kl_ref"] > 0.0
    assert second["optimizer_steps"] == 1.0
    initial = Policy(model_dir).model.state_dict()
    assert all(torch.equal(initial[name], p) for name, p in policy.reference.state_dict().items())


def test_kl_in_the_reward_is_beta_times_the_sum_of_k_per_turn(model_dir: Path) -> None:
    policy = Policy(model_dir, reference=True)
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
