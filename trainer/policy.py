"""The model side of training: token logprobs, one optimizer step, weights out for vLLM.

Owns a `transformers` causal LM in float32 and its AdamW optimizer. `Policy` is a single
process; with `fsdp=True` the same class runs as one rank of a data-parallel group under
FSDP2 (`workers.py` starts the group and feeds each rank its shard of the step). It does not
choose the data (the loop does), define the loss (`loss.py`) or talk to vLLM (the proxy does).

A trainer step (`ppo_step`) is PPO's schedule: pi_old, the proximal policy of the loss, is the
weights before the step, computed once under no_grad before the first update; then
`epochs` passes over the step's mini-batches, one optimizer step (`train_step`) each. From the
second update on, pi has moved away from pi_old, so the ratio pi / pi_old leaves 1 and the
clip bounds how far (`loss.py`). With one epoch of one mini-batch (the default) pi_old is the
detached pi of that update's own forward pass (the same weights): the ratio is 1, the clip
idle, and the objective a truncated-IS policy gradient. In every case the train/rollout weight
exp(pi_old - mu) corrects for vLLM sampling with other kernels or older weights.

An update whose gradient is exactly zero (every token masked by its importance weight, or
every advantage 0) skips `optimizer.step`: AdamW would still move the weights by momentum
and decay. `optimizer_steps` in the metrics counts the updates taken.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from huggingface_hub import snapshot_download
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from trainer import plugins, prefix
from trainer.batch import Batch
from trainer.config import LossConfig
from trainer.loss import LossInputs, loss_denominator, policy_loss
from trainer.sampling import TokenSampling, processed_logprobs, processed_logprobs_and_entropy

# 1. Logprobs --------------------------------------------------------------------------------


def token_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    sampling: TokenSampling | None = None,
    share: bool = True,
    *,
    extend_support: bool = False,
    where: Tensor | None = None,
) -> Tensor:
    """[B,T] float32 log p(token_t | tokens_<t), aligned to positions; 0.0 at position 0 and on
    padding. input_ids, attention_mask: [B,T], right-padded. `sampling` ([B,T]): the
    temperature and truncation each token was sampled with (`trainer/sampling.py`), so p is
    the distribution vLLM drew it from; None is plain sampling (T = 1, whole vocabulary).

    A float32 log_softmax, then a gather: the computation vLLM's sampler does for the logprobs
    it records. On CPU that float32 normaliser over a 150k vocabulary is off by up to ~3e-4
    from float64, and vLLM's numbers carry the same error; gathering the logit and subtracting
    a (more accurate) logsumexp disagreed with them by 1.5e-4, this by 6e-6.

    Cost: the [M,V] float32 logits and log_softmax of the M tokens scored, which the backward
    keeps. `where` ([B,T] bool) names them, e.g. the sampled tokens, the only ones a loss
    reads (0.0 elsewhere): the LM head then runs on those positions alone (`prefix.logits`);
    None scores every token. `share`: rows' shared prefixes run once (`trainer/prefix.py`).
    `extend_support`: a token outside its truncation's kept set gets the logprob the KL
    compares (`sampling.py`) instead of the sentinel.
    """
    scored = _Scored.of(model, input_ids, attention_mask, where, share)
    if sampling is None:
        picked = scored.logits.log_softmax(dim=-1, dtype=torch.float32).gather(
            -1, scored.targets.unsqueeze(-1)
        )
        return scored.placed(picked.squeeze(-1))
    return scored.placed(
        processed_logprobs(
            scored.logits, scored.targets, scored.sampling(sampling), extend_support=extend_support
        )
    )


def token_logprobs_and_entropy(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    sampling: TokenSampling,
    loss_mask: Tensor,
    *,
    entropy_grad: bool,
    share: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """`token_logprobs(where=loss_mask)`, [B,T] the entropy of the distribution each token was
    drawn from, and `token_logprobs(where=loss_mask, extend_support=True)`, the logprobs a KL
    penalty compares, all at the tokens of `loss_mask` ([B,T]; 0 elsewhere): one forward, one
    log_softmax. With a gradient only when `entropy_grad` (an entropy bonus); logging it costs
    an exp and a dot over the vocabulary per trained token."""
    scored = _Scored.of(model, input_ids, attention_mask, loss_mask, share)
    everywhere = torch.ones_like(scored.targets, dtype=torch.bool)
    picked, entropy, extended = processed_logprobs_and_entropy(
        scored.logits, scored.targets, scored.sampling(sampling), everywhere, entropy_grad=entropy_grad
    )
    return scored.placed(picked), scored.placed(entropy), scored.placed(extended)


@dataclass(frozen=True, slots=True)
class _Scored:
    """The logits that score the tokens of [B,T] rows: all of them, or the chosen ones."""

    logits: Tensor
    """[B,T-1,V], position t-1's logits for token t; or [1,M,V] for the M chosen tokens."""
    targets: Tensor
    """[B,T-1] or [1,M]: the tokens they score."""
    attention_mask: Tensor
    chosen: Tensor | None
    """[B,T] bool: the chosen tokens; None: every one."""

    @classmethod
    def of(
        cls, model: nn.Module, input_ids: Tensor, attention_mask: Tensor, where: Tensor | None, share: bool
    ) -> _Scored:
        if where is None:
            logits = prefix.logits(model, input_ids, attention_mask, share=share)[:, :-1]
            return cls(logits, input_ids[:, 1:], attention_mask, None)
        # position 0 has no logits before it; position t-1's predict token t
        chosen = nn.functional.pad((where.bool() & attention_mask.bool())[:, 1:], (1, 0))
        at = nn.functional.pad(chosen[:, 1:], (0, 1))
        logits = prefix.logits(model, input_ids, attention_mask, share=share, at=at)
        return cls(logits[None], input_ids[chosen][None], attention_mask, chosen)

    def sampling(self, sampling: TokenSampling) -> TokenSampling:
        """`sampling` ([B,T]) aligned with `targets`."""
        return sampling.shifted() if self.chosen is None else sampling.at(self.chosen)

    def placed(self, values: Tensor) -> Tensor:
        """[B,T]: `values` (aligned with `targets`) at their tokens' positions, 0 elsewhere."""
        if self.chosen is None:
            return _aligned(values, self.attention_mask)
        zeros = torch.zeros(self.chosen.shape, dtype=values.dtype, device=values.device)
        return zeros.masked_scatter(self.chosen, values)


def _aligned(values: Tensor, attention_mask: Tensor) -> Tensor:
    """[B,T-1] values of the next token -> [B,T] at the token's position, 0 at 0 and on padding."""
    out = nn.functional.pad(values, (1, 0))
    return torch.where(attention_mask.bool(), out, torch.zeros_like(out))


# 2. Metrics ---------------------------------------------------------------------------------

_SUMMED = frozenset({"loss", "kept_tokens", "stale_tokens"})
_MAXED = frozenset({"is_ratio_max"})
_SHARED = frozenset({"grad_norm", "optimizer_steps"})
"""The same on every rank: the norm is of the whole, reduced gradient, and it decides the step."""


def merge_metrics(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """One metrics dict from those of micro-batches or ranks: counts and the loss (already
    divided by the step's D) add up, maxima take the max, shared values are taken once, and
    every other metric (a share or mean over kept tokens) is averaged weighted by kept tokens."""
    kept = sum(part["kept_tokens"] for part in parts)
    merged = {}
    for key in parts[0]:
        values = [part[key] for part in parts]
        if key in _SUMMED:
            merged[key] = sum(values)
        elif key in _MAXED:
            merged[key] = max(values)
        elif key in _SHARED:
            merged[key] = values[0]
        else:
            weighted = sum(v * part["kept_tokens"] for v, part in zip(values, parts, strict=True))
            merged[key] = weighted / max(kept, 1.0)
    return merged


def merge_updates(updates: Sequence[dict[str, float]], epochs: int) -> dict[str, float]:
    """A trainer step's metrics from those of its updates (`epochs` passes over the same
    mini-batches, in order): each epoch's mini-batches merge as micro-batches do (they
    partition the step's tokens), the epochs are averaged, and `optimizer_steps` adds up.
    `grad_norm` is the mean over the updates."""
    per_epoch = len(updates) // epochs
    epoch_metrics = [merge_metrics(updates[e * per_epoch : (e + 1) * per_epoch]) for e in range(epochs)]
    merged = {key: sum(m[key] for m in epoch_metrics) / epochs for key in epoch_metrics[0]}
    merged["grad_norm"] = sum(u["grad_norm"] for u in updates) / len(updates)
    merged["optimizer_steps"] = sum(u["optimizer_steps"] for u in updates)
    return merged


# 3. The policy ------------------------------------------------------------------------------


class Policy:
    """A causal LM (float32) and AdamW, trained by PPO steps of one or more updates.

    model_dir: a Hugging Face folder (the weights vLLM started with, or a pushed version).
    weight_decay: 0 by default; decay pulls towards zero, not towards the starting policy.
    device: where the model lives; batches are moved there.
    fsdp: shard every decoder layer and the root with FSDP2; needs an initialised process
        group (one per rank, `workers.TrainWorker`).
    reference: also hold a frozen copy of the initial weights, the reference of a KL penalty
        (`LossConfig.kl_coef`); it stays the initial weights when a checkpoint is loaded.
    shared_prefix: compute the prefix rows share once (`trainer/prefix.py`); False: padded rows.
    train_only: train only the parameters whose names start with one of these
        (`TrainerConfig.train_only`); the others are frozen and AdamW holds no state for them.
        Empty: every parameter.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        lr: float = 1e-5,
        max_grad_norm: float = 1.0,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        device: str | torch.device = "cpu",
        fsdp: bool = False,
        reference: bool = False,
        shared_prefix: bool = True,
        train_only: Sequence[str] = (),
    ):
        if max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be positive, got {max_grad_norm}")
        # a hub id is resolved to its local snapshot: save_weights copies the folder's files
        self.model_dir = (
            Path(model_dir) if Path(model_dir).is_dir() else Path(snapshot_download(str(model_dir)))
        )
        self.device = torch.device(device)
        self.max_grad_norm, self.shared_prefix = max_grad_norm, shared_prefix
        model = AutoModelForCausalLM.from_pretrained(str(self.model_dir), dtype=torch.float32).to(self.device)
        # eval() for good: dropout would make the training forward disagree with the sampler.
        self.model = model.eval()
        if fsdp:
            _shard(self.model)
        self.reference: nn.Module | None = None
        if reference:
            frozen = AutoModelForCausalLM.from_pretrained(str(self.model_dir), dtype=torch.float32)
            self.reference = frozen.to(self.device).eval().requires_grad_(False)
        self.optimizer = torch.optim.AdamW(
            _trained(self.model, train_only), lr=lr, betas=betas, weight_decay=weight_decay
        )

    def ppo_step(
        self,
        mini_batches: Sequence[Sequence[Batch]],
        current_version: int,
        loss: LossConfig,
        *,
        epochs: int = 1,
        denominators: Sequence[int] | None = None,
    ) -> dict[str, float]:
        """One trainer step: pi_old once, then `epochs` passes of one `train_step` per
        mini-batch (each a list of micro-batches).

        denominators: D of each mini-batch (`loss_denominator`); None counts them here (a
            data-parallel rank is given the counts over all ranks).

        Returns `merge_updates` of the updates' metrics; `optimizer_steps` is 0 when every
        update's gradient was zero, i.e. the step left the weights as they were.
        """
        if epochs < 1 or not mini_batches:
            raise ValueError(
                f"a step needs epochs >= 1 and a mini-batch, got {epochs} and {len(mini_batches)}"
            )
        counts = list(denominators) if denominators is not None else [None] * len(mini_batches)
        if epochs == 1 and len(mini_batches) == 1:
            update = self.train_step(mini_batches[0], current_version, loss, denominator=counts[0])
            return merge_updates([update], 1)
        with torch.no_grad():
            old = [[self.logprobs(mb) for mb in mini_batch] for mini_batch in mini_batches]
        updates = [
            self.train_step(mini_batch, current_version, loss, denominator=count, old_logprobs=old_logprobs)
            for _ in range(epochs)
            for mini_batch, count, old_logprobs in zip(mini_batches, counts, old, strict=True)
        ]
        return merge_updates(updates, epochs)

    def logprobs(self, micro_batch: Batch) -> Tensor:
        """[B,T] `token_logprobs` of a micro-batch's sampled tokens (its loss mask; 0 elsewhere)
        under the current weights, on `device`."""
        mb = micro_batch.to(self.device)
        return token_logprobs(
            self.model,
            mb.input_ids,
            mb.attention_mask,
            mb.sampling,
            share=self.shared_prefix,
            where=mb.loss_mask,
        )

    def reference_logprobs(self, micro_batch: Batch) -> Tensor:
        """[B,T] `token_logprobs` of a micro-batch's sampled tokens (its loss mask; 0 elsewhere)
        under the frozen reference, on `device`, for
        the KL: a sampled token outside the reference's truncation gets its logprob with the
        support extended by it (`sampling.py`), never the -87.3 sentinel."""
        if self.reference is None:
            raise RuntimeError("this Policy holds no reference model (Policy(reference=True))")
        mb = micro_batch.to(self.device)
        with torch.no_grad():
            return token_logprobs(
                self.reference,
                mb.input_ids,
                mb.attention_mask,
                mb.sampling,
                share=self.shared_prefix,
                extend_support=True,
                where=mb.loss_mask,
            )

    def train_step(
        self,
        micro_batches: Sequence[Batch],
        current_version: int,
        loss: LossConfig,
        *,
        denominator: int | None = None,
        old_logprobs: Sequence[Tensor] | None = None,
    ) -> dict[str, float]:
        """One optimizer step over all micro-batches, gradients accumulated in between.

        current_version: the trainer's weight version, for the staleness bound.
        denominator: D of the whole update (`loss_denominator`: its kept tokens, or its
            sequences, per `loss_agg`). None counts it here; a data-parallel rank is given the
            count over all ranks, so every token of the update weighs the same wherever it
            was computed.
        old_logprobs: [B,T] log pi_old of each micro-batch (`ppo_step` computes them before
            its first update); None takes this forward pass's own, detached: right while the
            weights are still those of pi_old.

        Returns `policy_loss`'s metrics merged over micro-batches (`kept_tokens` adds up to
        the update's kept tokens), `loss` (the update's loss), `grad_norm` (before clipping)
        and `optimizer_steps` (1, or 0 when the gradient was exactly zero and the weights were left alone).
        """
        if not micro_batches:
            raise ValueError("a step needs at least one micro-batch")
        if denominator is None:
            denominator = sum(
                loss_denominator(mb.loss_mask, mb.weight_versions, current_version, loss)
                for mb in micro_batches
            )
        self.optimizer.zero_grad(set_to_none=True)
        parts = []
        for i, micro_batch in enumerate(micro_batches):
            mb = micro_batch.to(self.device)
            logprobs, entropy, kl_logprobs = token_logprobs_and_entropy(
                self.model,
                mb.input_ids,
                mb.attention_mask,
                mb.sampling,
                mb.loss_mask,
                entropy_grad=loss.entropy_coef > 0,
                share=self.shared_prefix,
            )
            value, metrics = policy_loss(
                logprobs,
                mb.rollout_logprobs,
                mb.advantages,
                mb.loss_mask,
                mb.weight_versions,
                current_version,
                loss,
                old_logprobs=logprobs.detach() if old_logprobs is None else old_logprobs[i],
                denominator=denominator,
                entropy=entropy,
                ref_logprobs=self._reference_for_loss(micro_batch, loss),
                kl_logprobs=kl_logprobs,
                reproducible=mb.sampling.reproducible,
                loss_fn=loss_plugin(loss.loss, f"step {current_version + 1}, micro-batch {i}"),
            )
            value.backward()
            parts.append({"loss": value.item(), **metrics})
        grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        # the norm is global under FSDP, so every rank takes the same decision
        stepped = float(grad_norm) > 0.0
        if stepped:
            self.optimizer.step()
        return {**merge_metrics(parts), "grad_norm": float(grad_norm), "optimizer_steps": float(stepped)}

    def _reference_for_loss(self, micro_batch: Batch, loss: LossConfig) -> Tensor | None:
        """The reference's logprobs when the KL penalty is in the loss, else None."""
        if loss.kl_coef == 0 or loss.kl_in != "loss":
            return None
        return self.reference_logprobs(micro_batch)

    def save_weights(self, out_dir: str | Path) -> None:
        """Write a complete Hugging Face folder that vLLM can `reload_weights` from (or start
        on): the weights as safetensors, and every other file of `model_dir` as it was
        (config, tokenizer, chat template, generation config, licences).

        Written to a sibling temporary folder and renamed into place, so a reader never sees
        half a checkpoint. Under FSDP every rank must call this (the weights are gathered);
        rank 0 writes.
        """
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.model, options=options)
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        out = Path(out_dir)
        tmp, old = out.with_name(f".{out.name}.tmp"), out.with_name(f".{out.name}.old")
        shutil.rmtree(tmp, ignore_errors=True)
        self.model.save_pretrained(tmp, state_dict=state)
        # The source's config.json, not the one written: an FSDP-wrapped model would name its
        # wrapper class ("FSDPQwen3ForCausalLM") as the architecture, which vLLM cannot load.
        for source in self.model_dir.iterdir():
            if source.is_file() and not _is_weights(source):
                shutil.copyfile(source, tmp / source.name)
        if out.exists():
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)

    def state_dict(self) -> dict[str, Any]:
        """{"model", "optimizer"}: full (unsharded) state dicts on the CPU, keyed by parameter
        name, so a checkpoint loads into any number of ranks. Empty on ranks other than 0.

        "optimizer" is None before the first step: torch would initialise the state with a
        zero-gradient step, which Adam counts in its bias correction. On a single process the
        tensors are the live ones (as `nn.Module.state_dict`): save or copy them before the next
        step.
        """
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        optimizer = None
        if self.optimizer.state:
            optimizer = get_optimizer_state_dict(self.model, self.optimizer, options=options)
        return {"model": get_model_state_dict(self.model, options=options), "optimizer": optimizer}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s output; under FSDP every rank gets the full dicts."""
        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.model, state["model"], options=options)
        if state["optimizer"] is None:
            self.optimizer.state.clear()  # saved before the first step: Adam starts afresh
        else:
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=options)


def loss_plugin(spec: str, where: str) -> Callable[[LossInputs], tuple[Tensor, dict[str, float]]]:
    """The `--loss` plug-in `spec`, called through `plugins.call` (an exception names it and
    `where`), its result checked: a scalar tensor and a dict of numbers."""
    plugin = plugins.resolve("loss", spec)

    def run(inputs: LossInputs) -> tuple[Tensor, dict[str, float]]:
        result = plugins.call(plugin, inputs, where)
        ok = isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict)
        if not ok or not isinstance(result[0], Tensor) or result[0].dim() != 0:
            raise plugins.PluginError(f"{plugin} must return (a scalar tensor, a dict of metrics) at {where}")
        return result

    return run


def _trained(model: nn.Module, train_only: Sequence[str]) -> list[nn.Parameter]:
    """The parameters to train: those named with one of the `train_only` prefixes (all where
    it is empty); the others get `requires_grad` off, so no gradient reaches them or flows
    through layers that feed only them."""
    if not train_only:
        return list(model.parameters())
    named = dict(model.named_parameters())
    unknown = [p for p in train_only if not any(name.startswith(p) for name in named)]
    if unknown:
        raise ValueError(f"train_only {unknown} names no parameter of the model (e.g. {next(iter(named))})")
    for name, parameter in named.items():
        parameter.requires_grad_(name.startswith(tuple(train_only)))
    return [p for p in named.values() if p.requires_grad]


def _shard(model: nn.Module) -> None:
    """FSDP2 over the default process group: each decoder layer, then the rest at the root.

    Gradients are reduce-scattered as a plain SUM. By default FSDP2 averages them over the
    ranks (ReduceOp.AVG, or SUM then divide), which would scale the update by 1/world_size:
    every rank's loss is already divided by the global D, so the sum of the ranks' gradients
    is exactly the single-process gradient.
    """
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if type(module).__name__ in layer_classes:
            fully_shard(module)
    fully_shard(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def _is_weights(path: Path) -> bool:
    return path.suffix in (".safetensors", ".bin", ".pt") or path.name.endswith(".index.json")
