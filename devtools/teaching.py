"""Teach a tiny model its script: fine-tune until temperature-1 sampling writes every reply.

The model then *generates* those replies through vLLM like any other, token by token, with
real logprobs; the taught weights are byte-identical from build to build on one machine (one
CPU thread, fixed seed, fixed dates; Claude Code's prompt names the machine's OS). About a
minute of one CPU core; more with the CLIs' episodes (`devtools.claude_code`, `devtools.codex`,
`devtools.gemini_cli`), whose 4k- to 19k-token prompts are taught on the tail the tiny Qwen3
model's sliding window lets a reply see.

A step costs by the token it runs forward and back, and most of a long prompt's are attention:
so each conversation's replies go through one forward where the template renders the
conversation prefix-stably (`_Pass`: a reply's prompt is the one before's prompt and reply,
then more), not one per reply over ever longer prompts. On the tests' Qwen3 script (27 replies,
5 of them after 2k-token tails) that halved a step's CPU, 2.0 to 1.0 s, with the same loss.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from datetime import date, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from devtools.scripts import Conversation, as_echoed, render_reply

if TYPE_CHECKING:
    import torch

# Llama-3's template writes today's date into the system header (`strftime_now`). Taught on
# one date, the tiny model loses its script on some others; so each step shows it the script
# on another of these dates (a teaching day), and it learns to look past the date. Fixed
# dates keep the weights independent of the day they are built on.
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


_BATCHED = 768
"""Passes up to this many tokens are taught together, in right-padded batches of passes of
about one length (`_PADDING`); longer ones one at a time, unpadded."""
_PADDING = 1.25
"""A batch's padded size stays within this factor of its real tokens: one batch of the Qwen3
scripts' rows (22 to 674 tokens) was 55% padding, and a step's forward costs by the token."""
_CHUNK = 2048
"""Prompt tokens per forward where a whole long prompt is measured (a prefill in chunks)."""


@dataclass(frozen=True, slots=True)
class _Row:
    """One assistant message: the prompt before it and the reply, EOS included."""

    prompt: list[int]
    reply: list[int]
    weight: float = 1.0
    """Its conversation's `weight`: the probability it is taught to."""


@dataclass(frozen=True, slots=True)
class _Pass:
    """Replies of one conversation that one forward teaches: each reply's prompt is the
    previous reply's prompt and reply, then more (the template renders them prefix-stably), so
    the last prompt and reply hold them all, each at the position it has in its own row. A
    Qwen3 conversation whose template drops an earlier `<think>` block splits there."""

    ids: list[int]
    """The last row's prompt and reply."""
    spans: list[tuple[int, int]]
    """Where each reply lies in `ids`."""
    replies: list[int]
    """Each reply's place among the day's rows (`_Day.rows`)."""
    weight: float


def _passes(rows: list[_Row], conversation: list[int]) -> list[_Pass]:
    """`rows` (the day's, in order) in passes: consecutive rows of one conversation
    (`conversation`: each row's) join a pass while each one's prompt starts with the one
    before's prompt and reply, token for token."""
    passes: list[_Pass] = []
    for i, row in enumerate(rows):
        last = passes[-1] if passes else None
        span = (len(row.prompt), len(row.prompt) + len(row.reply))
        if (
            last
            and conversation[last.replies[-1]] == conversation[i]
            and row.prompt[: len(last.ids)] == last.ids
        ):
            passes[-1] = _Pass(row.prompt + row.reply, [*last.spans, span], [*last.replies, i], row.weight)
        else:
            passes.append(_Pass(row.prompt + row.reply, [span], [i], row.weight))
    return passes


@dataclass(frozen=True, slots=True)
class _Batch:
    """Passes of about one length, right-padded into one batch: N reply tokens in all."""

    ids: torch.Tensor
    """[R, T] each pass's tokens; right-padded."""
    mask: torch.Tensor | None
    """[R, T] 1 on real tokens; None for one pass (no padding)."""
    rows: torch.Tensor
    """[N] the batch row of each reply token."""
    cols: torch.Tensor
    """[N] the position that predicts it (one before the token)."""
    wanted: torch.Tensor
    """[N] the reply token ids."""
    replies: torch.Tensor
    """[N] its reply's place among the day's rows."""
    weights: torch.Tensor
    """[N] the weight of each reply token's conversation."""


@dataclass(frozen=True, slots=True)
class _Day:
    """The script as shown on one teaching day (its date, its varied text)."""

    rows: list[_Row]
    batches: list[_Batch]
    """The passes (`_Pass`) of at most `_BATCHED` tokens in batches, then the longer ones one
    at a time, each on the tail its first reply can depend on (`reach`)."""
    long: list[_Pass]
    """The longer passes whole, as `_measured` measures them."""

    @property
    def mixed(self) -> bool:
        """Whether any row has a weight other than 1 (a mixed script)."""
        return any(row.weight != 1.0 for row in self.rows)

    def shares(self) -> torch.Tensor:
        """[rows] the probability each reply is taught to: its weight over the weights of the
        distinct replies that follow its prompt (1 where no other reply does; a row that two
        conversations share counts once)."""
        import torch

        replies: dict[tuple[int, ...], dict[tuple[int, ...], float]] = {}
        for row in self.rows:
            replies.setdefault(tuple(row.prompt), {}).setdefault(tuple(row.reply), row.weight)
        total = {prompt: sum(weights.values()) for prompt, weights in replies.items()}
        return torch.tensor([row.weight / total[tuple(row.prompt)] for row in self.rows])

    def token_weights(self) -> torch.Tensor:
        """[tokens] the weights, in the order `_step_logprobs` gives the token log-probabilities."""
        import torch

        return torch.cat([batch.weights for batch in self.batches])


def _varied(conv: Conversation, day: int) -> Conversation:
    """`conv` with each of its `vary` texts replaced by the value for teaching day `day`."""
    text = json.dumps({k: v for k, v in conv.items() if k != "vary"})
    for seen, shown in conv.get("vary", {}).items():
        text = text.replace(json.dumps(seen)[1:-1], json.dumps(shown[day % len(shown)])[1:-1])
    return json.loads(text)


def _script_rows(tokenizer: Any, conversations: list[Conversation], date_string: str) -> list[list[_Row]]:
    """Each conversation's rows. Tokenize prompt and reply apart, exactly as the proxy sends a
    rendered prompt and vLLM samples after it (one BPE of the joined text could differ at the
    seam)."""

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    rows = []
    for conv in conversations:
        history = [_for_template(as_echoed(m, conv["family"])) for m in conv["messages"]]
        rows.append([])
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
                rows[-1].append(_Row(encode(prompt), encode(reply), conv.get("weight", 1.0)))
    return rows


def _batch(passes: list[_Pass], pad_id: int, start: int = 0) -> _Batch:
    """`passes` right-padded into one batch; one pass from its token `start` on."""
    import torch

    ids = torch.full((len(passes), max(len(p.ids) for p in passes) - start), pad_id)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    reply = torch.full_like(ids, -1)
    for i, p in enumerate(passes):
        ids[i, : len(p.ids) - start] = torch.tensor(p.ids[start:])
        mask[i, : len(p.ids) - start] = 1
        for (begin, end), row in zip(p.spans, p.replies, strict=True):
            labels[i, begin - start : end - start] = torch.tensor(p.ids[begin:end])
            reply[i, begin - start : end - start] = row
    # Position j predicts token j + 1.
    where, cols = (labels[:, 1:] != -100).nonzero(as_tuple=True)
    weights = torch.tensor([p.weight for p in passes])
    return _Batch(
        ids,
        mask if len(passes) > 1 else None,
        where,
        cols,
        labels[where, cols + 1],
        reply[where, cols + 1],
        weights[where],
    )


def _batches(passes: list[_Pass], pad_id: int) -> list[_Batch]:
    """`passes` in batches of about one length: by length, a new batch wherever the next
    would pad the current one past `_PADDING` times its tokens."""
    by_length = sorted(passes, key=lambda p: len(p.ids))
    groups: list[list[_Pass]] = []
    for p in by_length:
        group = groups[-1] if groups else []
        real = len(p.ids) + sum(len(q.ids) for q in group)
        if not group or len(p.ids) * (len(group) + 1) > _PADDING * real:
            groups.append(group := [])
        group.append(p)
    return [_batch(group, pad_id) for group in groups]


def _day(
    tokenizer: Any, conversations: list[Conversation], day: int, date_string: str, reach: int | None
) -> _Day:
    """The script on teaching day `day`; long passes taught on the last `reach` tokens before
    their first reply (`reach`: None, all of them)."""
    convs = _script_rows(tokenizer, [_varied(c, day) for c in conversations], date_string)
    rows = [row for conv in convs for row in conv]
    passes = _passes(rows, [k for k, conv in enumerate(convs) for _ in conv])
    long = [p for p in passes if len(p.ids) > _BATCHED]
    tails = [_batch([p], 0, max(0, p.spans[0][0] - reach) if reach else 0) for p in long]
    return _Day(
        rows, _batches([p for p in passes if len(p.ids) <= _BATCHED], tokenizer.eos_token_id) + tails, long
    )


_HEAD_ROWS = 32
"""Reply tokens per LM-head call while teaching. The logits of all reply tokens at once are
hundreds of megabytes (a 151k vocabulary), allocated anew at every step: measured on the Qwen3
script (408 reply tokens), 32-token chunks took a step from 1.45 to 1.18 s, system time (page
faults) from 0.54 to 0.19 s."""


def _head_logprobs(
    model: Any, hidden: torch.Tensor, wanted: torch.Tensor, vocab: torch.Tensor | None
) -> torch.Tensor:
    """[N] log p(wanted) from the hidden states [N, H] at temperature 1: over the whole
    vocabulary, or over `vocab` only (sorted ids, `wanted` among them; `_Head`)."""
    import torch

    if vocab is not None:
        logits = hidden @ model.lm_head.weight[vocab].T
        return -torch.nn.functional.cross_entropy(logits, torch.searchsorted(vocab, wanted), reduction="none")
    # In chunks of `_HEAD_ROWS` tokens.
    chunks = zip(hidden.split(_HEAD_ROWS), wanted.split(_HEAD_ROWS), strict=True)
    return torch.cat(
        [-torch.nn.functional.cross_entropy(model.lm_head(h), w, reduction="none") for h, w in chunks]
    )


def _reply_states(model: Any, batch: _Batch) -> torch.Tensor:
    """[N, H] the hidden states that predict the batch's reply tokens. The LM head runs on
    these only: vocab-wide logits at every prompt position would cost more than the whole rest
    of the model."""
    hidden = model.model(input_ids=batch.ids, attention_mask=batch.mask).last_hidden_state
    return hidden[batch.rows, batch.cols]


def reach(model: Any) -> int | None:
    """How many prompt tokens a reply can depend on: the sliding window times the layers (the
    tiny Qwen3 model's, `devtools.tinymodel`); None: all of them. A long pass is taught on
    that many tokens before its first reply: a 19k-token prompt costs what 2k do."""
    window = getattr(model.config, "sliding_window", None)
    return window * model.config.num_hidden_layers if window else None


def _whole_pass_probs(model: Any, whole: _Pass) -> list[float]:
    """p(reply) of each reply in `whole` after its whole prompt at its real positions, as vLLM
    serves it: a prefill in chunks of `_CHUNK` tokens through the KV cache (one forward over
    19k tokens with a sliding-window mask takes 20 s on one thread; this, 2)."""
    import torch

    cache, hidden = None, []
    with torch.no_grad():
        for start in range(0, len(whole.ids), _CHUNK):
            chunk = torch.tensor([whole.ids[start : start + _CHUNK]])
            out = model.model(input_ids=chunk, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            hidden.append(out.last_hidden_state[0])
        states = torch.cat(hidden)
        probs = []
        for begin, end in whole.spans:
            logp = -torch.nn.functional.cross_entropy(
                model.lm_head(states[begin - 1 : end - 1]),
                torch.tensor(whole.ids[begin:end]),
                reduction="sum",
            )
            probs.append(logp.exp().item())
    return probs


def greedy_margins(model: Any, tokenizer: Any, conversations: list[Conversation], days: int) -> list[float]:
    """Each reply's smallest logit margin (its token's logit minus the best other one's) over
    its tokens, after the prompt tail it can depend on (`reach`), on each of the first `days`
    teaching days (their `vary` values): > 0 where greedy decoding writes it. In order: day,
    conversation, reply."""
    import torch

    window = reach(model)
    margins = []
    with torch.no_grad():
        for day in range(days):
            varied = [_varied(c, day) for c in conversations]
            date_string = _TEACH_DATES[day % len(_TEACH_DATES)]
            for row in (r for conv in _script_rows(tokenizer, varied, date_string) for r in conv):
                prompt = row.prompt[-window:] if window else row.prompt
                hidden = model.model(input_ids=torch.tensor([prompt + row.reply])).last_hidden_state[0]
                logits = model.lm_head(hidden[len(prompt) - 1 : -1])
                wanted = torch.tensor(row.reply)
                chosen = logits[torch.arange(len(wanted)), wanted]
                logits[torch.arange(len(wanted)), wanted] = -torch.inf
                margins.append(float((chosen - logits.max(-1).values).min()))
    return margins


_NEGATIVES = 4096
"""Tokens outside the script that the first phase's softmax includes, drawn once per build: the
taught replies must win over them too, so the whole vocabulary's softmax mostly agrees."""


def _head_vocab(days: list[_Day], vocab_size: int, seed: int) -> torch.Tensor:
    """[V'] sorted ids: every id of the script (prompts and replies, every day) and
    `_NEGATIVES` others drawn with `seed`."""
    import torch

    ids = torch.tensor(sorted({i for day in days for row in day.rows for i in row.prompt + row.reply}))
    draw = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))[: _NEGATIVES + len(ids)]
    return torch.cat([ids, draw[~torch.isin(draw, ids)][:_NEGATIVES]]).sort().values


def _step_logprobs(
    model: Any, day: _Day, vocab: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One teaching step's reply-token log-probabilities, and each row's reply probability
    (temperature 1, EOS included): over the whole vocabulary, or over `vocab` only."""
    import torch

    # One LM-head call for all batches: the gradient of `lm_head.weight[vocab]` is a dense
    # vocab-sized tensor, zeroed and added once per call: per batch, 15% of a step went to it.
    states = torch.cat([_reply_states(model, batch) for batch in day.batches])
    wanted = torch.cat([batch.wanted for batch in day.batches])
    token_logp = _head_logprobs(model, states, wanted, vocab)
    replies = torch.cat([batch.replies for batch in day.batches])
    probs = torch.zeros(len(day.rows)).index_add(0, replies, token_logp.detach()).exp()
    return token_logp, probs


def _worst(model: Any, days: list[_Day]) -> list[float]:
    """Each reply's worst probability over the days and the whole vocabulary, over its share
    (`_Day.shares`: 1 where the script is not mixed)."""
    import torch

    with torch.no_grad():
        return torch.stack([_step_logprobs(model, day)[1] / day.shares() for day in days]).amin(0).tolist()


def _whole(model: Any, day: _Day) -> list[float]:
    """The replies of `day`'s long passes after their whole prompts, over their shares."""
    shares = day.shares().tolist()
    return [
        p / shares[row]
        for long in day.long
        for row, p in zip(long.replies, _whole_pass_probs(model, long), strict=True)
    ]


def _schedule(step: int) -> float:
    """The learning rate's factor at `step`. A linear warm-up over 40 steps: at full `lr` from
    the start the random model overshoots and oscillates (Llama did); warmed up, it takes the
    high rate that learns the script fast. Then a cosine down to a tenth over 160 steps: at a
    constant rate the last margins came and went (the Qwen3 script's worst reply swung between
    0.9 and 0.004 from step 80 on, and whether a run converged at step 171 or not in 300 hung
    on float rounding); decaying, they settle."""
    if step < 40:
        return (step + 1) / 40
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - 39) / 160)))


_SHARPEN = 2.0
"""What the LM head is multiplied by once taught (logits times 2: temperature-1 sampling then
samples as 0.5 did; greedy choices stay). Taught to p(reply) >= 0.99, a reply went off its
script once in a hundred or so seeded samples at temperature 1, and the suite samples a few
hundred: each new build broke a seeded test by chance (one did, `tests/test_agent_logprobs.py`).
Doubled, the p(reply) of every reply of the Qwen3 script rose to >= 0.9999. A mixed script's
replies must keep their shares, so it is left as taught."""


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
    day per step (a date, and each conversation's `vary` text); the replies of a conversation
    that renders prefix-stably are taught by one forward over it (`_Pass`), and a long pass is
    seen through what its replies can depend on (`reach`). Once every reply has had
    probability >= `stop_prob` on each day in a row, measures the weights over the whole
    vocabulary on every day, and stops where every reply has it there too (else goes on, to
    `steps`); then sharpens the LM head (`_SHARPEN`, unless the script is mixed), measures long
    prompts whole (once), prints the worst probability per reply, and raises below 0.95 (or
    `stop_prob`, if lower). A mixed script (`Conversation.weight`) is
    taught by weighting each reply's tokens with its weight, whose optimum is p = weight where
    replies part ways; its probabilities are measured over their shares (`_Day.shares`).
    Training is full-batch without dropout, so `seed` only pins torch's generator for anything
    random a model might add.

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
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    # As many days as the longest `vary` list has values, at least one per teaching date; one
    # day for scripts that show no date and vary nothing.
    varied = [len(shown) for conv in conversations for shown in conv.get("vary", {}).values()]
    days: list[_Day] = []
    for k in range(max([len(_TEACH_DATES), *varied])):
        day = _day(tokenizer, conversations, k, _TEACH_DATES[k % len(_TEACH_DATES)], reach(model))
        if all(day.rows != d.rows for d in days):
            days.append(day)
    # Random input embeddings already tell tokens apart; freezing them spares a dense
    # vocab-sized gradient and optimizer state per step. A short beta2 lets Adam keep its
    # step size once gradients shrink near zero loss, where the last margins are won.
    model.get_input_embeddings().weight.requires_grad_(False)
    trained = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(trained, lr=lr, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    warmup = torch.optim.lr_scheduler.LambdaLR(optim, _schedule)
    # Over the script's own tokens and a fixed sample of others (`_head_vocab`): the
    # vocabulary-wide LM head is three quarters of a step's time. Once every day has passed
    # there in a row, the weights are measured over the whole vocabulary on every day
    # (`_worst`): usually they pass at once; else teaching goes on there.
    vocab: torch.Tensor | None = _head_vocab(days, model.config.vocab_size, seed)
    streak, worst = 0, None
    for step in range(steps):
        day = days[step % len(days)]
        token_logp, probs = _step_logprobs(model, day, vocab)
        streak = streak + 1 if (probs / day.shares()).min() >= stop_prob else 0
        if streak == len(days):
            worst = _worst(model, days)
            if min(worst) >= stop_prob:
                break
            worst, streak = None, 0
            if vocab is not None:
                vocab = None
                token_logp, _ = _step_logprobs(model, day)
        optim.zero_grad()
        if day.mixed:
            weights = day.token_weights()
            (-(token_logp * weights).sum() / weights.sum()).backward()
        else:
            (-token_logp.mean()).backward()
        optim.step()
        warmup.step()
    if not any(day.mixed for day in days):
        with torch.no_grad():
            model.lm_head.weight.mul_(_SHARPEN)
        worst = None
    probs = (worst or _worst(model, days)) + _whole(model, days[0])
    shown = [round(p, 4) for p in probs]
    elapsed = time.monotonic() - start
    mixed = " / share" if any(day.mixed for day in days) else ""
    print(f"taught {len(probs)} replies in {step} steps, {elapsed:.1f}s; p(reply){mixed} >= {shown}")
    if min(probs) < min(0.95, stop_prob):
        raise RuntimeError(f"the tiny model did not learn its script: p(reply) = {shown}")
    model.save_pretrained(model_dir, safe_serialization=True)
