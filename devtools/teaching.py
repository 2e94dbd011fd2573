"""Teach a tiny model its script: fine-tune until temperature-1 sampling writes every reply.

The model then *generates* those replies through vLLM like any other, token by token, with
real logprobs; the taught weights are byte-identical from build to build (one CPU thread,
fixed seed, fixed dates). Well under a minute on one CPU core.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import date, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from devtools.scripts import Conversation, render_reply

if TYPE_CHECKING:
    import torch

# Llama-3's template writes today's date into the system header (`strftime_now`). Taught on
# one date, the tiny model loses its script on some others; so each step shows it the script
# on another of these dates, and it learns to look past the date. Fixed dates keep the
# weights independent of the day they are built on.
_TEACH_DATES = [(date(2024, 7, 26) + timedelta(days=97 * k)).strftime("%d %b %Y") for k in range(12)]


def _for_template(message: dict[str, Any]) -> dict[str, Any]:
    """`message` with tool-call arguments as dicts, as vLLM passes them to a template."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        arguments = call["function"]["arguments"]
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        calls.append({**call, "function": {**call["function"], "arguments": arguments}})
    return {**message, "tool_calls": calls}


@dataclass(frozen=True, slots=True)
class _Batch:
    """Part of the script rendered on one date: a row per assistant message, N reply tokens
    in all."""

    ids: torch.Tensor
    """[R, T] the prompt, then the reply and EOS; right-padded."""
    mask: torch.Tensor
    """[R, T] 1 on real tokens."""
    rows: torch.Tensor
    """[N] the row of each reply token."""
    cols: torch.Tensor
    """[N] the position that predicts it (one before the token)."""
    wanted: torch.Tensor
    """[N] the reply token ids."""


def _script_batches(tokenizer: Any, conversations: list[Conversation], date_string: str) -> list[_Batch]:
    """Tokenize prompt and reply apart, exactly as the proxy sends a rendered prompt and vLLM
    samples after it (one BPE of the joined text could differ at the seam). Rows of about the
    same length (within a power of two) share a batch: padded to one agent's 1,000-token system
    prompt, every short row would cost as much as the long one (attention is quadratic)."""

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    pairs = []
    for conv in conversations:
        history = [_for_template(m) for m in conv["messages"]]
        for i, message in enumerate(conv["messages"]):
            if message["role"] == "assistant":
                prompt = tokenizer.apply_chat_template(
                    history[:i],
                    tools=conv["tools"],
                    add_generation_prompt=True,
                    tokenize=False,
                    date_string=date_string,
                )
                reply = render_reply(message, conv["family"]) + tokenizer.eos_token
                pairs.append((encode(prompt), encode(reply)))
    by_length: dict[int, list[tuple[list[int], list[int]]]] = {}
    for prompt, reply in pairs:
        by_length.setdefault((len(prompt) + len(reply)).bit_length(), []).append((prompt, reply))
    return [_batch(rows, tokenizer.eos_token_id) for _, rows in sorted(by_length.items())]


def _batch(pairs: list[tuple[list[int], list[int]]], pad_id: int) -> _Batch:
    """(prompt, reply) pairs as one right-padded batch."""
    import torch

    ids = torch.full((len(pairs), max(len(p) + len(r) for p, r in pairs)), pad_id)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for row, (prompt, reply) in enumerate(pairs):
        ids[row, : len(prompt) + len(reply)] = torch.tensor(prompt + reply)
        mask[row, : len(prompt) + len(reply)] = 1
        labels[row, len(prompt) : len(prompt) + len(reply)] = torch.tensor(reply)
    # Position j predicts token j + 1.
    rows, cols = (labels[:, 1:] != -100).nonzero(as_tuple=True)
    return _Batch(ids, mask, rows, cols, labels[rows, cols + 1])


_HEAD_ROWS = 32
"""Reply tokens per LM-head call while teaching. The logits of all reply tokens at once are
hundreds of megabytes (a 151k vocabulary), allocated anew at every step: measured on the Qwen3
script (408 reply tokens), 32-token chunks took a step from 1.45 to 1.18 s, system time (page
faults) from 0.54 to 0.19 s."""


def _token_logprobs(model: Any, batch: _Batch) -> torch.Tensor:
    """[N] log-probabilities of the reply tokens, full-vocabulary softmax at temperature 1."""
    import torch

    hidden = model.model(input_ids=batch.ids, attention_mask=batch.mask).last_hidden_state
    # The LM head only where it is trained: vocab-wide logits at every prompt position
    # would cost more than the whole rest of the model. In chunks of `_HEAD_ROWS` tokens.
    chunks = zip(
        hidden[batch.rows, batch.cols].split(_HEAD_ROWS), batch.wanted.split(_HEAD_ROWS), strict=True
    )
    return torch.cat(
        [-torch.nn.functional.cross_entropy(model.lm_head(h), w, reduction="none") for h, w in chunks]
    )


def _reply_probs(token_logp: torch.Tensor, batch: _Batch) -> torch.Tensor:
    """[R] probability that temperature-1 sampling writes each whole reply, EOS included."""
    import torch

    return torch.zeros(len(batch.ids)).index_add(0, batch.rows, token_logp.detach()).exp()


def _score(model: Any, batches: list[_Batch]) -> tuple[torch.Tensor, torch.Tensor]:
    """The script on one date: [N] its reply tokens' log-probabilities, [R] its replies'
    probabilities."""
    import torch

    token_logps = [_token_logprobs(model, batch) for batch in batches]
    probs = [_reply_probs(logp, batch) for logp, batch in zip(token_logps, batches, strict=True)]
    return torch.cat(token_logps), torch.cat(probs)


def _same(a: list[_Batch], b: list[_Batch]) -> bool:
    import torch

    return len(a) == len(b) and all(torch.equal(x.ids, y.ids) for x, y in zip(a, b, strict=True))


def teach_tiny_model(
    model_dir: str | Path,
    conversations: list[Conversation],
    *,
    steps: int = 300,
    lr: float = 2e-2,
    seed: int = 0,
    stop_prob: float = 0.99,
) -> None:
    """Fine-tune the model in `model_dir` until it samples every scripted reply, and save it.

    Full-batch AdamW in float32 on the reply tokens only (prompt masked out), one teaching
    date per step. Stops once every reply has had probability >= `stop_prob` on each date in
    a row, or after `steps`; then measures the saved weights on every date, prints the worst
    probability per reply, and raises below 0.95. Training is full-batch without dropout, so
    `seed` only pins torch's generator for anything random a model might add.

    Runs on one CPU thread: float sums then do not depend on the machine's core count (same
    seed, same bytes), and a shared, busy machine does not stall it (two threads spinning
    against another process ran 10x slower here than one).
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _teach(Path(model_dir), conversations, steps=steps, lr=lr, seed=seed, stop_prob=stop_prob)
    finally:
        torch.set_num_threads(threads)


def _teach(
    model_dir: Path, conversations: list[Conversation], *, steps: int, lr: float, seed: int, stop_prob: float
) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    scripts: list[list[_Batch]] = []
    for day in _TEACH_DATES:  # one rendering for templates that print no date
        batches = _script_batches(tokenizer, conversations, day)
        if not any(_same(batches, s) for s in scripts):
            scripts.append(batches)

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    # Random input embeddings already tell tokens apart; freezing them spares a dense
    # vocab-sized gradient and optimizer state per step. A short beta2 lets Adam keep its
    # step size once gradients shrink near zero loss, where the last margins are won.
    model.get_input_embeddings().weight.requires_grad_(False)
    trained = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(trained, lr=lr, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    # A linear warm-up over 40 steps: at full `lr` from the start the random model overshoots
    # and oscillates (Llama did); warmed up, it takes the high rate that keeps the run short.
    warmup = torch.optim.lr_scheduler.LambdaLR(optim, lambda k: min(1.0, (k + 1) / 40))
    streak = 0
    for step in range(steps):
        token_logp, reply_probs = _score(model, scripts[step % len(scripts)])
        streak = streak + 1 if reply_probs.min() >= stop_prob else 0
        if streak == len(scripts):
            break
        optim.zero_grad()
        (-token_logp.mean()).backward()
        optim.step()
        warmup.step()
    with torch.no_grad():
        probs = torch.stack([_score(model, batches)[1] for batches in scripts]).amin(0).tolist()
    shown = [round(p, 4) for p in probs]
    elapsed = time.monotonic() - start
    print(f"taught {len(probs)} replies in {step} steps, {elapsed:.1f}s; p(reply) >= {shown}")
    if min(probs) < 0.95:
        raise RuntimeError(f"the tiny model did not learn its script: p(reply) = {shown}")
    model.save_pretrained(model_dir, safe_serialization=True)
