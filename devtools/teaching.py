"""Teach a tiny model its script: fine-tune until temperature-1 sampling writes every reply.

The model then *generates* those replies through vLLM like any other, token by token, with
real logprobs; the taught weights are byte-identical from build to build on one machine (one
CPU thread, fixed seed, fixed dates; Claude Code's prompt names the machine's OS).

What keeps it to seconds of one CPU core:
- One forward per chain of turns: a conversation's next prompt starts with the last prompt and
  reply, token for token, so the forward over its last turn computes every earlier reply at the
  positions it has alone (`_chains`). A long prompt is seen through what its replies can depend
  on (`reach`): Claude Code's 19k-token prompt costs what 2k do, and its teaching days that
  differ only beyond that (its folder) are one.
- An LM head over the script's own tokens (`_Head`): the rows of all other tokens stay as built,
  and a bound on their logits stands in for them in the softmax, so a reply's probability is
  never overstated and the vocabulary-wide head (151k rows) is never computed while teaching.
- Every teaching day (a date, each conversation's `vary` text) in every step, each distinct
  reply once; the reply tokens' rows aimed before the first step (`_Head.aim`); and no steps
  spent on the last margins: once every reply token is the first choice (`_SETTLED`), scaling
  the script's rows (`_Head.sharpen`) gives every reply the probability asked for.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass
from datetime import date, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from devtools.scripts import as_echoed, render_reply
from devtools.types import Conversation

if TYPE_CHECKING:
    import torch

# Llama-3's template writes today's date into the system header (`strftime_now`). Taught on
# one date, the tiny model loses its script on some others; so it is shown the script on each
# of these dates (a teaching day), and it learns to look past the date. Fixed dates keep the
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


def _varied(conv: Conversation, day: int) -> Conversation:
    """`conv` with each of its `vary` texts replaced by the value for teaching day `day`."""
    text = json.dumps({k: v for k, v in conv.items() if k != "vary"})
    for seen, shown in conv.get("vary", {}).items():
        text = text.replace(json.dumps(seen)[1:-1], json.dumps(shown[day % len(shown)])[1:-1])
    return json.loads(text)


def shown(conversations: list[Conversation]) -> list[tuple[str, list[Conversation]]]:
    """Each teaching day's date and conversations (each `vary` text replaced by the day's)."""
    return [
        (date_string, [_varied(conv, k) for conv in conversations])
        for k, date_string in enumerate(_TEACH_DATES)
    ]


@dataclass(frozen=True, slots=True)
class _Row:
    """One assistant message: the prompt before it and the reply, EOS included."""

    prompt: tuple[int, ...]
    reply: tuple[int, ...]


def _script_rows(tokenizer: Any, conversations: list[Conversation], date_string: str) -> list[_Row]:
    """Tokenize prompt and reply apart, exactly as the proxy sends a rendered prompt and vLLM
    samples after it (one BPE of the joined text could differ at the seam)."""

    def encode(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False))

    rows = []
    for conv in conversations:
        history = [_for_template(as_echoed(m, conv["family"])) for m in conv["messages"]]
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
                rows.append(_Row(encode(prompt), encode(reply)))
    return rows


def _days(tokenizer: Any, conversations: list[Conversation]) -> list[list[_Row]]:
    """Each teaching day's rows (`shown`), but for days that repeat an earlier one (a script
    without dates or `vary` texts has one day)."""
    days: list[list[_Row]] = []
    for date_string, convs in shown(conversations):
        day = _script_rows(tokenizer, convs, date_string)
        if day not in days:
            days.append(day)
    return days


def lesson_digest(model_dir: str | Path, conversations: list[Conversation]) -> str:
    """A digest of what teaching shows the model in `model_dir` of `conversations`: every
    day's prompts and replies, token for token, as its tokenizer writes them. With the weights'
    initialisation and this module's code, all that the taught weights depend on: the `vary`
    texts of a capture (its temporary folder, its date) are never shown."""
    from transformers import AutoTokenizer

    digest = hashlib.sha256()
    for day in _days(AutoTokenizer.from_pretrained(str(model_dir)), conversations):
        digest.update(json.dumps([[row.prompt, row.reply] for row in day]).encode())
    return digest.hexdigest()


def reach(model: Any) -> int | None:
    """How many prompt tokens a reply can depend on: the sliding window times the layers (the
    tiny Qwen3 model's, `devtools.tinymodel`); None: all of them."""
    window = getattr(model.config, "sliding_window", None)
    return window * model.config.num_hidden_layers if window else None


def _chains(rows: list[_Row]) -> list[list[int]]:
    """`rows` (their indices) in chains: each row's prompt starts with the previous row's prompt
    and reply, token for token, so one forward over a chain's last row gives every reply in it
    at the very positions, after the very tokens, it has alone. A conversation is one chain
    unless its template rewrites the history (Qwen3 drops a `<think>` block once the next user
    message comes) or a seam tokenizes otherwise in the longer text."""
    chains: list[list[int]] = []
    for i, row in enumerate(rows):
        for chain in reversed(chains):
            last = rows[chain[-1]]
            if row.prompt[: len(last.prompt) + len(last.reply)] == last.prompt + last.reply:
                chain.append(i)
                break
        else:
            chains.append([i])
    return chains


_BATCH_TOKENS = 8192
"""Padded tokens per forward while teaching, at most (a longer chain is one forward alone):
attention holds a batch's tokens times its length, per head and layer."""
_PADDING = 1.25
"""A batch's padded size stays within this factor of its real tokens: one batch of the Qwen3
scripts' rows (22 to 674 tokens) was 55% padding, and a step's forward costs by the token."""


@dataclass(frozen=True, slots=True)
class _Batch:
    """Chains of about one length, right-padded into one forward: N reply tokens in all."""

    ids: torch.Tensor
    """[R, T] each chain's tokens from where its replies' reach begins; right-padded."""
    mask: torch.Tensor
    """[R, T] 1 on real tokens."""
    rows: torch.Tensor
    """[N] the chain (row of `ids`) of each reply token."""
    cols: torch.Tensor
    """[N] the position that predicts it (one before the token)."""
    wanted: torch.Tensor
    """[N] the reply token's place in the head's vocabulary (`_Head.ids`)."""
    replies: torch.Tensor
    """[N] the reply it belongs to (its index in `_Lesson.rows`)."""


def _batch(rows: list[_Row], chains: list[tuple[list[int], int]], vocab: torch.Tensor) -> _Batch:
    """`chains` (their rows, and where each is cut) right-padded into one forward."""
    import torch

    sequences = [rows[chain[-1]].prompt[cut:] + rows[chain[-1]].reply for chain, cut in chains]
    ids = torch.zeros((len(chains), max(map(len, sequences))), dtype=torch.long)
    mask = torch.zeros_like(ids)
    where, cols, wanted, replies = [], [], [], []
    for r, ((chain, cut), sequence) in enumerate(zip(chains, sequences, strict=True)):
        ids[r, : len(sequence)] = torch.tensor(sequence)
        mask[r, : len(sequence)] = 1
        for i in chain:
            start = len(rows[i].prompt) - cut  # position j predicts token j + 1
            where += [r] * len(rows[i].reply)
            cols += range(start - 1, start - 1 + len(rows[i].reply))
            wanted += rows[i].reply
            replies += [i] * len(rows[i].reply)
    return _Batch(
        ids,
        mask,
        torch.tensor(where),
        torch.tensor(cols),
        torch.searchsorted(vocab, torch.tensor(wanted)),
        torch.tensor(replies),
    )


@dataclass(frozen=True, slots=True)
class _Lesson:
    """What one teaching step shows: every distinct reply of every day once, in batches."""

    rows: list[_Row]
    days: list[list[int]]
    """Each day's replies, in script order: their indices in `rows`."""
    batches: list[_Batch]
    wanted: torch.Tensor
    """[N] every reply token's place in the head's vocabulary, batch after batch."""
    replies: torch.Tensor
    """[N] the reply (its index in `rows`) each belongs to."""


def _lesson(days: list[list[_Row]], vocab: torch.Tensor, reach: int | None) -> _Lesson:
    """The days' rows in chains (`_chains`), each trimmed to where its replies' `reach` begins,
    each distinct trimmed chain once (Claude Code's date is in the last 2k tokens of its long
    prompt, its folder is not), batched by length: a new batch wherever the next chain would
    pad the current one past `_PADDING` times its tokens or `_BATCH_TOKENS` in all."""
    import torch

    index: dict[_Row, int] = {}
    for day in days:
        for row in day:
            index.setdefault(row, len(index))
    rows = list(index)
    taught: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[list[int], int]] = {}
    stand_in = list(range(len(rows)))
    """Each row's place among the taught ones: its own, or that of the row it forwards as."""
    for chain in _chains(rows):
        last = rows[chain[-1]]
        cut = max(0, len(rows[chain[0]].prompt) - reach) if reach else 0
        shape = (last.prompt[cut:] + last.reply, tuple(len(rows[i].prompt) - cut for i in chain))
        first, _ = taught.setdefault(shape, (chain, cut))
        for i, j in zip(chain, first, strict=True):
            stand_in[i] = j
    order = [i for chain, _ in taught.values() for i in chain]
    place = {row: k for k, row in enumerate(order)}
    chains = [([place[i] for i in chain], cut) for chain, cut in taught.values()]
    rows = [rows[i] for i in order]
    sizes = [len(rows[chain[-1]].prompt) + len(rows[chain[-1]].reply) - cut for chain, cut in chains]
    groups: list[list[int]] = []
    for c in sorted(range(len(chains)), key=sizes.__getitem__):
        group = groups[-1] if groups else []
        padded = sizes[c] * (len(group) + 1)
        if not group or padded > _PADDING * sum(sizes[g] for g in group + [c]) or padded > _BATCH_TOKENS:
            groups.append(group := [])
        group.append(c)
    batches = [_batch(rows, [chains[c] for c in group], vocab) for group in groups]
    return _Lesson(
        rows,
        [[place[stand_in[index[row]]] for row in day] for day in days],
        batches,
        torch.cat([batch.wanted for batch in batches]),
        torch.cat([batch.replies for batch in batches]),
    )


_HEAD_LR = 5.0
"""The script rows' learning rate, as a multiple of the body's: a reply token's logit must
clear the vocabulary (log 151k = 12 nats) by a margin, from rows that start near zero."""
_AIM = 2.0
"""The norm of a reply token's row once aimed (`_Head.aim`)."""
_SETTLED = 0.9
"""Teaching stops once every reply token has at least this probability, the model's first
choice by a margin; `_Head.sharpen` then takes every reply to `stop_prob`."""


class _Head:
    """The LM head while teaching: the rows of the script's tokens (`ids`), trained; every other
    row frozen as built, its logit bounded by its norm times the hidden state's.

    log p(token) >= logit - logsumexp(script logits, log(others) + max other norm * |h|): the
    whole vocabulary's softmax with each other token at its highest possible logit. Reaching
    `stop_prob` under this bound reaches it under vLLM's softmax, which computes them all."""

    def __init__(self, weight: torch.Tensor, ids: torch.Tensor):
        import torch

        others = torch.ones(len(weight), dtype=torch.bool)
        others[ids] = False
        self.ids = ids
        self.rows = weight[ids].clone().requires_grad_(True)
        """[S, H] the trained rows; written back by `save_into`."""
        count = int(others.sum())
        self._log_others = math.log(count) if count else -math.inf
        self._other_norm = float(weight[others].norm(dim=-1).max()) if count else 0.0

    def aim(self, hidden: torch.Tensor, wanted: torch.Tensor) -> None:
        """Point each wanted token's row at the mean direction of the hidden states [N, H] that
        must predict it, with norm `_AIM`. The random model's states already tell most positions
        apart (they mostly reflect the token before), so most tokens start as the first choice,
        and the steps go to the few whose context decides (measured: 65 steps to the Qwen3
        scripts' margin instead of 106)."""
        import torch

        with torch.no_grad():
            sums = torch.zeros_like(self.rows).index_add(
                0, wanted, hidden / hidden.norm(dim=-1, keepdim=True)
            )
            aimed = sums.norm(dim=-1) > 0
            self.rows[aimed] = _AIM * sums[aimed] / sums[aimed].norm(dim=-1, keepdim=True)

    def logprobs(self, hidden: torch.Tensor, wanted: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """[N] lower bounds on log p(wanted) at temperature 1 from the hidden states [N, H],
        the trained rows times `scale`."""
        import torch

        logits = scale * (hidden @ self.rows.T)
        others = self._log_others + self._other_norm * hidden.norm(dim=-1, keepdim=True)
        picked = logits.gather(1, wanted[:, None])[:, 0]
        return picked - torch.logsumexp(torch.cat([logits, others], dim=1), dim=1)

    def sharpen(self, hidden: torch.Tensor, lesson: _Lesson, stop_prob: float) -> float:
        """Scale the trained rows by the least factor >= 1 (to 1%) that gives every reply
        probability >= `stop_prob`, and return it. Once every reply token is the first choice
        (`_SETTLED`), a larger factor only widens each margin: what the last tens of steps did."""
        import torch

        def fits(scale: float) -> bool:
            token_logp = self.logprobs(hidden, lesson.wanted, scale)
            return bool(_reply_logprobs(token_logp, lesson).min() >= math.log(stop_prob))

        low, high = 1.0, 1.0
        while not fits(high) and high < 1024:
            low, high = high, 2 * high
        while high > 1.01 * low:
            low, high = (low, (low + high) / 2) if fits((low + high) / 2) else ((low + high) / 2, high)
        with torch.no_grad():
            self.rows.mul_(high)
        return high

    def save_into(self, weight: torch.Tensor) -> None:
        """Write the trained rows into the model's (untied) LM head."""
        import torch

        with torch.no_grad():
            weight[self.ids] = self.rows


def _hidden(model: Any, lesson: _Lesson) -> torch.Tensor:
    """[N, H] the final hidden states that predict the lesson's reply tokens (`_Lesson.wanted`),
    computed where they are needed only (`_states`). The LM head only where it is trained:
    logits at every prompt position would cost more than the whole rest of the model."""
    import torch

    hidden = []
    for batch in lesson.batches:
        start = int(batch.cols.min())
        hidden.append(_states(model, batch, start)[batch.rows, batch.cols - start])
    return torch.cat(hidden)


def _served(model: Any, lesson: _Lesson) -> torch.Tensor:
    """[N, H] what `_hidden` computes, by the model's own forward over every position: what
    the final measure reads, so that the probabilities it prints are the model's."""
    import torch

    with torch.no_grad():
        return torch.cat(
            [
                model.model(input_ids=b.ids, attention_mask=b.mask).last_hidden_state[b.rows, b.cols]
                for b in lesson.batches
            ]
        )


def _states(model: Any, batch: _Batch, start: int) -> torch.Tensor:
    """[R, T - start, H] the final hidden states of `batch` from position `start` on, as the
    model's forward computes them, with each layer run only where a later one reads it: the
    last from `start` (the first position that predicts a reply), an earlier one from as far
    back as the next one's sliding window reaches. On Claude Code's 2k-token tails the first
    layer runs for about half of the tokens and the second for the replies alone: 2x faster
    steps than the whole forward. (A Qwen3 or Llama decoder: RMSNorm, rotary attention with
    grouped KV heads, a gated MLP; `tests/test_tinymodel.py` checks it against the model's.)"""
    import torch

    inner, config = model.model, model.config
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    windows = [config.sliding_window if kind == "sliding_attention" else None for kind in kinds]
    starts = [start] * len(windows)
    for layer in range(len(windows) - 1, 0, -1):
        window = windows[layer]
        starts[layer - 1] = max(0, starts[layer] - window + 1) if window else 0
    x = inner.embed_tokens(batch.ids)
    positions = torch.arange(batch.ids.shape[1])
    cos, sin = inner.rotary_emb(x, positions[None])
    real = batch.mask.bool()
    offset = 0
    for layer, window, first in zip(inner.layers, windows, starts, strict=True):
        attention = layer.self_attn
        normed = layer.input_layernorm(x)
        keys, queries = positions[offset:], positions[first:]
        q = _rotated(_heads(attention, "q", normed[:, first - offset :]), cos[:, first:], sin[:, first:])
        k = _rotated(_heads(attention, "k", normed), cos[:, offset:], sin[:, offset:])
        v = _heads(attention, "v", normed)
        groups = attention.num_key_value_groups
        seen = keys[None, :] <= queries[:, None]
        if window:
            seen &= keys[None, :] > queries[:, None] - window
        # A padding query sees itself too: a row of no keys would be NaN, and NaN * 0 is NaN.
        allowed = seen[None] & (real[:, None, offset:] | (keys[None, :] == queries[:, None])[None])
        out = torch.nn.functional.scaled_dot_product_attention(
            q,
            k.repeat_interleave(groups, dim=1),
            v.repeat_interleave(groups, dim=1),
            attn_mask=allowed[:, None],
            scale=attention.scaling,
        )
        x = x[:, first - offset :] + attention.o_proj(out.transpose(1, 2).flatten(2))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        offset = first
    return inner.norm(x)


def _heads(attention: Any, name: str, x: torch.Tensor) -> torch.Tensor:
    """[R, heads, T, D] the `name` ("q", "k" or "v") projection of `x` [R, T, H] per head, with
    its per-head norm where the model has one (Qwen3's `q_norm`, `k_norm`)."""
    heads = getattr(attention, f"{name}_proj")(x).unflatten(-1, (-1, attention.head_dim))
    norm = getattr(attention, f"{name}_norm", None)
    return (norm(heads) if norm is not None else heads).transpose(1, 2)


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x` [R, heads, T, D] turned by the rotary embedding's `cos`, `sin` [1, T, D]."""
    import torch

    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin[:, None]


def _reply_logprobs(token_logp: torch.Tensor, lesson: _Lesson) -> torch.Tensor:
    """[R] each reply's log-probability: the sum of its tokens'."""
    import torch

    return torch.zeros(len(lesson.rows)).index_add(0, lesson.replies, token_logp)


_CHUNK = 2048
"""Prompt tokens per forward where a whole long prompt is measured (a prefill in chunks)."""


def _whole_prompt_prob(model: Any, row: _Row) -> float:
    """p(reply) after the whole prompt at its real positions, as vLLM serves it, over the whole
    vocabulary: a prefill in chunks of `_CHUNK` tokens through the KV cache (one forward over
    19k tokens with a sliding-window mask takes 20 s on one thread; this, 2)."""
    import torch

    ids = row.prompt + row.reply
    cache, hidden = None, []
    with torch.no_grad():
        for start in range(0, len(ids), _CHUNK):
            chunk = torch.tensor([ids[start : start + _CHUNK]])
            out = model.model(input_ids=chunk, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            hidden.append(out.last_hidden_state[0])
        states = torch.cat(hidden)[len(row.prompt) - 1 : -1]
        logp = -torch.nn.functional.cross_entropy(
            model.lm_head(states), torch.tensor(row.reply), reduction="sum"
        )
    return logp.exp().item()


def teach_tiny_model(
    model_dir: str | Path,
    conversations: list[Conversation],
    *,
    steps: int = 300,
    lr: float = 1e-2,
    seed: int = 0,
    stop_prob: float = 0.99,
) -> None:
    """Fine-tune the model in `model_dir` (its LM head untied) until it samples every scripted
    reply, and save it.

    Full-batch AdamW in float32 on the reply tokens only (prompt masked out), every teaching day
    (`shown`) in every step, until every reply token is the first choice (`_SETTLED`, on every
    day) or for `steps`; then the script's rows of the LM head are scaled until every reply has
    probability >= `stop_prob` (a lower bound, `_Head`). Prints the worst probability per reply
    (and a prompt longer than the replies' `reach` measured whole, as vLLM serves it, over the
    whole vocabulary), and raises below 0.95. Training is full-batch without dropout, so `seed`
    only pins torch's generator for anything random a model might add.

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
    days = _days(tokenizer, conversations)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    vocab = torch.tensor(sorted({i for day in days for row in day for i in row.prompt + row.reply}))
    lesson = _lesson(days, vocab, reach(model))
    head = _Head(model.lm_head.weight.detach(), vocab)
    with torch.no_grad():
        head.aim(_hidden(model, lesson), lesson.wanted)
    # Random input embeddings already tell tokens apart; freezing them spares a dense
    # vocab-sized gradient and optimizer state per step, as `_Head` does for the LM head's.
    # A short beta2 lets Adam keep its step size once gradients shrink near zero loss, where
    # the last margins are won.
    model.get_input_embeddings().weight.requires_grad_(False)
    model.lm_head.weight.requires_grad_(False)
    body = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": body}, {"params": [head.rows], "lr": lr * _HEAD_LR}]
    optim = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    # A linear warm-up: at full `lr` from the start the random model overshoots and oscillates.
    warmup = torch.optim.lr_scheduler.LambdaLR(optim, lambda k: min(1.0, (k + 1) / 10))
    taken = 0
    while True:
        hidden = _hidden(model, lesson)
        token_logp = head.logprobs(hidden, lesson.wanted)
        if token_logp.min() >= math.log(_SETTLED) or taken == steps:
            break
        optim.zero_grad()
        (-token_logp.mean()).backward()
        optim.step()
        warmup.step()
        taken += 1
    hidden = _served(model, lesson)
    scale = head.sharpen(hidden, lesson, stop_prob)
    probs = _reply_logprobs(head.logprobs(hidden, lesson.wanted), lesson).exp()
    head.save_into(model.lm_head.weight)
    worst = probs[torch.tensor(lesson.days)].amin(0).tolist()
    reached = reach(model)
    whole = [_whole_prompt_prob(model, row) for row in days[0] if reached and len(row.prompt) > reached]
    shown_probs = [round(p, 4) for p in worst + whole]
    elapsed = time.monotonic() - start
    print(
        f"taught {len(worst)} replies ({len(lesson.rows)} over {len(days)} days) in {taken} steps, "
        f"script rows x{scale:.2f}, {elapsed:.1f}s; p(reply) >= {shown_probs}"
    )
    if min(worst + whole) < 0.95:
        raise RuntimeError(f"the tiny model did not learn its script: p(reply) >= {shown_probs}")
    model.save_pretrained(model_dir, safe_serialization=True)
