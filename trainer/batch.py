"""Trajectories as tensors: one right-padded batch, and its split into micro-batches or shards.

Owns the layout only: the token-first contract of a trajectory (ids, loss mask, rollout
logprobs and weight versions aligned 1:1) becomes [B,T] tensors, unchanged. It does not
choose which trajectories train together, compute advantages or run the model.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from molt_proxy.types import NOT_SAMPLED, Trajectory, Turn
from trainer.sampling import TokenSampling, token_sampling


@dataclass(slots=True)
class Batch:
    """B trajectories right-padded to T tokens. Padding is never trained on: its loss mask is 0."""

    input_ids: Tensor
    """[B,T] long: every token id the model saw or sampled; 0 on padding."""
    attention_mask: Tensor
    """[B,T] long: 1 on real tokens, 0 on padding (always a suffix of the row)."""
    loss_mask: Tensor
    """[B,T] long: 1 where the policy sampled the token and it trains; 0 on prompt tokens,
    padding, and sampled tokens left out by `TokenSampling.trainable` (greedy, unreproducible,
    constrained)."""
    rollout_logprobs: Tensor
    """[B,T] float32: vLLM's log mu of each sampled token; 0.0 elsewhere."""
    weight_versions: Tensor
    """[B,T] long: the weight version that sampled each token; NOT_SAMPLED (-1) elsewhere."""
    advantages: Tensor
    """[B] float32: one advantage per trajectory, shared by its sampled tokens; or [B,T] one
    per token (per-turn credit, `trainer/credit.py`)."""
    sampling: TokenSampling
    """[B,T] how each token was sampled (`trainer/sampling.py`): pi is recomputed under it."""

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device | str) -> Batch:
        return Batch(*(getattr(self, f.name).to(device) for f in fields(self)))

    def split(self, n: int) -> list[Batch]:
        """n batches balanced by real tokens, each trimmed to its own longest row.

        Rows go longest first to the part with the fewest tokens so far (and keep their order
        within a part). Data-parallel ranks must all run the same collectives, so a part that
        gets no row (n > B) holds one masked token instead: a forward and backward like any
        other, a gradient of exactly zero.
        """
        if n < 1:
            raise ValueError(f"cannot split a batch into {n} parts")
        lengths = self.attention_mask.sum(dim=1).tolist()
        rows: list[list[int]] = [[] for _ in range(n)]
        tokens = [0] * n
        for row in sorted(range(len(self)), key=lambda r: -lengths[r]):
            part = tokens.index(min(tokens))
            rows[part].append(row)
            tokens[part] += lengths[row]
        return [self.select(sorted(part)) if part else _masked_row() for part in rows]

    def select(self, rows: list[int]) -> Batch:
        """These rows, in this order, trimmed to their longest."""
        index = torch.tensor(rows)
        length = int(self.attention_mask[index].sum(dim=1).max())
        # indexing copies: a view pickled to another process would carry the whole batch
        return Batch(
            input_ids=self.input_ids[index, :length],
            attention_mask=self.attention_mask[index, :length],
            loss_mask=self.loss_mask[index, :length],
            rollout_logprobs=self.rollout_logprobs[index, :length],
            weight_versions=self.weight_versions[index, :length],
            advantages=self.advantages[index]
            if self.advantages.dim() == 1
            else self.advantages[index, :length],
            sampling=self.sampling.select(index, length),
        )


def _masked_row() -> Batch:
    """One real token that is never trained on: the shard of a rank that got no rows."""
    return _collate_rows([[0]], [[0]], [[0.0]], [[NOT_SAMPLED]], [0.0])


def collate(
    trajectories: list[Trajectory],
    advantages: list[float],
    *,
    train_greedy: bool = False,
    train_constrained: bool = False,
) -> Batch:
    """Stack trajectories and their advantages (one per trajectory) into one `Batch`. Greedy
    tokens train only with `train_greedy`, those of constrained turns only with
    `train_constrained`; unreproducible ones never (`trainer/sampling.py`)."""
    if not trajectories:
        raise ValueError("cannot collate an empty list of trajectories")
    for t in trajectories:
        lengths = {len(t.token_ids), len(t.loss_mask), len(t.logprobs), len(t.weight_versions)}
        if len(lengths) != 1 or not t.token_ids:
            raise ValueError(f"trajectory {t.trajectory_id} has misaligned or empty token fields")
    return _collate_rows(
        [t.token_ids for t in trajectories],
        [t.loss_mask for t in trajectories],
        [t.logprobs for t in trajectories],
        [t.weight_versions for t in trajectories],
        advantages,
        turns=[t.turns for t in trajectories],
        train_greedy=train_greedy,
        train_constrained=train_constrained,
    )


def _collate_rows(
    token_ids: list[list[int]],
    loss_mask: list[list[int]],
    logprobs: list[list[float]],
    weight_versions: list[list[int]],
    advantages: list[float],
    *,
    turns: list[list[Turn]] | None = None,
    train_greedy: bool = False,
    train_constrained: bool = False,
) -> Batch:
    """Right-pad aligned rows ([B] lists of [T_b]) and their [B] advantages into one `Batch`;
    `turns` say how their tokens were sampled (none: plainly, at T = 1)."""
    if len(advantages) != len(token_ids):
        raise ValueError(f"{len(token_ids)} rows but {len(advantages)} advantages")
    size, length = len(token_ids), max(len(ids) for ids in token_ids)
    batch = Batch(
        input_ids=torch.zeros(size, length, dtype=torch.long),
        attention_mask=torch.zeros(size, length, dtype=torch.long),
        loss_mask=torch.zeros(size, length, dtype=torch.long),
        rollout_logprobs=torch.zeros(size, length, dtype=torch.float32),
        weight_versions=torch.full((size, length), NOT_SAMPLED, dtype=torch.long),
        advantages=torch.tensor(advantages, dtype=torch.float32),
        sampling=token_sampling(turns or [[] for _ in token_ids], length),
    )
    for row, ids in enumerate(token_ids):
        n = len(ids)
        batch.input_ids[row, :n] = torch.tensor(ids)
        batch.attention_mask[row, :n] = 1
        batch.loss_mask[row, :n] = torch.tensor(loss_mask[row])
        batch.rollout_logprobs[row, :n] = torch.tensor(logprobs[row], dtype=torch.float32)
        batch.weight_versions[row, :n] = torch.tensor(weight_versions[row])
    batch.loss_mask = batch.sampling.trainable(batch.loss_mask, train_greedy, train_constrained)
    return batch
