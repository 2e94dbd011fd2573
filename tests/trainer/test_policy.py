"""One process's training step on a real (tiny, random) Qwen3 model: logprobs, the direction
and the micro-batch invariance of an update, and weights and checkpoints out and back in."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from molt_proxy.types import Trajectory
from tests.trainer.builders import trajectory
from trainer.batch import Batch, collate
from trainer.loss import LossConfig
from trainer.policy import Policy, token_logprobs

# (length, prompt length) per trajectory: uneven, so batches carry right padding
SHAPES = ((20, 8), (14, 5), (24, 10), (9, 3))
CURRENT = 5
# max_staleness 4 at version 5: tokens sampled by version 0 are withheld, so N is not B*T
LOSS = LossConfig(max_staleness=4)


def reference_logprobs(model: torch.nn.Module, token_ids: list[int]) -> list[float]:
    """[T] log p(token_t | tokens_<t) of one unpadded sequence by log_softmax + gather."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    picked = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(token_ids[1:])[:, None])[:, 0]
    return [0.0, *picked.tolist()]


def trajectories(model: torch.nn.Module, *, seed: int = 0, noise: float = 1.0) -> list[Trajectory]:
    """Random tokens, the first trajectory stale (version 0), and rollout logprobs = the
    model's own plus noise, so importance weights vary and some are truncated. The ids are
    drawn from the first 1000 of the vocabulary (all of the small model's 395): with ids from
    the whole 151k of `tests/trainer/test_workers.py`'s model, its sharded and single updates
    parted by more than its tolerances (1.5e-4, 7.9e-3)."""
    gen = torch.Generator().manual_seed(seed)
    records = []
    for row, (length, prompt) in enumerate(SHAPES):
        ids = torch.randint(min(model.config.vocab_size, 1000), (length,), generator=gen).tolist()
        own = reference_logprobs(model, ids)[prompt:]
        jitter = ((torch.rand(length - prompt, generator=gen) * 2 - 1) * noise).tolist()
        records.append(
            trajectory(
                row,
                f"s{row}",
                token_ids=ids,
                prompt=prompt,
                logprobs=[lp + j for lp, j in zip(own, jitter, strict=True)],
                version=0 if row == 0 else CURRENT - 1,
            )
        )
    return records


def sampled_logprob(policy: Policy, batch: Batch) -> float:
    """Sum of the policy's log probabilities of the batch's sampled tokens."""
    with torch.no_grad():
        logprobs = token_logprobs(policy.model, batch.input_ids, batch.attention_mask)
    return float((logprobs * batch.loss_mask).sum())


def test_token_logprobs_of_a_padded_batch_equal_log_softmax_gather_per_sequence(small_model: Path) -> None:
    policy = Policy(small_model)
    records = trajectories(policy.model)
    batch = collate(records, [0.0] * len(records))
    with torch.no_grad():
        logprobs = token_logprobs(policy.model, batch.input_ids, batch.attention_mask)
    assert logprobs.dtype == torch.float32 and logprobs.shape == batch.input_ids.shape
    for row, record in enumerate(records):
        n = len(record.token_ids)
        expected = torch.tensor(reference_logprobs(policy.model, record.token_ids))
        torch.testing.assert_close(logprobs[row, :n], expected, rtol=0, atol=1e-5)
        assert torch.all(logprobs[row, n:] == 0.0)


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_one_step_moves_the_trained_tokens_logprob_with_the_advantages_sign(
    small_model: Path, advantage: float
) -> None:
    policy = Policy(small_model, lr=1e-4)
    records = trajectories(policy.model, noise=0.0)[1:]  # the fresh ones
    batch = collate(records, [advantage] * len(records))
    before = sampled_logprob(policy, batch)
    metrics = policy.train_step([batch], CURRENT, LOSS)
    after = sampled_logprob(policy, batch)
    assert (after - before) * advantage > 0.5, (before, after)
    assert metrics["kept_tokens"] == sum(batch.loss_mask.sum(dim=1).tolist())
    assert metrics["is_ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # on-policy: pi_old == mu


def test_two_micro_batches_give_the_update_of_one(small_model: Path) -> None:
    whole, halves = Policy(small_model, lr=1e-4), Policy(small_model, lr=1e-4)
    # Not seed 0: there one LM-head weight's gradient is 2.5e-9, near AdamW's eps (1e-8), where
    # the step is g / (|g| + eps) of lr and the two sums' rounding moved it 3.6e-7 apart.
    records = trajectories(whole.model, seed=1)
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
    small_model: Path, tmp_path: Path
) -> None:
    policy = Policy(small_model, lr=1e-4)
    records = trajectories(policy.model)
    policy.train_step([collate(records, [1.0, 1.0, -1.0, 0.5])], CURRENT, LOSS)
    out = tmp_path / "v1"
    out.mkdir()
    (out / "stale.txt").write_text("an older push")  # replaced whole, never merged
    policy.save_weights(out)

    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["model.safetensors", *(p.name for p in small_model.iterdir() if p.suffix != ".safetensors")]
    )
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (small_model / name).read_bytes(), name
    assert not list(tmp_path.glob(".v1*")), "no temporary folder is left behind"
    reloaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).state_dict()
    trained = policy.model.state_dict()
    assert reloaded.keys() == trained.keys()
    for name, tensor in trained.items():
        assert torch.equal(reloaded[name], tensor), name
    assert set(load_file(out / "model.safetensors")) == set(trained)


def test_a_checkpoint_resumes_training_exactly(small_model: Path, tmp_path: Path) -> None:
    first, resumed = Policy(small_model, lr=1e-4), Policy(small_model, lr=1e-4)
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


def snapshot(policy: Policy) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in policy.model.state_dict().items()}


@pytest.mark.parametrize("why", ["every token masked by its importance weight", "every advantage zero"])
def test_an_update_that_has_no_gradient_leaves_the_weights_and_adam_alone(
    small_model: Path, why: str
) -> None:
    """After a real step Adam has momentum: an optimizer step on a zero gradient would still
    move the weights (measured up to 6.7e-3), so it is not taken and is reported as such."""
    policy = Policy(small_model, lr=1e-4)
    records = trajectories(policy.model, noise=0.0)[1:]
    assert policy.train_step([collate(records, [1.0, -1.0, 0.5])], CURRENT, LOSS)["optimizer_steps"] == 1
    before, adam_step = snapshot(policy), policy.optimizer.state[policy.model.lm_head.weight]["step"].item()

    if why == "every advantage zero":
        batch, loss = collate(records, [0.0, 0.0, 0.0]), LOSS
    else:
        batch, loss = collate(records, [1.0, -1.0, 0.5]), LossConfig(is_mode="mask", max_staleness=4)
        batch.rollout_logprobs -= 5.0 * batch.loss_mask  # pi_old / mu = e^5, far above is_high
    metrics = policy.train_step([batch], CURRENT, loss)

    assert metrics["optimizer_steps"] == 0 and metrics["grad_norm"] == 0.0 and metrics["kept_tokens"] > 0
    assert all(torch.equal(tensor, before[name]) for name, tensor in policy.model.state_dict().items())
    assert policy.optimizer.state[policy.model.lm_head.weight]["step"].item() == adam_step


def test_with_one_ppo_epoch_the_step_is_todays_single_update(small_model: Path) -> None:
    ppo, today = Policy(small_model, lr=1e-4), Policy(small_model, lr=1e-4)
    batch = collate(trajectories(ppo.model), [1.5, -0.5, 1.0, -2.0])
    got = ppo.ppo_step([batch.split(2)], CURRENT, LOSS, epochs=1)
    expected = today.train_step(batch.split(2), CURRENT, LOSS)
    assert got == pytest.approx(expected) and got["clip_frac_low"] == got["clip_frac_high"] == 0.0
    assert all(torch.equal(tensor, snapshot(today)[name]) for name, tensor in snapshot(ppo).items())


def test_a_second_ppo_epoch_clips_against_pi_old_of_the_step_start(small_model: Path) -> None:
    """pi_old is computed once, before the first update: in the second epoch pi has moved
    (a large lr), the ratio pi / pi_old leaves 1 and the clip acts."""
    ppo, by_hand = Policy(small_model, lr=1e-2), Policy(small_model, lr=1e-2)
    records = trajectories(ppo.model, noise=0.0)[1:]
    batch = collate(records, [1.0, -1.0, 1.0])
    metrics = ppo.ppo_step([[batch]], CURRENT, LOSS, epochs=2)

    with torch.no_grad():
        old = by_hand.logprobs(batch)
    first = by_hand.train_step([batch], CURRENT, LOSS, old_logprobs=[old])
    with torch.no_grad():
        ratio = (by_hand.logprobs(batch) - old).exp()[batch.loss_mask.bool()]
    second = by_hand.train_step([batch], CURRENT, LOSS, old_logprobs=[old])

    assert first["clip_frac_low"] == first["clip_frac_high"] == 0.0  # the first update: ratio 1
    assert float((ratio - 1).abs().max()) > LOSS.clip_high
    assert second["clip_frac_low"] + second["clip_frac_high"] > 0
    assert metrics["optimizer_steps"] == 2
    assert metrics["clip_frac_low"] + metrics["clip_frac_high"] == pytest.approx(
        (second["clip_frac_low"] + second["clip_frac_high"]) / 2
    )
    expected = snapshot(by_hand)
    for name, tensor in snapshot(ppo).items():
        torch.testing.assert_close(tensor, expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_train_only_moves_the_named_parameters_alone_and_still_moves_the_sampled_tokens(
    small_model: Path,
) -> None:
    """`train_only=("lm_head",)`: one step changes the LM head and nothing else (no gradient,
    no AdamW state elsewhere), and the trained tokens still move with the advantage's sign."""
    policy = Policy(small_model, lr=1e-2, train_only=("lm_head",))
    before = {name: p.detach().clone() for name, p in policy.model.named_parameters()}
    records = trajectories(policy.model, noise=0.0)[1:]
    batch = collate(records, [1.0] * len(records))
    logprob = sampled_logprob(policy, batch)
    policy.train_step([batch], CURRENT, LOSS)
    changed = {name for name, p in policy.model.named_parameters() if not torch.equal(p, before[name])}
    assert changed == {"lm_head.weight"}
    assert [id(p) for group in policy.optimizer.param_groups for p in group["params"]] == [
        id(policy.model.lm_head.weight)
    ]
    assert sampled_logprob(policy, batch) > logprob + 0.5


def test_train_only_refuses_a_name_the_model_does_not_have(small_model: Path) -> None:
    with pytest.raises(ValueError, match="names no parameter"):
        Policy(small_model, train_only=("lm_haed",))
