"""One process's training step on a real (tiny, random) Qwen3 model: logprobs, the direction
and the micro-batch invariance of an update, and weights and checkpoints out and back in."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from molt_proxy.tinymodel import build_tiny_model
from trainer.batch import Batch, collate
from trainer.loss import LossConfig
from trainer.policy import Policy, token_logprobs

# (length, prompt length) per trajectory: uneven, so batches carry right padding
SHAPES = ((20, 8), (14, 5), (24, 10), (9, 3))
CURRENT = 5
# max_staleness 4 at version 5: tokens sampled by version 0 are withheld, so N is not B*T
LOSS = LossConfig(max_staleness=4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3", teach=False)


def reference_logprobs(model: torch.nn.Module, token_ids: list[int]) -> list[float]:
    """[T] log p(token_t | tokens_<t) of one unpadded sequence by log_softmax + gather."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    picked = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(token_ids[1:])[:, None])[:, 0]
    return [0.0, *picked.tolist()]


def trajectories(model: torch.nn.Module, *, seed: int = 0, noise: float = 1.0) -> list[dict[str, Any]]:
    """Records shaped like the proxy's: random tokens, the first one stale (version 0), and
    rollout logprobs = the model's own plus noise, so importance weights vary and some are
    truncated."""
    gen = torch.Generator().manual_seed(seed)
    records = []
    for row, (length, prompt) in enumerate(SHAPES):
        ids = torch.randint(1000, (length,), generator=gen).tolist()
        sampled = length - prompt
        own = reference_logprobs(model, ids)[prompt:]
        jitter = ((torch.rand(sampled, generator=gen) * 2 - 1) * noise).tolist()
        records.append(
            {
                "token_ids": ids,
                "loss_mask": [0] * prompt + [1] * sampled,
                "logprobs": [0.0] * prompt + [lp + j for lp, j in zip(own, jitter, strict=True)],
                "weight_versions": [-1] * prompt + [0 if row == 0 else CURRENT - 1] * sampled,
            }
        )
    return records


def sampled_logprob(policy: Policy, batch: Batch) -> float:
    """Sum of the policy's log probabilities of the batch's sampled tokens."""
    with torch.no_grad():
        logprobs = token_logprobs(policy.model, batch.input_ids, batch.attention_mask)
    return float((logprobs * batch.loss_mask).sum())


def test_token_logprobs_of_a_padded_batch_equal_log_softmax_gather_per_sequence(model_dir: Path) -> None:
    policy = Policy(model_dir)
    records = trajectories(policy.model)
    batch = collate(records, [0.0] * len(records))
    with torch.no_grad():
        logprobs = token_logprobs(policy.model, batch.input_ids, batch.attention_mask)
    assert logprobs.dtype == torch.float32 and logprobs.shape == batch.input_ids.shape
    for row, record in enumerate(records):
        n = len(record["token_ids"])
        expected = torch.tensor(reference_logprobs(policy.model, record["token_ids"]))
        torch.testing.assert_close(logprobs[row, :n], expected, rtol=0, atol=1e-5)
        assert torch.all(logprobs[row, n:] == 0.0)


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_one_step_moves_the_trained_tokens_logprob_with_the_advantages_sign(
    model_dir: Path, advantage: float
) -> None:
    policy = Policy(model_dir, lr=1e-4)
    records = trajectories(policy.model, noise=0.0)[1:]  # the fresh ones
    batch = collate(records, [advantage] * len(records))
    before = sampled_logprob(policy, batch)
    metrics = policy.train_step([batch], CURRENT, LOSS)
    after = sampled_logprob(policy, batch)
    assert (after - before) * advantage > 0.5, (before, after)
    assert metrics["kept_tokens"] == sum(batch.loss_mask.sum(dim=1).tolist())
    assert metrics["is_ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # on-policy: pi_old == mu


def test_two_micro_batches_give_the_update_of_one(model_dir: Path) -> None:
    whole, halves = Policy(model_dir, lr=1e-4), Policy(model_dir, lr=1e-4)
    records = trajectories(whole.model)
    batch = collate(records, [1.5, -0.5, 1.0, -2.0])
    one = whole.train_step([batch], CURRENT, LOSS)
    two = halves.train_step(batch.split(2), CURRENT, LOSS)

    assert one["kept_tokens"] == two["kept_tokens"] == sum(length - prompt for length, prompt in SHAPES[1:])
    assert one["stale_tokens"] == two["stale_tokens"] == SHAPES[0][0] - SHAPES[0][1]
    for key in ("loss", "grad_norm", "is_ratio_mean", "is_truncated_frac", "approx_kl"):
        assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-7), key
    assert one["is_truncated_frac"] > 0  # the noise reaches the cap: the weights were exercised
    expected = whole.model.state_dict()
    for name, tensor in halves.model.state_dict().items():
        torch.testing.assert_close(tensor, expected[name], rtol=1e-5, atol=1e-7, msg=name)


def test_saved_weights_are_a_complete_folder_that_reloads_identically(
    model_dir: Path, tmp_path: Path
) -> None:
    policy = Policy(model_dir, lr=1e-4)
    records = trajectories(policy.model)
    policy.train_step([collate(records, [1.0, 1.0, -1.0, 0.5])], CURRENT, LOSS)
    out = tmp_path / "v1"
    out.mkdir()
    (out / "stale.txt").write_text("an older push")  # replaced whole, never merged
    policy.save_weights(out)

    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["model.safetensors", *(p.name for p in model_dir.iterdir() if p.suffix != ".safetensors")]
    )
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (model_dir / name).read_bytes(), name
    assert not list(tmp_path.glob(".v1*")), "no temporary folder is left behind"
    reloaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).state_dict()
    trained = policy.model.state_dict()
    assert reloaded.keys() == trained.keys()
    for name, tensor in trained.items():
        assert torch.equal(reloaded[name], tensor), name
    assert set(load_file(out / "model.safetensors")) == set(trained)


def test_a_checkpoint_resumes_training_exactly(model_dir: Path, tmp_path: Path) -> None:
    first, resumed = Policy(model_dir, lr=1e-4), Policy(model_dir, lr=1e-4)
    assert resumed.state_dict()["optimizer"] is None  # nothing to save yet, and no step taken
    records = trajectories(first.model)
    first.train_step([collate(records, [1.0, -1.0, 0.5, 2.0])], CURRENT, LOSS)
    torch.save(first.state_dict(), tmp_path / "policy.pt")  # as trainer/checkpoint.py does
    resumed.load_state_dict(torch.load(tmp_path / "policy.pt", weights_only=False))

    batch = collate(trajectories(first.model, seed=1), [-1.0, 0.5, 1.0, -0.5])
    for policy in (first, resumed):
        policy.train_step([batch], CURRENT + 1, LOSS)
    expected = first.model.state_dict()
    for name, tensor in resumed.model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
