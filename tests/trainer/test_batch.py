"""Trajectories as tensors, and their split into micro-batches or data-parallel shards."""

from __future__ import annotations

import torch

from molt_proxy.types import NOT_SAMPLED
from tests.trainer.builders import trajectory
from trainer.batch import collate


def rows_of(length_per_row: list[int]):
    return collate(
        [
            trajectory(i, f"s{i}", token_ids=list(range(1, n + 1)), prompt=1)
            for i, n in enumerate(length_per_row)
        ],
        [float(i) for i in range(len(length_per_row))],
    )


def test_collate_right_pads_with_not_sampled_and_a_zero_loss_mask():
    batch = rows_of([3, 5])
    assert batch.input_ids.tolist() == [[1, 2, 3, 0, 0], [1, 2, 3, 4, 5]]
    assert batch.loss_mask.tolist() == [[0, 1, 1, 0, 0], [0, 1, 1, 1, 1]]
    assert batch.weight_versions[0].tolist() == [NOT_SAMPLED, 0, 0, NOT_SAMPLED, NOT_SAMPLED]


def test_a_split_balances_tokens_not_rows():
    batch = rows_of([40, 10, 10, 10, 10])
    parts = batch.split(2)
    assert [int(p.attention_mask.sum()) for p in parts] == [40, 40]
    assert [p.advantages.tolist() for p in parts] == [[0.0], [1.0, 2.0, 3.0, 4.0]]  # rows keep their order
    assert parts[1].input_ids.shape == (4, 10)  # trimmed to its own longest row


def test_more_parts_than_rows_gives_masked_one_token_shards():
    batch = rows_of([6])
    whole, empty = batch.split(2)
    assert torch.equal(whole.input_ids, batch.input_ids)
    assert empty.input_ids.shape == (1, 1) and empty.attention_mask.tolist() == [[1]]
    assert empty.loss_mask.tolist() == [[0]] and empty.advantages.tolist() == [0.0]
