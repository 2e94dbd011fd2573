"""Trajectories as tensors: one right-padded batch, and its split into micro-batches or shards.

Owns the layout only: the token-first contract of a trajectory (ids, loss mask, rollout
logprobs and weight versions aligned 1:1) becomes [B,T] tensors, unchanged. It does not
choose which trajectories train together, compute advantages or run the model.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

_FIELDS = ("token_ids", "loss_mask", "logprobs", "weight_versions")


@dataclass(slots=True)
class Batch:
    """B trajectories right-padded to T tokens. Padding is never trained on: its loss mask is 0."""

    input_ids: Tensor
    """[B,T] long: every token id the model saw or sampled; 0 on padding."""
    attention_mask: Tensor
    """[B,T] long: 1 on real tokens, 0 on padding (always a suffix of the row)."""
    loss_mask: Tensor
    """[B,T] long: 1 where the policy sampled the token; 0 on prompt tokens and padding."""
    rollout_logprobs: Tensor
    """[B,T] float32: vLLM's log mu of each sampled token; 0.0 elsewhere."""
    weight_versions: Tensor
    """[B,T] long: the weight version that sampled each token; -1 elsewhere."""
    advantages: Tensor
    """[B] float32: one advantage per trajectory, shared by its sampled tokens."""

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device | str) -> Batch:
        return Batch(*(getattr(self, f.name).to(device) for f in fields(self)))

    def split(self, n: int) -> list[Batch]:
        """n batches of consecutive rows, sizes differing by at most one, each trimmed to its own
        longest row. Data-parallel ranks must all get rows (each runs the same collectives), so
        n may not exceed B."""
        if not 1 <= n <= len(self):
            raise ValueError(f"cannot split a batch of {len(self)} rows into {n} parts")
        parts = []
        for chunk in torch.arange(len(self)).tensor_split(n):
            rows = slice(int(chunk[0]), int(chunk[-1]) + 1)
            length = int(self.attention_mask[rows].sum(dim=1).max())
            # clones, not views: a view pickled to another process would carry the whole batch
            parts.append(
                Batch(
                    input_ids=self.input_ids[rows, :length].clone(),
                    attention_mask=self.attention_mask[rows, :length].clone(),
                    loss_mask=self.loss_mask[rows, :length].clone(),
                    rollout_logprobs=self.rollout_logprobs[rows, :length].clone(),
                    weight_versions=self.weight_versions[rows, :length].clone(),
                    advantages=self.advantages[rows].clone(),
                )
            )
        return parts


def collate(trajectories: list[dict[str, Any]], advantages: list[float]) -> Batch:
    """Stack trajectory records (README's schema) and their advantages into one `Batch`."""
    if not trajectories:
        raise ValueError("cannot collate an empty list of trajectories")
    if len(advantages) != len(trajectories):
        raise ValueError(f"{len(trajectories)} trajectories but {len(advantages)} advantages")
    for trajectory in trajectories:
        lengths = {name: len(trajectory[name]) for name in _FIELDS}
        if len(set(lengths.values())) != 1 or lengths["token_ids"] == 0:
            raise ValueError(f"trajectory {trajectory.get('trajectory_id')} has misaligned fields {lengths}")
    size, length = len(trajectories), max(len(t["token_ids"]) for t in trajectories)
    batch = Batch(
        input_ids=torch.zeros(size, length, dtype=torch.long),
        attention_mask=torch.zeros(size, length, dtype=torch.long),
        loss_mask=torch.zeros(size, length, dtype=torch.long),
        rollout_logprobs=torch.zeros(size, length, dtype=torch.float32),
        weight_versions=torch.full((size, length), -1, dtype=torch.long),
        advantages=torch.tensor(advantages, dtype=torch.float32),
    )
    for row, trajectory in enumerate(trajectories):
        n = len(trajectory["token_ids"])
        batch.input_ids[row, :n] = torch.tensor(trajectory["token_ids"])
        batch.attention_mask[row, :n] = 1
        batch.loss_mask[row, :n] = torch.tensor(trajectory["loss_mask"])
        batch.rollout_logprobs[row, :n] = torch.tensor(trajectory["logprobs"], dtype=torch.float32)
        batch.weight_versions[row, :n] = torch.tensor(trajectory["weight_versions"])
    return batch
