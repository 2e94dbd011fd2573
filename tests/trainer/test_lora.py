"""LoRA without vLLM: the adapter trains alone on the frozen base and starts as the base
model, it is written in PEFT's layout and means what vLLM computes from it (the base with
W + (alpha / r) B A merged in), a checkpoint resumes it exactly; the flags that turn it on;
and a LoRA proxy refusing a push that is not an adapter before vLLM is touched."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from molt_proxy import lora
from molt_proxy.cli import launched_vllm_args, lora_name, parser, settings_from_args
from molt_proxy.config import Settings
from molt_proxy.launcher import VLLMServer
from tests.inprocess import mock_vllm, qwen3_tokenizer_dir, serve_app
from tests.trainer.builders import trajectory
from trainer.batch import Batch, collate
from trainer.config import LORA_TARGETS, TrainerConfig, config_from_args
from trainer.lora import LoraPolicy
from trainer.loss import LossConfig
from trainer.policy import Policy, token_logprobs

LOSS = LossConfig()


def batch(advantages: list[float], seed: int = 0) -> Batch:
    """Random sequences of the tiny vocabulary, sampled (mu) at a logprob of -5 each."""
    gen = torch.Generator().manual_seed(seed)
    records = [
        trajectory(row, f"s{row}", token_ids=torch.randint(300, (12,), generator=gen).tolist(), prompt=4,
                   logprobs=[-5.0] * 8)
        for row in range(len(advantages))
    ]  # fmt: skip
    return collate(records, advantages)


def logprobs(model: torch.nn.Module, b: Batch) -> torch.Tensor:
    with torch.no_grad():
        return token_logprobs(model, b.input_ids, b.attention_mask)


def test_the_adapter_starts_as_the_base_trains_alone_and_is_saved_as_vllm_reads_it(
    digits_model: Path, tmp_path: Path
) -> None:
    policy = LoraPolicy(digits_model, rank=4, alpha=8.0, lr=1e-2)
    base = Policy(digits_model)
    b = batch([1.0, -1.0, 1.0])
    assert torch.equal(logprobs(policy.model, b), logprobs(base.model, b)), "B = 0: version 0 is the base"
    assert {id(p) for p in policy.optimizer.param_groups[0]["params"]} == {
        id(p) for p in policy.adapter_parameters().values()
    }

    before = logprobs(policy.model, b)
    metrics = policy.train_step([b], 0, LOSS)
    moved = (logprobs(policy.model, b) - before) * b.loss_mask
    assert metrics["optimizer_steps"] == 1.0
    assert moved[0].sum() > 0 and moved[1].sum() < 0, "each sampled token follows its advantage's sign"
    frozen = {
        name.replace(".base.", "."): t for name, t in policy.model.state_dict().items() if "lora_" not in name
    }
    assert frozen.keys() == base.model.state_dict().keys()
    assert all(torch.equal(t, base.model.state_dict()[name]) for name, t in frozen.items()), (
        "the base is frozen"
    )

    out = tmp_path / "v1"
    policy.save_weights(out)
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    assert config["target_modules"] == sorted(LORA_TARGETS)
    tensors = load_file(out / "adapter_model.safetensors")
    assert len(tensors) == 2 * 2 * len(LORA_TARGETS)  # 2 layers, A and B of each target
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    assert tensors[f"{q}.lora_A.weight"].shape == (4, 64) and tensors[f"{q}.lora_B.weight"].shape == (64, 4)

    # What vLLM computes from the file: W + (alpha / r) B A in every target layer.
    merged = AutoModelForCausalLM.from_pretrained(str(digits_model), dtype=torch.float32).eval()
    with torch.no_grad():
        for key in [k for k in tensors if k.endswith("lora_A.weight")]:
            module = merged.get_submodule(
                key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            )
            module.weight += (8.0 / 4) * tensors[key.replace("lora_A", "lora_B")] @ tensors[key]
    torch.testing.assert_close(logprobs(merged, b), logprobs(policy.model, b), rtol=0, atol=1e-5)


def test_a_lora_checkpoint_holds_the_adapter_only_and_resumes_exactly(
    digits_model: Path, tmp_path: Path
) -> None:
    first, resumed = (
        LoraPolicy(digits_model, rank=2, alpha=4.0, lr=1e-2),
        LoraPolicy(digits_model, rank=2, alpha=4.0),
    )
    first.train_step([batch([1.0, -1.0])], 0, LOSS)
    state = first.state_dict()
    assert set(state) == {"adapter", "optimizer"} and set(state["adapter"]) == set(first.adapter_parameters())
    torch.save(state, tmp_path / "policy.pt")  # as trainer/checkpoint.py does
    resumed.load_state_dict(torch.load(tmp_path / "policy.pt", weights_only=False))
    b = batch([-1.0, 2.0], seed=1)
    for policy in (first, resumed):
        policy.train_step([b], 1, LOSS)
    for key, parameter in first.adapter_parameters().items():
        assert torch.equal(parameter, resumed.adapter_parameters()[key]), key
    with pytest.raises(ValueError, match="holds full weights, not a LoRA adapter"):
        resumed.load_state_dict(Policy(digits_model).state_dict())


def test_lora_flags_reach_the_trainer_the_proxy_and_the_vllm_it_launches() -> None:
    args = parser().parse_args(
        [
            "serve",
            "--model",
            "m",
            "--train",
            "--lora-rank",
            "12",
            "--lora-alpha",
            "24",
            "--proxy-url",
            "http://b",
        ]
        + ["--lora-target-modules", "q_proj", "v_proj"]
    )
    config = config_from_args(args, "http://a", "m")
    assert (config.lora_rank, config.lora_alpha, config.lora_target_modules) == (
        12,
        24.0,
        ("q_proj", "v_proj"),
    )
    assert config.proxy_urls == ["http://a", "http://b"]
    assert settings_from_args(args, None, []).lora_name == lora_name(args) == "lora"  # --train's default
    # vLLM's rank limit is the next it accepts; a --vllm-arg after it wins.
    assert launched_vllm_args(["--max-loras", "4"], None, "lora", 12) == [
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--max-loras", "4"
    ]  # fmt: skip
    assert launched_vllm_args([], None, None, 12) == []
    # The adapter routes are on only where LoRA is (vLLM warns they are for development).
    assert VLLMServer("m", extra_args=lora.vllm_args(8)).env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in VLLMServer("m").env
    with pytest.raises(ValueError, match="up to 512, not 600"):
        launched_vllm_args([], None, "lora", 600)
    with pytest.raises(SystemExit, match="--lora-name needs --lora-rank"):
        lora_name(parser().parse_args(["serve", "--model", "m", "--train", "--lora-name", "x"]))
    with pytest.raises(ValueError, match="lora_rank needs num_workers 1"):
        TrainerConfig(proxy_url="u", model="m", out_dir=Path("o"), lora_rank=8, num_workers=2)
    with pytest.raises(ValueError, match="LoRA needs a rank >= 1"):
        TrainerConfig(proxy_url="u", model="m", out_dir=Path("o"), lora_rank=0)


def test_a_lora_proxy_refuses_a_push_that_is_not_an_adapter_before_touching_vllm(
    digits_model: Path, tmp_path: Path
) -> None:
    model = qwen3_tokenizer_dir()
    not_lora = tmp_path / "prefix"
    not_lora.mkdir()
    (not_lora / "adapter_config.json").write_text('{"peft_type": "PREFIX_TUNING"}')
    truncated = tmp_path / "truncated"
    LoraPolicy(digits_model, rank=2, alpha=2.0).save_weights(truncated)
    weights = truncated / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with mock_vllm(model) as upstream:
        settings = Settings(
            model=str(model), upstreams=[upstream], db_path=tmp_path / "p.db", lora_name="alice"
        )
        with serve_app(settings) as proxy:
            for folder, message in (
                (digits_model, "has no adapter_config.json: this proxy serves a LoRA adapter (--lora-name)"),
                (not_lora, "is not a LoRA adapter (peft_type 'PREFIX_TUNING')"),
                (truncated, "is truncated or corrupt"),
            ):
                response = httpx.post(f"{proxy}/v1/admin/weights", json={"path": str(folder), "version": 1})
                error = response.json()["error"]
                assert response.status_code == 400 and error["param"] == "path", response.text
                assert message in error["message"], error["message"]
            assert httpx.get(f"{upstream}/_calls").json() == []
