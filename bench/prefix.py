"""Benchmark 11: shared-prefix training against today's padded rows.

The same trainer step (`Policy.ppo_step`, default loss) on the same batch and weights, with
the rows' shared prefixes computed once (`trainer/prefix.py`, the default) and without
(`Policy(shared_prefix=False)`: every row padded and run whole, as before), interleaved step
by step. Batches: (a) a GRPO group, 8 attempts at one 4k-token prompt; (b) an episode whose
template seals every turn (gpt-oss): each segment's prompt is the whole previous segment and a
new user message, 8 segments; (c) an ordinary batch, 8 unrelated rows that share only a short
system prompt, where packing must not pay and the padded forward runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from bench.common import Section, median, ratio, table, tiny_model
from molt_proxy.types import NOT_SAMPLED, Sampling, SessionStatus, Trajectory, Turn
from trainer.batch import collate
from trainer.config import LossConfig
from trainer.policy import Policy
from trainer.prefix import pack


def record(row: int, ids: list[int], prompt: int, session: str, segment: int = 0) -> Trajectory:
    """A trajectory of `prompt` prompt tokens, then one sampled turn (T = 1)."""
    sampled = len(ids) - prompt
    return Trajectory(
        seq=row + 1,
        trajectory_id=f"{session}:{segment}",
        session_id=session,
        segment=segment,
        num_segments=1,
        group_id="g",
        token_ids=ids,
        loss_mask=[0] * prompt + [1] * sampled,
        logprobs=[0.0] * prompt + [-2.0] * sampled,
        weight_versions=[NOT_SAMPLED] * prompt + [0] * sampled,
        turns=[Turn(f"c{row}", 0, prompt, len(ids), "stop", sampling=Sampling())],
        reward=1.0,
        info={},
        status=SessionStatus.REWARDED,
        model="tiny",
        created=0.0,
    )


def grpo_group(tokens: Callable[[int], list[int]], prompt: int) -> list[Trajectory]:
    """8 attempts at one prompt, completions of 256 to 768 tokens."""
    shared = tokens(prompt)
    replies = (384, 512, 640, 256, 768, 512, 448, 576)
    return [record(i, shared + tokens(n), prompt, f"a{i}") for i, n in enumerate(replies)]


def sealed_episode(tokens: Callable[[int], list[int]], first: int) -> list[Trajectory]:
    """8 segments: a first prompt, then each turn a 256-token reply and a 128-token user message."""
    segments, text = [], tokens(first)
    for k in range(8):
        text = text + (tokens(128) if k else [])
        prompt = len(text)
        text = text + tokens(256)
        segments.append(record(k, list(text), prompt, "episode", k))
    return segments


def ordinary(tokens: Callable[[int], list[int]], length: int) -> list[Trajectory]:
    """8 unrelated rows of `length` tokens that share a 32-token system prompt."""
    system = tokens(32)
    return [record(i, system + tokens(length - 32), length // 2, f"o{i}") for i in range(8)]


def measure(rows: list[Trajectory], steps: int) -> dict[str, Any]:
    model_dir = tiny_model("digits")
    shared, padded = Policy(model_dir, lr=1e-5), Policy(model_dir, lr=1e-5, shared_prefix=False)
    batch = collate(rows, [1.0 if i % 2 else -1.0 for i in range(len(rows))])
    planning = []
    for _ in range(5):
        started = time.perf_counter()
        packing = pack(batch.input_ids, batch.attention_mask)
        planning.append(time.perf_counter() - started)
    loss = LossConfig()
    first = {name: p.ppo_step([[batch]], 0, loss) for name, p in (("shared", shared), ("padded", padded))}
    times: dict[str, list[float]] = {"shared": [], "padded": []}
    for _ in range(steps):
        for name, policy in (("shared", shared), ("padded", padded)):
            started = time.perf_counter()
            policy.ppo_step([[batch]], 0, loss)
            times[name].append(time.perf_counter() - started)
    return {
        "real": int(batch.attention_mask.sum()),
        "padded_tokens": batch.input_ids.numel(),
        "packed_tokens": packing.input_ids.numel() if packing is not None else batch.input_ids.numel(),
        "planning": median(planning),
        "padded_pairs": batch.input_ids.shape[0] * batch.input_ids.shape[1] ** 2,
        "packed_pairs": packing.input_ids.shape[0] * packing.input_ids.shape[1] ** 2
        if packing is not None
        else batch.input_ids.shape[0] * batch.input_ids.shape[1] ** 2,
        "trees": packing.input_ids.shape[0] if packing is not None else len(rows),
        "loss_error": abs(first["shared"]["loss"] - first["padded"]["loss"]) / abs(first["padded"]["loss"]),
        "norm_error": abs(first["shared"]["grad_norm"] - first["padded"]["grad_norm"])
        / first["padded"]["grad_norm"],
        **{name: median(values) for name, values in times.items()},
    }


def run(quick: bool = False) -> Section:
    steps = 1 if quick else 3
    section = Section(
        "prefix",
        "11. Shared-prefix training vs padded rows",
        "python -m bench prefix",
        "today's trainer step on the same batch and weights, every row padded and run whole "
        "(`Policy(shared_prefix=False)`), alternating step by step with the step that computes "
        "shared prefixes once (`trainer/prefix.py`, the default).",
    )
    generator = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, 390, (n,), generator=generator).tolist()

    prompt = 1024 if quick else 4096
    cases = [
        (f"(a) GRPO group: 8 attempts at one {prompt:,}-token prompt", grpo_group(tokens, prompt)),
        (
            "(b) sealed episode (gpt-oss): 8 segments, each the previous + user + reply",
            sealed_episode(tokens, 1024),
        ),
        (
            "(c) ordinary: 8 unrelated rows of 2,048 tokens, a 32-token system prompt shared",
            ordinary(tokens, 2048),
        ),
    ]
    rows = []
    for name, records in cases:
        m = measure(records, steps)
        rows.append(
            [
                name,
                f"{m['real']:,}",
                f"{m['padded_tokens']:,}",
                f"{m['packed_tokens']:,} ({m['trees']} rows)",
                f"{m['padded_pairs'] / m['packed_pairs']:.1f}×",
                f"{m['padded']:.2f}",
                f"{m['shared']:.2f}",
                ratio(m["padded"], m["shared"]),
                f"{m['planning'] * 1000:.1f}",
                f"{m['loss_error']:.1e} / {m['norm_error']:.1e}",
            ]
        )
    section.body.append(
        f"Median of {steps} steps each after one warm-up step, on CPU (float32, torch's default threads; "
        "the machine is shared with other people's work, so read the ratio, not the seconds). Model: the "
        "tiny Qwen3 architecture (hidden 64, 2 layers, sdpa attention, a 1,024-token sliding window in "
        "every layer) with the byte-level BPE of examples/learn_digits.py (vocabulary 395): at a 150k "
        "vocabulary the [B,T,V] logits of a 4k-token group do not fit this machine either way. Tokens "
        "computed: positions the model runs, padding included (B×T padded; trees × longest tree "
        "packed), and the "
        "query-key pairs attention computes (B×T² padded, trees × longest² packed: the mask is dense). "
        "This model is so narrow that attention dominates its step, so the speed-up follows the pairs more "
        "than the tokens; a real model's linear layers and vocabulary make the tokens count for more. "
        "The packing plan (sorting the rows, their common prefixes, the layout and mask: "
        "`trainer/prefix.py`'s `pack`) is timed alone: on an ordinary batch it finds nothing worth "
        "packing and the padded forward runs, so the plan is all the default adds there (the two step "
        "times of (c) run the same code and differ by noise only). The last column is the relative "
        "difference of the first step's loss and gradient norm between "
        "the two, at the same weights."
    )
    section.body.append(
        table(
            [
                "batch",
                "real tokens",
                "tokens computed, padded",
                "tokens computed, shared",
                "attention pairs, padded / shared",
                "padded step s",
                "shared step s",
                "speed-up",
                "packing plan ms",
                "loss / grad-norm rel. diff",
            ],
            rows,
        )
    )
    return section
