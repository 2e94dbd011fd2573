"""The policy loss: a PPO-style clipped surrogate, corrected for the train/rollout mismatch.

Owns the per-token arithmetic of one micro-batch: which tokens count, how much each weighs,
and the normalisation over the whole optimizer step. It does not run the model (the trainer's
forward pass gives `logprobs`), compute advantages (`advantage.py`) or split micro-batches.

Three policies meet here, per sampled token t (four with a KL penalty):

    pi      the current policy, `logprobs`: the only input with a gradient;
    pi_old  the proximal policy of the trust region, `old_logprobs` (default: mu): the weights
            at the start of the trainer's step (`policy.ppo_step`), so r = pi / pi_old is 1
            in a step's first update and the clip acts from its second (`--ppo-epochs`,
            `--mini-batches`);
    mu      the policy vLLM sampled with, `rollout_logprobs`. It differs from pi_old even at
            the same weights (other kernels and precision), and more so when it is a few
            weight versions behind, as asynchronous training makes it;
    ref     the frozen reference policy (the initial weights), `ref_logprobs`, loaded only
            with `--kl-coef` above 0.

The loss ("decoupled PPO", Hilton et al. 2022, as in AReaL) is

    loss = 1/D * sum_i sum_{t kept in i} c_i * l_t
    l_t  = -w_t * min(r_t * A_t, clip(r_t, 1 - clip_low, 1 + clip_high) * A_t)
           - entropy_coef * H_t + kl_coef * k_t

    H_t = entropy of pi at t (of the distribution the token was drawn from), with gradient:
          a bonus that keeps the policy from collapsing early; off (0) by default
    k_t = KL estimate of pi against the frozen reference at t (`kl_estimate`), with gradient,
          when `kl_in` is loss; off (0) by default

    r_t = exp(pi_t - pi_old_t)          PPO ratio; the gradient flows through it. With
                                        `ratio_level` sequence (GSPO), every token of
                                        sequence i has r_t = s_i = exp(mean over its kept
                                        tokens of (pi_t - pi_old_t)), clipped as one
    w_t = f(exp(pi_old_t - mu_t))       train/rollout importance weight, no gradient;
                                        f truncates or masks (`LossConfig.is_mode`)
    kept = sampled (loss_mask 1) and at most `max_staleness` weight versions old

Aggregation (`--loss-agg`), over sequences i (rows: one segment each) and their n_i kept
tokens, with D counted over the whole optimizer step (its mini-batch), so micro-batches add up
to the full-batch loss:

    token-mean            c_i = 1      D = kept tokens of the step (sum n_i)
                          every token weighs the same; long answers weigh more (DAPO)
    seq-mean-token-sum    c_i = 1      D = sequences of the step with a kept token
                          a sequence's tokens add up; a constant normaliser, no length
                          bias in the gradient (Dr.GRPO)
    seq-mean-token-mean   c_i = 1/n_i  D = sequences of the step with a kept token
                          every sequence weighs the same whatever its length (GRPO's paper)

Tokens masked by the importance weight stay in n_i and D: masking is an importance weight of
zero, not a change of the sample, and D must be known before any micro-batch's forward pass.

KL under truncated sampling (top-k, top-p, min-p): pi and ref are the processed distributions
(`sampling.py`), each truncated by its own logits. Where a sampled token is outside one kept
set, that side's true probability is 0 and the KL infinite; the sentinel logprob standing in
for it (-87.3) made k3 = e^85 (a loss of 2.3e36) and k2's gradient 86 times a normal one
(issue 26). So k_t compares `kl_logprobs` with `ref_logprobs`, both computed with
`extend_support`: the sampled token keeps its processed logprob where its distribution kept
it, and where truncation dropped it, its probability over the kept set plus itself. The KL is
then taken over what both distributions support (their kept sets, and the token the sampler
did draw), finite and smooth in the logits, 0 where pi and ref agree; untruncated sampling is
unaffected. The PPO ratio keeps the sentinel: there it makes a token the trainer cannot
reproduce weigh ~0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from trainer.config import LossConfig

# 1. Which tokens count ----------------------------------------------------------------------


def _kept(loss_mask: Tensor, weight_versions: Tensor, current_version: int, config: LossConfig) -> Tensor:
    """[B,T] bool: tokens the policy sampled recently enough to train on."""
    sampled = loss_mask.bool()
    if config.max_staleness is None:
        return sampled
    return sampled & (current_version - weight_versions <= config.max_staleness)


def count_loss_tokens(
    loss_mask: Tensor, weight_versions: Tensor, current_version: int, config: LossConfig
) -> int:
    """The kept tokens of one micro-batch. loss_mask, weight_versions: [B,T]."""
    return int(_kept(loss_mask, weight_versions, current_version, config).sum())


def loss_denominator(
    loss_mask: Tensor, weight_versions: Tensor, current_version: int, config: LossConfig
) -> int:
    """D of one micro-batch under `loss_agg`: its kept tokens, or its sequences with a kept
    token. Add it up over the step's micro-batches for `policy_loss(denominator=)`; needs no
    forward pass, so it can run before the first. loss_mask, weight_versions: [B,T]."""
    kept = _kept(loss_mask, weight_versions, current_version, config)
    return int(kept.sum() if config.loss_agg == "token-mean" else kept.any(dim=-1).sum())


def _token_shares(kept: Tensor, config: LossConfig, dtype: torch.dtype) -> Tensor:
    """[B,T] c_i on kept tokens, 0 elsewhere: what each token's term is multiplied by before
    the sum that D divides."""
    shares = kept.to(dtype)
    if config.loss_agg == "seq-mean-token-mean":
        shares = shares / shares.sum(dim=-1, keepdim=True).clamp(min=1.0)
    return shares


# 2. Train/rollout importance weights --------------------------------------------------------


def _importance_weights(log_ratio: Tensor, kept: Tensor, config: LossConfig) -> tuple[Tensor, Tensor]:
    """(ratio, weight), both [B,T], from log(pi_old / mu) [B,T] that is 0 where not kept.

    At sequence level the ratio is exp(mean of the log ratios over kept tokens), i.e. the
    geometric mean of the token ratios, broadcast over the sequence.
    """
    if config.is_level == "sequence":
        log_ratio = _sequence_mean(log_ratio, kept)
    ratio = log_ratio.exp()
    if config.is_mode == "truncate":
        return ratio, ratio.clamp(max=config.is_high)
    inside = (ratio >= config.is_low) & (ratio <= config.is_high)
    return ratio, torch.where(inside, ratio, torch.zeros_like(ratio))


def _sequence_mean(values: Tensor, kept: Tensor) -> Tensor:
    """[B,T]: each row's mean over its kept tokens of `values` (0 where not kept), on every
    position of the row."""
    tokens = kept.sum(dim=-1, keepdim=True).clamp(min=1)
    return (values.sum(dim=-1, keepdim=True) / tokens).expand_as(values)


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> Tensor:
    """[B,T] per-token estimate of KL(pi || ref) from tokens drawn from pi, x = log ref - log pi:
    k1 = -x, k2 = x^2 / 2, k3 = e^x - 1 - x (Schulman 2020). The gradient flows through
    `logprobs`; `ref_logprobs` is frozen."""
    x = ref_logprobs.detach() - logprobs
    if estimator == "k1":
        return -x
    if estimator == "k2":
        return 0.5 * x * x
    return x.exp() - 1.0 - x


# 3. The loss plug point --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LossInputs:
    """What a loss (`--loss`, `trainer/plugins.py`) gets for one micro-batch of B sequences
    (rows: one segment each, right-padded to T). Every [B,T] tensor is aligned to token
    positions (column t holds token t's values: its logprob given the tokens before it) and
    is 0 wherever `loss_mask` is False, so padding's arbitrary values (even -inf) never reach
    a loss or its gradient."""

    logprobs: Tensor
    """[B,T] float32 log pi of each token under the weights being trained: the one input with
    a gradient, under the temperature and truncation the token was sampled with."""
    old_logprobs: Tensor
    """[B,T] log pi_old, the weights at the start of the step (the proximal policy); equal to
    `logprobs` (detached) in a step's first update."""
    rollout_logprobs: Tensor
    """[B,T] log mu, what vLLM recorded when it sampled the token."""
    advantages: Tensor
    """[B,T] each token's advantage (a per-trajectory one on every token of the row)."""
    loss_mask: Tensor
    """[B,T] bool: the tokens that train. Sampled by the policy, reproducible, not greedy or
    constrained unless asked (`--train-greedy`, `--constrained-turns train`), and at most
    `max_staleness` weight versions old."""
    reproducible: Tensor
    """[B,T] bool: the trainer recomputes exactly the distribution vLLM drew the token from
    (`sampling.py`); False for a turn with penalties or logit_bias, or recorded without its
    sampling. Unreproducible tokens are never in `loss_mask`."""
    shares: Tensor
    """[B,T] c_i, a token's weight under `--loss-agg` (1, or 1/n_i) on `loss_mask`, 0 elsewhere."""
    denominator: int
    """D of the whole optimizer step (`--loss-agg`): summing `shares * term / D` over the
    step's micro-batches gives the full-batch loss, however it was split."""
    config: LossConfig
    """The `--clip-*`, `--is-*`, `--kl-*` and `--entropy-coef` knobs, for a loss that reads them."""
    entropy: Tensor | None = None
    """[B,T] entropy of pi where the token was drawn, with a gradient if `entropy_coef` > 0."""
    ref_logprobs: Tensor | None = None
    """[B,T] log ref under the frozen initial weights; only with `--kl-coef` > 0 and `--kl-in loss`."""
    kl_logprobs: Tensor | None = None
    """[B,T] `logprobs` with the support extended where truncation dropped the token: the pi a
    KL against `ref_logprobs` compares (module docstring)."""

    def aggregate(self, per_token: Tensor) -> Tensor:
        """The micro-batch's share of the step's loss from [B,T] per-token terms: sum c_i * l_t / D."""
        kept = torch.where(self.loss_mask, per_token, torch.zeros_like(per_token))
        return (kept * self.shares).sum() / max(self.denominator, 1)


def policy_loss(
    logprobs: Tensor,
    rollout_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    weight_versions: Tensor,
    current_version: int,
    config: LossConfig,
    *,
    old_logprobs: Tensor | None = None,
    denominator: int | None = None,
    entropy: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    kl_logprobs: Tensor | None = None,
    reproducible: Tensor | None = None,
    loss_fn: Callable[[LossInputs], tuple[Tensor, dict[str, float]]] | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The loss of one micro-batch under `loss_fn` (default `clipped_surrogate`), and its metrics.

    logprobs: [B,T] log pi of each token under the current weights, with gradient.
    rollout_logprobs: [B,T] log mu recorded by vLLM (0.0 where loss_mask is 0).
    advantages: [B] one per sequence, or [B,T] one per token.
    loss_mask: [B,T] 1 where the policy sampled the token; 0 for prompt and padding.
    weight_versions: [B,T] weight version that sampled each token (-1 where loss_mask is 0).
    current_version: the trainer's weight version, for the staleness bound.
    old_logprobs: [B,T] log pi_old, the proximal policy; None uses rollout_logprobs, which
        makes every importance weight 1 and clips directly against the sampler.
    denominator: D, of the whole step (the sum of `loss_denominator` over its micro-batches);
        None uses this micro-batch's own.
    entropy: [B,T] the entropy of pi at each token's position (the distribution it was drawn
        from); logged, and `entropy_coef` times it subtracted from each kept token's term
        (with its gradient) when that is above 0.
    ref_logprobs: [B,T] log ref, the frozen reference policy's; the KL estimate against it is
        logged, and `kl_coef` times it added to each kept token's term when `kl_in` is loss.
    kl_logprobs: [B,T] log pi for the KL term, with gradient: `logprobs` with the support
        extended where truncation dropped the token (module docstring); None uses `logprobs`.
    reproducible: [B,T] bool (`TokenSampling.reproducible`); None: every token.

    Metrics of every loss (over this micro-batch's kept tokens): `kept_tokens`;
    `stale_tokens` withheld; `approx_kl`, the k3 estimate of KL(mu || pi): mean of
    rho - 1 - log rho, rho = pi / mu; `entropy`, the mean entropy (when given); then the
    loss's own (`clipped_surrogate` lists the built-in's), each a mean over kept tokens.
    """
    _check_shapes(logprobs, rollout_logprobs, old_logprobs, advantages, loss_mask, weight_versions)
    kept = _kept(loss_mask, weight_versions, current_version, config)
    local = loss_denominator(loss_mask, weight_versions, current_version, config)
    if denominator is None:
        denominator = local
    elif denominator < local:
        raise ValueError(
            f"denominator={denominator} is below this micro-batch's own {local} "
            f"({config.loss_agg}); sum loss_denominator over the step"
        )
    zeros = torch.zeros_like(logprobs)

    def on_kept(values: Tensor | None) -> Tensor | None:
        # Padding may hold any value (even -inf): zeroed before any exp, so that neither the
        # loss nor the gradient can become inf or nan.
        return None if values is None else torch.where(kept, values, zeros)

    rollout = on_kept(rollout_logprobs.detach())
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    inputs = LossInputs(
        logprobs=on_kept(logprobs),
        old_logprobs=rollout if old_logprobs is None else on_kept(old_logprobs.detach()),
        rollout_logprobs=rollout,
        advantages=on_kept(adv.expand_as(logprobs).to(logprobs.dtype)),
        loss_mask=kept,
        reproducible=torch.ones_like(kept) if reproducible is None else reproducible.bool(),
        shares=_token_shares(kept, config, logprobs.dtype),
        denominator=denominator,
        config=config,
        entropy=on_kept(entropy),
        ref_logprobs=on_kept(ref_logprobs),
        kl_logprobs=on_kept(kl_logprobs),
    )
    loss, own = (loss_fn or clipped_surrogate)(inputs)
    with torch.no_grad():
        share = 1.0 / max(int(kept.sum()), 1)
        rho_log = inputs.logprobs - rollout
        metrics = {
            "kept_tokens": float(kept.sum()),
            "stale_tokens": float((loss_mask.bool() & ~kept).sum()),
            "approx_kl": share * float((rho_log.exp() - 1.0 - rho_log).sum()),
        }
        if entropy is not None:
            metrics["entropy"] = share * float(entropy[kept].sum())
    return loss, {**metrics, **{name: float(value) for name, value in own.items()}}


# 4. The built-in loss -----------------------------------------------------------------------


def clipped_surrogate(inputs: LossInputs) -> tuple[Tensor, dict[str, float]]:
    """The built-in `--loss ppo`: the decoupled PPO loss of the module docstring, with its
    train/rollout importance weights, entropy bonus and KL term as `inputs.config` sets them.

    Metrics (over kept tokens): `clip_frac_low` / `clip_frac_high`, the share whose gradient
    the clip removes; `is_ratio_mean` / `is_ratio_max` of exp(pi_old - mu) at the configured
    level; `is_truncated_frac` / `is_masked_frac`, the share whose weight was capped / zeroed;
    `kl_ref`, the mean `kl_estimate` (with a reference).
    """
    config, kept, adv = inputs.config, inputs.loss_mask, inputs.advantages
    log_r = inputs.logprobs - inputs.old_logprobs
    if config.ratio_level == "sequence":
        log_r = _sequence_mean(log_r, kept)
    r = log_r.exp()
    with torch.no_grad():
        is_ratio, weight = _importance_weights(inputs.old_logprobs - inputs.rollout_logprobs, kept, config)
    surrogate = torch.minimum(r * adv, r.clamp(1.0 - config.clip_low, 1.0 + config.clip_high) * adv)
    per_token = -weight * surrogate
    if inputs.entropy is not None and config.entropy_coef > 0:
        per_token = per_token - config.entropy_coef * inputs.entropy
    if inputs.ref_logprobs is not None:
        pi = inputs.logprobs if inputs.kl_logprobs is None else inputs.kl_logprobs
        kl_ref = kl_estimate(pi, inputs.ref_logprobs, config.kl_estimator)
        if config.kl_in == "loss":
            per_token = per_token + config.kl_coef * kl_ref
    loss = inputs.aggregate(per_token)
    with torch.no_grad():
        metrics = _metrics(kept, adv, r, is_ratio, weight, config)
        if inputs.ref_logprobs is not None:
            metrics["kl_ref"] = float(kl_ref[kept].sum()) / max(int(kept.sum()), 1)
    return loss, metrics


def _metrics(
    kept: Tensor,
    adv: Tensor,
    r: Tensor,
    is_ratio: Tensor,
    weight: Tensor,
    config: LossConfig,
) -> dict[str, float]:
    """The clip and importance-weight statistics over kept tokens."""
    local_tokens = int(kept.sum())
    share = 1.0 / max(local_tokens, 1)
    # the min picks the clipped term (no gradient) only on the side the advantage points to
    clipped_low = kept & (adv < 0) & (r < 1.0 - config.clip_low)
    clipped_high = kept & (adv > 0) & (r > 1.0 + config.clip_high)
    return {
        "clip_frac_low": share * float(clipped_low.sum()),
        "clip_frac_high": share * float(clipped_high.sum()),
        "is_ratio_mean": share * float(is_ratio[kept].sum()),
        "is_ratio_max": float(is_ratio[kept].max()) if local_tokens else 0.0,
        "is_truncated_frac": share * float((kept & (weight > 0) & (weight < is_ratio)).sum()),
        "is_masked_frac": share * float((kept & (weight == 0)).sum()),
    }


def _check_shapes(
    logprobs: Tensor,
    rollout_logprobs: Tensor,
    old_logprobs: Tensor | None,
    advantages: Tensor,
    loss_mask: Tensor,
    weight_versions: Tensor,
) -> None:
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B,T], got shape {tuple(logprobs.shape)}")
    shape = logprobs.shape
    named = {
        "rollout_logprobs": rollout_logprobs,
        "old_logprobs": old_logprobs,
        "loss_mask": loss_mask,
        "weight_versions": weight_versions,
    }
    for name, tensor in named.items():
        if tensor is not None and tensor.shape != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, logprobs {tuple(shape)}")
    if advantages.shape not in (shape[:1], shape):
        raise ValueError(f"advantages must be [B] or [B,T] = {tuple(shape)}, got {tuple(advantages.shape)}")
