"""LoRA: train a low-rank adapter instead of the full weights, and hand vLLM only the adapter.

A refresh then moves the adapter (megabytes) instead of the model, and several trainers can
share one vLLM, each with its own adapter (`--lora-name` on each one's proxy). `LoraPolicy` is
`Policy` with every target `nn.Linear` W wrapped as W x + (alpha / r) B A x, W frozen and only
A and B trained; B starts at zero, so version 0 is exactly the base model. The adapter is
written as PEFT writes one (`adapter_config.json`, `adapter_model.safetensors` with
`base_model.model.<module>.lora_A.weight` keys), the format `vllm serve --enable-lora` loads
(`/v1/load_lora_adapter`). A plain implementation rather than `peft`: it is the one wrapper
and the one file format, with no dependency whose releases must track transformers'.

Checkpoints hold the adapter and its optimizer state only; the base is the model folder.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from trainer.config import LORA_TARGETS
from trainer.policy import Policy


class LoraLinear(nn.Module):
    """A frozen linear layer plus the low-rank update (alpha / r) B A, as vLLM applies it."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.scaling = alpha / rank
        weight = base.weight
        self.lora_A = nn.Parameter(
            torch.empty(rank, base.in_features, dtype=weight.dtype, device=weight.device)
        )
        self.lora_B = nn.Parameter(
            torch.zeros(base.out_features, rank, dtype=weight.dtype, device=weight.device)
        )
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # PEFT's initialisation of A

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + (x @ self.lora_A.T @ self.lora_B.T) * self.scaling


def add_adapters(model: nn.Module, rank: int, alpha: float, targets: tuple[str, ...]) -> list[str]:
    """Freeze `model` and wrap each `nn.Linear` whose own name is in `targets`; returns the
    wrapped modules' names (a model with none of them is refused: nothing would train)."""
    model.requires_grad_(False)
    wrapped = [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in targets
    ]
    if not wrapped:
        raise ValueError(f"no linear layer of the model is named one of {list(targets)}")
    for name in wrapped:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, LoraLinear(getattr(parent, child), rank, alpha))
    return wrapped


class LoraPolicy(Policy):
    """`Policy` training a LoRA adapter: `save_weights` writes the adapter, not the model."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        rank: int,
        alpha: float,
        targets: tuple[str, ...] = LORA_TARGETS,
        lr: float = 1e-5,
        max_grad_norm: float = 1.0,
        reference: bool = False,
    ):
        super().__init__(model_dir, lr=lr, max_grad_norm=max_grad_norm, reference=reference)
        self.rank, self.alpha = rank, alpha
        self.adapted = add_adapters(self.model, rank, alpha, targets)
        self.targets = sorted({name.rsplit(".", 1)[-1] for name in self.adapted})
        defaults = self.optimizer.defaults
        self.optimizer = torch.optim.AdamW(
            self.adapter_parameters().values(),
            lr=defaults["lr"],
            betas=defaults["betas"],
            weight_decay=defaults["weight_decay"],
        )

    def adapter_parameters(self) -> dict[str, nn.Parameter]:
        """{PEFT key: parameter} of every A and B, in module order."""
        return {
            f"base_model.model.{name}.lora_{part}.weight": getattr(
                self.model.get_submodule(name), f"lora_{part}"
            )
            for name in self.adapted
            for part in ("A", "B")
        }

    def save_weights(self, out_dir: str | Path) -> None:
        """The adapter in PEFT's layout, written to a sibling temporary folder and renamed into
        place, so vLLM never reads half of one."""
        out = Path(out_dir)
        tmp = out.with_name(f".{out.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        tensors = {key: p.detach().to("cpu").contiguous() for key, p in self.adapter_parameters().items()}
        save_file(tensors, tmp / "adapter_model.safetensors", metadata={"format": "pt"})
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": self.rank,
            "lora_alpha": self.alpha,
            "target_modules": self.targets,
            "lora_dropout": 0.0,
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": False,
            "use_dora": False,
            "modules_to_save": None,
            "base_model_name_or_path": str(self.model_dir),
        }
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)

    def state_dict(self) -> dict[str, Any]:
        """{"adapter", "optimizer"}: the adapter's tensors and AdamW's state (None before the
        first step; its tensors the live ones, as `Policy.state_dict`'s: save them before the
        next step); the frozen base is the model folder, never checkpointed."""
        adapter = {key: p.detach().clone() for key, p in self.adapter_parameters().items()}
        return {
            "adapter": adapter,
            "optimizer": self.optimizer.state_dict() if self.optimizer.state else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "adapter" not in state:
            raise ValueError(
                "this checkpoint holds full weights, not a LoRA adapter: train on without --lora-rank"
            )
        with torch.no_grad():
            for key, parameter in self.adapter_parameters().items():
                parameter.copy_(state["adapter"][key])
        if state["optimizer"] is None:
            self.optimizer.state.clear()
        else:
            self.optimizer.load_state_dict(state["optimizer"])
