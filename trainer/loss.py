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


# 3. The loss --------------------------------------------------------------------------------


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
) -> tuple[Tensor, dict[str, float]]:
    """The clipped, importance-weighted policy loss of one micro-batch, and its metrics.

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

    Metrics (over this micro-batch's kept tokens): `kept_tokens`; `stale_tokens` withheld;
    `clip_frac_low` / `clip_frac_high`, the share whose gradient the clip removes;
    `is_ratio_mean` / `is_ratio_max` of exp(pi_old - mu) at the configured level;
    `is_truncated_frac` / `is_masked_frac`, the share whose weight was capped / zeroed;
    `approx_kl`, the k3 estimate of KL(mu || pi): mean of rho - 1 - log rho, rho = pi / mu;
    `entropy`, the mean entropy, and `kl_ref`, the mean `kl_estimate` (each when given).
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

    rollout = rollout_logprobs.detach()
    old = rollout if old_logprobs is None else old_logprobs.detach()
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    zeros = torch.zeros_like(logprobs)
    # Padding may hold any value (even -inf); zero the log ratios there before exp so that
    # neither the loss nor the gradient can become inf or nan.
    log_r = torch.where(kept, logprobs - old, zeros)
    if config.ratio_level == "sequence":
        log_r = _sequence_mean(log_r, kept)
    r = log_r.exp()
    with torch.no_grad():
        is_ratio, weight = _importance_weights(torch.where(kept, old - rollout, zeros), kept, config)

    surrogate = torch.minimum(r * adv, r.clamp(1.0 - config.clip_low, 1.0 + config.clip_high) * adv)
    per_token = -weight * surrogate
    if entropy is not None and config.entropy_coef > 0:
        per_token = per_token - config.entropy_coef * entropy
    if ref_logprobs is not None:
        # zeros off the kept tokens, as for the ratios: padding's -inf would make nan gradients
        pi = logprobs if kl_logprobs is None else kl_logprobs
        kl_ref = kl_estimate(
            torch.where(kept, pi, zeros), torch.where(kept, ref_logprobs, zeros), config.kl_estimator
        )
        if config.kl_in == "loss":
            per_token = per_token + config.kl_coef * kl_ref
    per_token = torch.where(kept, per_token, zeros)
    loss = (per_token * _token_shares(kept, config, per_token.dtype)).sum() / max(denominator, 1)

    with torch.no_grad():
        metrics = _metrics(kept, loss_mask, adv, r, is_ratio, weight, config)
        share = 1.0 / max(int(kept.sum()), 1)
        rho_log = torch.where(kept, logprobs - rollout, zeros)
        metrics["approx_kl"] = share * float((rho_log.exp() - 1.0 - rho_log).sum())
        if entropy is not None:
            metrics["entropy"] = share * float(entropy[kept].sum())
        if ref_logprobs is not None:
            metrics["kl_ref"] = share * float(kl_ref[kept].sum())
    return loss, metrics


def _metrics(
    kept: Tensor,
    loss_mask: Tensor,
    adv: Tensor,
    r: Tensor,
    is_ratio: Tensor,
    weight: Tensor,
    config: LossConfig,
) -> dict[str, float]:
    """Token counts, and the clip and importance-weight statistics over kept tokens."""
    local_tokens = int(kept.sum())
    share = 1.0 / max(local_tokens, 1)
    # the min picks the clipped term (no gradient) only on the side the advantage points to
    clipped_low = kept & (adv < 0) & (r < 1.0 - config.clip_low)
    clipped_high = kept & (adv > 0) & (r > 1.0 + config.clip_high)
    return {
        "kept_tokens": float(local_tokens),
        "stale_tokens": float((loss_mask.bool() & ~kept).sum()),
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
