"""CISPO (MiniMax-M1, 2025): clip the importance-sampling weight, not the update.

PPO's clip drops the gradient of a token whose ratio left the trust region, and those are
often the rare tokens that matter (a "wait" that starts a reflection). CISPO keeps every
token's gradient and bounds its weight instead:

    l_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A_t * log pi_t,   r_t = pi_t / mu_t

with mu the policy vLLM sampled with and sg() no gradient, token-mean over the step. The
bounds are `--clip-low` / `--clip-high` (MiniMax set eps_low so large it never binds).

    python -m trainer ... --loss examples/algorithms/cispo.py:cispo
"""

from __future__ import annotations

import torch
from torch import Tensor

from trainer.loss import LossInputs


def cispo(inputs: LossInputs) -> tuple[Tensor, dict[str, float]]:
    config, kept = inputs.config, inputs.loss_mask
    with torch.no_grad():
        ratio = (inputs.logprobs - inputs.rollout_logprobs).exp()
        weight = ratio.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
    loss = inputs.aggregate(-weight * inputs.advantages * inputs.logprobs)
    tokens = max(int(kept.sum()), 1)
    clipped = kept & (weight != ratio)
    return loss, {"cispo_clip_frac": float(clipped.sum()) / tokens}
