"""LoRA serving: a proxy started with `--lora-name NAME` samples every turn from the trainer's
latest LoRA adapter instead of vLLM's base weights, and a weights push is an adapter folder.

Each pushed version is loaded into vLLM under a name of its own, `NAME-v<version>`
(`/v1/load_lora_adapter`, which `vllm serve --enable-lora` offers with
VLLM_ALLOW_RUNTIME_LORA_UPDATING=1), and the proxy sends each request to the newest one. An
adapter is never changed once loaded, so every token sampled under `NAME-vN` was sampled by
version N: the proxy labels it so (`upstream.Upstream`), and vLLM is neither paused nor
relabelled (its own version label is one per engine, and several trainers may share the
engine, each with its own adapter and proxy). A request already running keeps its adapter to
the end; the one before the newest stays loaded, so a request that picked it just before a
push still finds it, and older ones are unloaded. vLLM may reload an adapter it evicted from
its cache from the adapter's folder: the trainer keeps the newest two.

Like `weights.py` this module reads files and imports nothing heavy.
"""

from __future__ import annotations

import json
from pathlib import Path

from molt_proxy.errors import BadRequest
from molt_proxy.weights import _check_safetensors

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
VLLM_MAX_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.32 accepts for `--max-lora-rank` (`vllm/config/lora.py`)."""
KEPT = 2
"""Adapters of one proxy kept loaded in vLLM: the newest, and the one before it."""


def adapter_name(lora_name: str, version: int) -> str:
    """The name vLLM serves version `version` of adapter `lora_name` under."""
    return f"{lora_name}-v{version}"


def check_adapter_dir(path: str) -> str:
    """The folder `path` names, with symlinks resolved, if it holds a LoRA adapter in PEFT's
    layout (`adapter_config.json` of a LoRA, whole `adapter_model.safetensors`); otherwise
    `BadRequest`. A full model folder is refused here with the reason: this proxy serves an
    adapter."""
    if not Path(path).is_absolute():
        raise BadRequest("'path' must be absolute: vLLM resolves it in its own directory", param="path")
    try:
        folder = Path(path).resolve(strict=True)
    except (OSError, RuntimeError) as exc:
        why = getattr(exc, "strerror", None) or exc  # Python 3.11's symlink-loop RuntimeError has none
        raise BadRequest(f"{path} cannot be resolved: {why}", param="path") from None
    config = folder / ADAPTER_CONFIG
    if not config.is_file():
        raise BadRequest(
            f"{path} has no {ADAPTER_CONFIG}: this proxy serves a LoRA adapter (--lora-name), "
            "push one (a trainer with --lora-rank)",
            param="path",
        )
    try:
        peft_type = json.loads(config.read_bytes()).get("peft_type")
    except (OSError, ValueError, AttributeError, RecursionError):
        raise BadRequest(f"{config} is not a readable adapter config", param="path") from None
    if peft_type != "LORA":
        raise BadRequest(f"{config} is not a LoRA adapter (peft_type {peft_type!r})", param="path")
    if not (folder / ADAPTER_WEIGHTS).is_file():
        raise BadRequest(f"{path} has no {ADAPTER_WEIGHTS}", param="path")
    _check_safetensors(folder / ADAPTER_WEIGHTS)
    return str(folder)


def vllm_args(rank: int | None) -> list[str]:
    """The flags of a vLLM that `serve --lora-name` launches: LoRA on, room for this proxy's
    two adapters in one batch, and a rank limit that fits `rank` (vLLM's default, 16, when
    the rank is not known here)."""
    args = ["--enable-lora", "--max-loras", str(KEPT)]
    if rank is not None:
        fitting = next((r for r in VLLM_MAX_RANKS if r >= rank), None)
        if fitting is None:
            raise ValueError(f"vLLM serves LoRA ranks up to {VLLM_MAX_RANKS[-1]}, not {rank}")
        args += ["--max-lora-rank", str(fitting)]
    return args
