"""Benchmark 4: the trainer's step throughput against a plain PyTorch loop, and where a
step's time goes.

Same model, same batch, same optimizer (AdamW), interleaved step by step: the trainer's step
`Policy.ppo_step` (forward, float32 log-softmax and gather, the policy loss with importance
weights and clipping, backward, grad clipping, step) with the default one epoch and with
`--ppo-epochs 2` (pi_old by a no-grad forward, then two updates) and with the reference model
on (`--kl-coef 0.1`: a frozen copy of the weights, one more no-grad forward per micro-batch),
against the floor, a plain
`model(ids).logits` → masked cross-entropy → backward → clip → AdamW loop. Then the rest of
the trainer's step, timed with the trainer's own functions: collating trajectories,
checkpointing (model + optimizer + cursor) and writing the weights vLLM reloads.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from bench.common import OUT, Section, median, ratio, table, tiny_model
from molt_proxy.types import NOT_SAMPLED, Sampling, SessionStatus, Trajectory, Turn
from trainer import checkpoint
from trainer.batch import Batch, collate
from trainer.config import LossConfig
from trainer.policy import Policy


def trajectories(rows: int, length: int, vocab: int, sampled: int) -> list[Trajectory]:
    """Synthetic trajectories: a prompt, then `sampled` tokens (one turn at T = 1)."""
    generator = torch.Generator().manual_seed(0)
    out = []
    for row in range(rows):
        ids = torch.randint(0, vocab, (length,), generator=generator).tolist()
        prompt = length - sampled
        mask = [0] * prompt + [1] * (length - prompt)
        out.append(
            Trajectory(
                seq=row + 1,
                trajectory_id=f"t{row}:0",
                session_id=f"t{row}",
                segment=0,
                num_segments=1,
                group_id="g",
                token_ids=ids,
                loss_mask=mask,
                logprobs=[-2.0 * m for m in mask],
                weight_versions=[0 if m else NOT_SAMPLED for m in mask],
                turns=[Turn(f"c{row}", 0, prompt, length, "length", sampling=Sampling())],
                reward=1.0,
                info={},
                status=SessionStatus.REWARDED,
                model="tiny",
                created=0.0,
            )
        )
    return out


class PlainLoop:
    """The floor: what any PyTorch fine-tuning loop does with the same model and batch."""

    def __init__(self, model_dir: Path, lr: float):
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)

    def step(self, batch: Batch) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        logits = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
        targets = batch.input_ids[:, 1:].masked_fill(batch.loss_mask[:, 1:] == 0, -100)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()


def measure(kind: str, rows: int, length: int, sampled: int, steps: int) -> dict[str, Any]:
    model_dir = tiny_model(kind)
    policy = Policy(model_dir, lr=1e-5)
    policy_ppo2 = Policy(model_dir, lr=1e-5)
    policy_kl = Policy(model_dir, lr=1e-5, reference=True)
    plain = PlainLoop(model_dir, lr=1e-5)
    vocab = policy.model.config.vocab_size
    records = trajectories(rows, length, vocab, sampled)
    advantages = [1.0 if i % 2 else -1.0 for i in range(rows)]
    batch = collate(records, advantages)
    tokens = int(batch.attention_mask.sum())
    loss, loss_kl = LossConfig(), LossConfig(kl_coef=0.1)
    times: dict[str, list[float]] = {
        "policy": [],
        "policy_ppo2": [],
        "policy_kl": [],
        "plain": [],
        "collate": [],
        "checkpoint": [],
        "weights": [],
    }
    folder = OUT / "trainer-bench"
    shutil.rmtree(folder, ignore_errors=True)
    steps_of = {
        "policy": lambda: policy.ppo_step([[batch]], 0, loss),
        "policy_ppo2": lambda: policy_ppo2.ppo_step([[batch]], 0, loss, epochs=2),
        "policy_kl": lambda: policy_kl.ppo_step([[batch]], 0, loss_kl),
        "plain": lambda: plain.step(batch),
    }
    for fn in steps_of.values():  # warm-up: allocator, Adam state
        fn()
    for step in range(steps):
        for name, fn in steps_of.items():
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
        started = time.perf_counter()
        collate(records, advantages)
        times["collate"].append(time.perf_counter() - started)
        started = time.perf_counter()
        checkpoint.save(folder / "checkpoint", checkpoint.TrainerState(step=step), policy.state_dict())
        times["checkpoint"].append(time.perf_counter() - started)
        started = time.perf_counter()
        policy.save_weights(folder / "weights")
        times["weights"].append(time.perf_counter() - started)
    shutil.rmtree(folder, ignore_errors=True)
    params = sum(p.numel() for p in policy.model.parameters())
    return {"tokens": tokens, "vocab": vocab, "params": params, **{k: median(v) for k, v in times.items()}}


def run(quick: bool = False) -> Section:
    steps = 3 if quick else 7
    section = Section(
        "trainer",
        "4. Trainer step throughput vs a plain PyTorch loop",
        "python -m bench trainer",
        "a plain PyTorch loop (forward → masked cross-entropy → backward → clip → AdamW) on the "
        "same model, batch and optimizer, alternating step by step with the trainer's step "
        "(`Policy.ppo_step`: default, `--ppo-epochs 2`, and the reference model on, `--kl-coef 0.1`).",
    )
    # (model, rows, tokens per row, sampled tokens per row): half sampled, and an agent's turn,
    # a long prompt and a short reply, where the LM head runs on the sampled tokens alone
    configs = (
        [("digits", 16, 256, 128), ("qwen3", 4, 128, 64), ("qwen3", 4, 1024, 32)]
        if not quick
        else [("digits", 8, 128, 64), ("qwen3", 2, 128, 64), ("qwen3", 2, 512, 16)]
    )
    rows, breakdown = [], []
    for kind, batch_rows, length, sampled in configs:
        m = measure(kind, batch_rows, length, sampled, steps)
        name = (
            f"{kind} ({m['params'] / 1e6:.1f}M params, vocab {m['vocab']:,}), "
            f"{batch_rows}×{length}, {sampled} sampled per row"
        )
        rows.append(
            [
                name,
                f"{m['tokens'] / m['policy']:,.0f}",
                f"{m['tokens'] / m['policy_ppo2']:,.0f}",
                f"{m['tokens'] / m['plain']:,.0f}",
                ratio(m["plain"], m["policy"]),
                ratio(m["policy_ppo2"], m["policy"]),
                ratio(m["policy_kl"], m["policy"]),
            ]
        )
        step = m["collate"] + m["policy"] + m["checkpoint"] + m["weights"]
        breakdown.append(
            [
                name,
                f"{m['policy'] * 1000:,.0f}",
                f"{m['collate'] * 1000:,.1f}",
                f"{m['checkpoint'] * 1000:,.0f}",
                f"{m['weights'] * 1000:,.0f}",
                f"{(step - m['policy']) / step:.0%}",
            ]
        )
    section.body.append(
        f"Median of {steps} steps each after one warm-up step, on CPU (float32, torch's default "
        "threads). Models: the tiny Qwen3 architecture (hidden 64, 2 layers) with the byte-level BPE "
        "of examples/learn_digits.py (`digits`) and with the real Qwen3 vocabulary (`qwen3`), where "
        "the logits dominate. Batches: synthetic trajectories, a prompt and then sampled tokens; the "
        "trainer's LM head runs on the sampled tokens alone, the plain loop's on every token (its "
        "logits are [B,T,V]), which is most of the difference at an agent's shape. "
        "The trainer's step with `--ppo-epochs 2` runs a no-grad forward for pi_old and two updates "
        "(forward, backward, AdamW each) where the default runs one update. With the reference model on, "
        "each micro-batch adds a no-grad forward of the frozen initial weights and the KL term; the "
        "default (`--kl-coef 0`) loads no reference at all."
    )
    section.body.append(
        table(
            [
                "model, batch",
                "trainer tokens/s",
                "trainer `--ppo-epochs 2` tokens/s",
                "plain loop tokens/s",
                "trainer / plain speed",
                "`--ppo-epochs 2` / default step time",
                "reference on (`--kl-coef 0.1`) / off step time",
            ],
            rows,
        )
    )
    section.body.append(
        "Where the rest of a trainer step goes, with the trainer's own functions (the vLLM reload "
        "itself is benchmark 5; the end-to-end run, benchmark 6, reports the loop's own timings):"
    )
    section.body.append(
        table(
            [
                "model, batch",
                "train_step ms",
                "collate ms",
                "checkpoint ms",
                "save weights ms",
                "share outside compute",
            ],
            breakdown,
        )
    )
    return section
