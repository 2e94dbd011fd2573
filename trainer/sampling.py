"""pi under the processing vLLM sampled with: temperature, min_p, top-k and top-p, per token.

Owns the arithmetic that turns the policy's logits into the distribution each recorded token
was drawn from, and the per-token record of which distribution that was (`TokenSampling`, built
from each turn's `Sampling`). It does not run the model (`policy.py`) or weigh tokens in the loss
(`loss.py`); the tokens it cannot reproduce leave the loss through the loss mask (`batch.py`).

vLLM (run with `--logprobs-mode processed_logprobs`) records log mu of each sampled token under
the processed distribution. vLLM 0.32's sampler (`v1/sample/sampler.py`, `ops/topk_topp_sampler.py`,
`logits_processor/builtin.py`) takes the float32 logits z of a position through, in order:

    1. logit_bias (z_v += b_v) and min_tokens (stop tokens at -inf while the turn is shorter);
    2. repetition, frequency and presence penalties (counts over the prompt and the tokens
       sampled so far);
    3. greedy (T = 0): the argmax is taken and log mu = log_softmax(z), at T = 1, untruncated;
    4. z' = z / T;
    5. min_p:  drop v where softmax(z')_v < min_p * max_u softmax(z')_u;
    6. top-k:  drop v where z'_v < the k-th largest z' (ties at the k-th all stay);
       top-p:  sort z' ascending, q = cumsum(softmax(z' sorted)), drop where q <= 1 - top_p
               (the largest always stays); the softmax is over what top-k kept;
    7. log mu_v = log_softmax(z' with dropped tokens at -inf)_v.

Here steps 3-7 are reproduced with the same float32 operations in the same order, so a fresh
policy's pi equals mu to ~1e-5 at any temperature and truncation. Steps 1-2 are not: a turn
with logit_bias or a penalty, and the first `min_tokens` tokens of a turn, are marked
unreproducible, and so is a turn recorded without its sampling (older stores). Their tokens
are left out of the loss and counted (`unreproducible_tokens`), never trained as if on-policy.
The seed picks the sample, not the distribution: it changes nothing here.

Constrained turns (`Turn.constrained`: structured outputs, e.g. a forced tool call) were sampled
with a grammar mask applied before step 3, and vLLM records log mu under the masked distribution
renormalised over the allowed tokens (measured: bench/RESULTS.md, block 10). Without the grammar
that is not reproducible either; `--constrained-turns skip` (the default) leaves their tokens out
and counts them (`constrained_tokens`), `train` keeps them against the unmasked pi.

Greedy tokens (T = 0) are not samples of any policy: the trainer leaves them out by default
and counts them (`greedy_tokens`); `--train-greedy` trains them with their T = 1 logprob,
which is what vLLM records for them.

Gradient: the kept set is a step function of the logits (its derivative is 0 almost
everywhere), so it is computed without gradient and held fixed; the gradient flows through
the kept logits and the temperature division. A token that falls outside the trainer's kept
set (the boundary moved by float noise, ~1e-5) would have log pi = -inf; it gets
`OUTSIDE_SUPPORT` instead, so its importance weight exp(pi - mu) is ~0 and its gradient 0.

The KL penalty cannot take that sentinel: against a reference whose kept set misses a sampled
token, log ref - log pi is ~ -86 (k2's gradient 86 times a normal one) and, the other way
round, k3 = e^86 (a loss of 1e36). Logprobs for the KL (`extend_support=True`) give such a
token its probability in the processed distribution with its support extended by that token,
p_t / (p(kept) + p_t), i.e. log p = z_t - logaddexp(logsumexp of the kept z, z_t), with its
gradient; a token inside the kept set gets its processed logprob unchanged. So pi and ref are
compared over the tokens both support (the kept set, and the sampled token, which the sampler
supported), and a fresh policy's KL to its own copy is 0 exactly as before (`loss.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from molt_proxy.types import Sampling, Turn

GREEDY_BELOW = 1e-5
"""vLLM's `_SAMPLING_EPS`: a temperature below it is greedy."""
OUTSIDE_SUPPORT = math.log(torch.finfo(torch.float32).tiny)
"""log pi (about -87.3) of a token outside the kept set: the smallest normal float32 probability."""

# 1. The per-token record -----------------------------------------------------------------


@dataclass(slots=True)
class TokenSampling:
    """How each token of a [B,T] batch was sampled. Prompt tokens and padding read as plain
    sampling (T = 1, no truncation), which is harmless: their loss mask is 0."""

    temperature: Tensor
    """[B,T] float32: T; 0 where the turn was greedy."""
    top_k: Tensor
    """[B,T] long: k; 0 is off."""
    top_p: Tensor
    """[B,T] float32: p; 1 is off."""
    min_p: Tensor
    """[B,T] float32: min_p; 0 is off."""
    reproducible: Tensor
    """[B,T] bool: False on sampled tokens whose distribution the trainer cannot reproduce."""
    constrained: Tensor
    """[B,T] bool: True on the sampled tokens of constrained turns (`Turn.constrained`): vLLM
    drew them from the grammar-masked distribution, which the trainer does not reproduce."""

    def to(self, device: torch.device | str) -> TokenSampling:
        return TokenSampling(*(getattr(self, f.name).to(device) for f in fields(self)))

    def select(self, index: Tensor | slice, length: int) -> TokenSampling:
        """Rows `index`, the first `length` positions (copies when `index` is a tensor)."""
        return TokenSampling(*(getattr(self, f.name)[index, :length] for f in fields(self)))

    def at(self, tokens: Tensor) -> TokenSampling:
        """[1,M]: the M tokens where `tokens` ([B,T] bool) is True, in row-major order."""
        return TokenSampling(*(getattr(self, f.name)[tokens][None] for f in fields(self)))

    def shifted(self) -> TokenSampling:
        """Positions 1..T-1: aligned with the logits of positions 0..T-2 that predict them."""
        return TokenSampling(*(getattr(self, f.name)[:, 1:] for f in fields(self)))

    def trainable(self, loss_mask: Tensor, train_greedy: bool, train_constrained: bool = False) -> Tensor:
        """[B,T] `loss_mask` without the tokens that must not train: unreproducible ones,
        greedy ones unless `train_greedy`, constrained ones unless `train_constrained`."""
        keep = self.reproducible if train_greedy else self.reproducible & (self.temperature >= GREEDY_BELOW)
        if not train_constrained:
            keep = keep & ~self.constrained
        return loss_mask * keep.to(loss_mask.dtype)

    def counts(self) -> dict[str, float]:
        """Sampled tokens sampled greedily (reproducible ones), unreproducible ones, and those
        of constrained turns (trained or not, as `--constrained-turns` says)."""
        greedy = (self.temperature < GREEDY_BELOW) & self.reproducible
        return {
            "greedy_tokens": float(greedy.sum()),
            "unreproducible_tokens": float((~self.reproducible).sum()),
            "constrained_tokens": float(self.constrained.sum()),
        }


def token_sampling(turns: list[list[Turn]], length: int) -> TokenSampling:
    """The record of B rows right-padded to `length`, from each row's turns: a turn's
    `Sampling` covers its sampled tokens, `completion_start:completion_end`."""
    size = len(turns)
    record = TokenSampling(
        temperature=torch.ones(size, length, dtype=torch.float32),
        top_k=torch.zeros(size, length, dtype=torch.long),
        top_p=torch.ones(size, length, dtype=torch.float32),
        min_p=torch.zeros(size, length, dtype=torch.float32),
        reproducible=torch.ones(size, length, dtype=torch.bool),
        constrained=torch.zeros(size, length, dtype=torch.bool),
    )
    for row, row_turns in enumerate(turns):
        for turn in row_turns:
            span = slice(turn.completion_start, turn.completion_end)
            record.constrained[row, span] = turn.constrained
            sampling = turn.sampling
            if sampling is None or not reproducible(sampling):
                record.reproducible[row, span] = False
                continue
            if sampling.min_tokens > 0:
                first = min(turn.completion_start + sampling.min_tokens, turn.completion_end)
                record.reproducible[row, turn.completion_start : first] = False
            record.temperature[row, span] = sampling.temperature
            if sampling.temperature >= GREEDY_BELOW:  # greedy: untruncated, whatever was sent
                record.top_k[row, span] = sampling.top_k
                record.top_p[row, span] = sampling.top_p
                record.min_p[row, span] = sampling.min_p
    return record


def reproducible(sampling: Sampling) -> bool:
    """Whether the trainer can recompute this turn's distribution exactly (steps 3-7 only)."""
    return (
        not sampling.logit_bias
        and sampling.presence_penalty == 0.0
        and sampling.frequency_penalty == 0.0
        and sampling.repetition_penalty == 1.0
    )


# 2. The processed distribution -----------------------------------------------------------


def processed_logprobs(
    logits: Tensor, targets: Tensor, sampling: TokenSampling, *, extend_support: bool = False
) -> Tensor:
    """[B,T] float32 log pi(targets) under vLLM's processing (steps 3-7).

    logits: [B,T,V] the policy's (float32), position t scoring targets[:, t]; targets: [B,T];
    sampling: aligned with targets. A batch sampled plainly (T = 1, no truncation) costs what
    a bare log_softmax + gather costs; any other temperature adds one [B,T,V] division.
    Truncation works on copies of its own positions' rows only, and top-p, which sorts the
    vocabulary, only on the rows that have top_p < 1.
    extend_support: a target outside the kept set gets its logprob with the support extended
    by it (for the KL, module docstring) instead of `OUTSIDE_SUPPORT`.
    """
    picked, _, extended = _processed(logits, targets, sampling, None)
    return extended if extend_support else picked


def processed_logprobs_and_entropy(
    logits: Tensor, targets: Tensor, sampling: TokenSampling, positions: Tensor, *, entropy_grad: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """`processed_logprobs`, [B,T] the entropy of the processed distribution (the one the
    token was drawn from) at `positions` ([B,T] bool, the sampled tokens), 0 elsewhere, and
    `processed_logprobs(extend_support=True)` (for the KL), all from the same log_softmax.
    Only those positions pay for the entropy (an exp and a dot over the vocabulary): in agent
    conversations most tokens are prompt. `entropy_grad`: whether the entropy carries a
    gradient (an entropy bonus in the loss) or is only logged."""
    return _processed(logits, targets, sampling, (positions, entropy_grad))


def _entropy(logp: Tensor, finite_logp: Tensor) -> Tensor:
    """[M] -sum_v p_v log p_v of [M,V] log probabilities; `finite_logp` is `logp` with 0 where
    it is -inf (tokens truncation dropped: p = 0 adds 0, with a zero gradient)."""
    return -(logp.exp().unsqueeze(-2) @ finite_logp.unsqueeze(-1)).flatten(-3)


def _processed(
    logits: Tensor, targets: Tensor, sampling: TokenSampling, entropy: tuple[Tensor, bool] | None
) -> tuple[Tensor, Tensor, Tensor]:
    """(log pi(targets), the entropy at the given positions, with a gradient or not; zeros
    when `entropy` is None, log pi(targets) with the support extended), all [B,T]."""
    temperature = sampling.temperature
    scale = torch.where(temperature < GREEDY_BELOW, torch.ones_like(temperature), temperature)
    if bool((scale != 1.0).any()):
        logits = logits / scale.unsqueeze(-1)
    logp = logits.log_softmax(dim=-1, dtype=torch.float32)
    picked = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropies = torch.zeros_like(picked)
    truncated = (sampling.top_k > 0) | (sampling.top_p < 1.0) | (sampling.min_p > 0.0)
    grad = entropy is not None and entropy[1] and torch.is_grad_enabled()
    with torch.set_grad_enabled(grad):
        if entropy is not None:
            plain = (entropy[0] & ~truncated).nonzero(as_tuple=True)
            rows = logp[plain]  # log_softmax of finite logits is finite
            entropies = entropies.index_put(plain, _entropy(rows, rows))
    if not bool(truncated.any()):
        return picked, entropies, picked
    where = truncated.nonzero(as_tuple=True)
    rows = logits[where]
    with torch.no_grad():
        kept = kept_tokens(rows, sampling.top_k[where], sampling.top_p[where], sampling.min_p[where])
    own_logp = rows.masked_fill(~kept, -math.inf).log_softmax(dim=-1, dtype=torch.float32)
    own = own_logp.gather(-1, targets[where].unsqueeze(-1)).squeeze(-1)
    outside = torch.isinf(own)
    # the kept z's logsumexp, read off at the most likely token, which every truncation keeps
    top = rows.argmax(dim=-1, keepdim=True)
    log_kept = (rows.gather(-1, top) - own_logp.gather(-1, top)).squeeze(-1)
    z = rows.gather(-1, targets[where].unsqueeze(-1)).squeeze(-1)
    extended = torch.where(outside, z - torch.logaddexp(log_kept, z), own)
    own = torch.where(outside, torch.full_like(own, OUTSIDE_SUPPORT), own)
    with torch.set_grad_enabled(grad):
        if entropy is not None:
            values = _entropy(own_logp, own_logp.masked_fill(~kept, 0.0))
            entropies = entropies.index_put(where, torch.where(entropy[0][where], values, 0.0))
    return picked.index_put(where, own), entropies, picked.index_put(where, extended)


def kept_tokens(logits: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor) -> Tensor:
    """[M,V] bool: the tokens min_p, top-k and top-p keep (steps 5-6), as vLLM computes them.

    logits: [M,V] float32, already divided by T; top_k [M] (0: off), top_p [M] (1: off),
    min_p [M] (0: off).
    """
    vocab = logits.shape[-1]
    kept = torch.ones_like(logits, dtype=torch.bool)
    if bool((min_p > 0.0).any()):
        probs = logits.softmax(dim=-1)
        kept &= ~(probs < probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(-1))
        logits = logits.masked_fill(~kept, -math.inf)
    k = torch.where((top_k <= 0) | (top_k >= vocab), torch.full_like(top_k, vocab), top_k)
    nucleus = top_p < 1.0
    # top-k alone: compare with the k-th largest value, no sort (vLLM's `apply_top_k_only`)
    only_k = (k < vocab) & ~nucleus
    if bool(only_k.any()):
        rows = logits[only_k]
        kth = rows.topk(int(k[only_k].max()), dim=-1).values.gather(-1, (k[only_k] - 1).unsqueeze(-1))
        kept[only_k] &= rows >= kth
    if bool(nucleus.any()):
        kept[nucleus] &= _top_k_top_p(logits[nucleus], k[nucleus], top_p[nucleus])
    return kept


def _top_k_top_p(logits: Tensor, k: Tensor, p: Tensor) -> Tensor:
    """[N,V] kept by top-k then top-p: vLLM's `apply_top_k_top_p_pytorch`, op for op."""
    vocab = logits.shape[-1]
    ascending, order = logits.sort(dim=-1, descending=False)
    kth = ascending.gather(1, (vocab - k).unsqueeze(1))
    ascending = ascending.masked_fill(ascending < kth, -math.inf)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    dropped = cumulative <= 1 - p.unsqueeze(1)
    dropped[:, -1] = False  # at least one
    dropped |= torch.isinf(ascending)
    return torch.zeros_like(dropped).scatter(-1, order, ~dropped)
