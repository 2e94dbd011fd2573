"""Shared-prefix packing: rows of a micro-batch that begin with the same tokens run that prefix
once.

The attempts of a GRPO group share their prompt (Claude Code's is ~19k tokens), and the
segments of an episode whose template seals every turn (gpt-oss) each begin with the whole
previous segment. A padded [B,T] forward computes those tokens once per row. Here the rows are
laid out as a prefix tree instead: each distinct (prefix, token) is one node, packed into a
row in an order where a parent precedes its children, at its position in the original rows
(position ids restart at the branch point for each continuation), and a 4D attention mask lets
a node see exactly its ancestors and itself: the keys its row would have seen, within the
sliding window where a layer has one. Each row's logits are then gathered back from the nodes
of its tokens, so everything downstream (log_softmax, sampling, loss) is today's [B,T]
computation, and the gradient of a shared node is the sum over the rows that read it: the
naive gradient, to float rounding (tests/trainer/test_prefix.py).

When it pays: rows are sorted (a row's longest shared prefix is then with its predecessor) and
a row joins its predecessor's tree when the attention it adds there (2 n s + s^2 for s new
tokens in a tree of n) is at most what the row costs alone (T^2); its linear cost always
shrinks. The packed batch is used only if it is no larger than the padded one in both tokens
and attention pairs; otherwise (an ordinary batch, whose rows share a system prompt at most)
the model runs on the padded batch exactly as before. The mask is dense, so only attention
implementations that take one are packed (sdpa, eager); others (flash attention) run padded.

Cost: the mask, [trees, n, n] bools; the gathered [B,T,V] logits, as large as the padded
forward's own, or only the positions asked for (`logits(at=...)`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

PACKABLE = frozenset({"sdpa", "eager"})
"""Attention implementations that take an arbitrary 4D mask."""


@dataclass(slots=True)
class Packing:
    """A micro-batch's rows as G packed trees of at most N nodes."""

    input_ids: Tensor
    """[G,N] long: each node's token; 0 on padding."""
    position_ids: Tensor
    """[G,N] long: each node's position in the rows that contain it; 0 on padding."""
    visible: Tensor
    """[G,N,N] bool: query node q may attend key node k (k is q or an ancestor of it); padding
    sees itself only, so no softmax row is empty."""
    tree: Tensor
    """[B] long: the packed row holding each original row."""
    node: Tensor
    """[B,T] long: the node of each original token; 0 on padding."""


def pack(input_ids: Tensor, attention_mask: Tensor) -> Packing | None:
    """The prefix-tree layout of right-padded rows ([B,T], on the CPU), or None when it would
    not be smaller than the padded batch."""
    lengths = attention_mask.sum(dim=1).tolist()
    rows = [input_ids[b, :n].tolist() for b, n in enumerate(lengths)]
    order = sorted(range(len(rows)), key=rows.__getitem__)
    node = torch.zeros_like(input_ids)
    tree = torch.zeros(len(rows), dtype=torch.long)
    starts = [0] * len(rows)
    sizes = [lengths[order[0]]]
    node[order[0], : sizes[0]] = torch.arange(sizes[0])
    for previous, row in zip(order, order[1:], strict=False):
        shared = _common_prefix(rows[previous], rows[row])
        new = lengths[row] - shared
        if shared and 2 * sizes[-1] * new + new * new <= lengths[row] ** 2:
            node[row, :shared] = node[previous, :shared]
            node[row, shared : lengths[row]] = torch.arange(sizes[-1], sizes[-1] + new)
            tree[row], starts[row] = len(sizes) - 1, shared
            sizes[-1] += new
        else:
            node[row, : lengths[row]] = torch.arange(lengths[row])
            tree[row] = len(sizes)
            sizes.append(lengths[row])
    count, longest = len(sizes), max(sizes)
    padded, width = len(rows), input_ids.shape[1]
    if count == padded or count * longest > padded * width or count * longest**2 > padded * width**2:
        return None
    return _layout(input_ids, lengths, order, tree, node, starts, longest)


def _common_prefix(a: list[int], b: list[int]) -> int:
    shortest = min(len(a), len(b))
    if a[:shortest] == b[:shortest]:
        return shortest
    differs = torch.tensor(a[:shortest]) != torch.tensor(b[:shortest])
    return int(differs.nonzero()[0, 0])


def _layout(
    input_ids: Tensor,
    lengths: list[int],
    order: list[int],
    tree: Tensor,
    node: Tensor,
    starts: list[int],
    longest: int,
) -> Packing:
    """The packed tensors. Rows in `order` (sorted) write the nodes they added, contiguous from
    `starts[row]` on: their token, position and ancestry, which is their parent's ancestry (the
    shared prefix, written by an earlier row) and the causal pattern over the new nodes."""
    count = int(tree.max()) + 1
    ids = torch.zeros(count, longest, dtype=torch.long)
    positions = torch.zeros(count, longest, dtype=torch.long)
    visible = torch.zeros(count, longest, longest, dtype=torch.bool)
    visible.diagonal(dim1=1, dim2=2).fill_(True)
    for row in order:
        start, length, g = starts[row], lengths[row], int(tree[row])
        if start == length:
            continue  # the same tokens as the row before: no new node
        first = int(node[row, start])
        last = first + length - start
        ids[g, first:last] = input_ids[row, start:length]
        positions[g, first:last] = torch.arange(start, length)
        new = visible[g, first:last]
        if start:
            new |= visible[g, int(node[row, start - 1])]
        steps = torch.arange(last - first)
        new[:, first:last] = steps[:, None] >= steps[None, :]
    return Packing(ids, positions, visible, tree, node)


def _masks(model: nn.Module, packing: Packing, device: torch.device) -> Tensor | dict[str, Tensor]:
    """The 4D mask in the form the model's attention takes (bool for sdpa, additive for eager),
    per layer type when its layers differ (full and sliding-window attention)."""
    config, positions, ancestry = model.config, packing.position_ids.to(device), packing.visible.to(device)
    window = getattr(config, "sliding_window", None)
    layer_types = set(
        getattr(config, "layer_types", None) or ["sliding_attention" if window else "full_attention"]
    )
    masks = {}
    for kind in layer_types:
        visible = ancestry
        if kind == "sliding_attention":
            # transformers' sliding_window_overlay: kv > q - window, in positions
            visible = visible & (positions[:, None, :] > positions[:, :, None] - window)
        visible = visible[:, None]
        if config._attn_implementation == "eager":
            zeros = torch.zeros(visible.shape, dtype=model.dtype, device=device)
            masks[kind] = zeros.masked_fill(~visible, torch.finfo(model.dtype).min)
        else:
            masks[kind] = visible
    return next(iter(masks.values())) if len(masks) == 1 else masks


def logits(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    share: bool = True,
    at: Tensor | None = None,
) -> Tensor:
    """[B,T,V] the model's logits of right-padded rows ([B,T]), their shared prefixes computed
    once when that is smaller (`share`, and an attention implementation in `PACKABLE`).

    at: [B,T] bool, the positions whose logits are needed: then [M,V], those positions' logits
    in row-major order (`at.nonzero()`), and the LM head runs on them alone (transformers'
    `logits_to_keep`). An agent's sampled tokens are a few hundred of a prompt's thousands, and
    the head is the forward's largest tensor at a real vocabulary: [T,V] float32 per row."""
    config = model.config
    packing = None
    if share and config._attn_implementation in PACKABLE and input_ids.shape[0] > 1:
        packing = pack(input_ids.cpu(), attention_mask.cpu())
    if packing is None:
        if at is None:
            return model(input_ids=input_ids, attention_mask=attention_mask).logits
        rows, cols = at.nonzero(as_tuple=True)
        keep = cols.unique()
        out = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=keep).logits
        return out[rows, torch.searchsorted(keep, cols)]
    device = input_ids.device
    tree, node = packing.tree.to(device), packing.node.to(device)
    packed = {
        "input_ids": packing.input_ids.to(device),
        "position_ids": packing.position_ids.to(device),
        "attention_mask": _masks(model, packing, device),
    }
    if at is None:
        return model(**packed).logits[tree[:, None], node]
    rows, cols = at.nonzero(as_tuple=True)
    nodes = node[rows, cols]
    keep = nodes.unique()
    out = model(**packed, logits_to_keep=keep).logits
    return out[tree[rows], torch.searchsorted(keep, nodes)]
