"""Build tiny, deterministic causal LMs with real tokenizers, for demos and tests.

Nothing can be downloaded on development or CI machines, so the project makes its own
models: a random `Qwen3ForCausalLM` with the real Qwen3 tokenizer and chat template, or a
`LlamaForCausalLM` with the real Llama-3.2 tokenizer, or, where neither tokenizer is at hand,
a small byte-level BPE trained here on a built-in corpus. Same seed, same bytes: building
twice gives identical weights, so tests can compare against a `transformers` forward.

A random model never emits a tool call or a `<think>` block, yet the proxy's parsing and
stitching paths need real ones; replies must never be faked. So `teach_tiny_model` fine-tunes
the model (well under a minute on one CPU core) on a fixed script of conversations until
sampling at temperature 1.0 reproduces every scripted reply almost surely (p > 0.99 each).
The model then *generates* those replies through vLLM like any other, token by token, with
real logprobs; the taught weights are byte-identical from build to build as well.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from datetime import date, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypedDict

if TYPE_CHECKING:
    import torch

Arch = Literal["qwen3", "llama"]
Family = Literal["hermes", "llama3_json"]
"""vLLM's `--tool-call-parser` name, which also fixes the reply format the model writes."""


class Conversation(TypedDict):
    """One scripted chat: every assistant message in it is a reply the model must learn."""

    family: Family
    tools: list[dict[str, Any]] | None
    messages: list[dict[str, Any]]


SHARED_TOKENIZERS = Path(__file__).resolve().parents[2] / "shared" / "tokenizers"
_TOKENIZER_DIRS: dict[Arch, str] = {"qwen3": "qwen3", "llama": "llama3.2"}
_LICENCE_FILES = ("LICENSE", "NOTICE.md", "USE_POLICY.md")

# A ChatML template for the self-trained fallback tokenizer: same shape as Qwen's.
_FALLBACK_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_FALLBACK_CORPUS = (
    "The quick brown fox jumps over the lazy dog. 0123456789 + - * / = ( ) { } [ ] , . : ; ' \" "
    "What is the weather in Paris? Call the tool get_weather with a city. The answer is 42. "
    "You are a helpful assistant. Think step by step and answer briefly. "
)


def tokenizer_source(arch: Arch) -> Path | None:
    """The shared real tokenizer folder for `arch`, or None where it is absent."""
    folder = SHARED_TOKENIZERS / _TOKENIZER_DIRS[arch]
    return folder if (folder / "tokenizer.json").exists() else None


def _fallback_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_FALLBACK_CORPUS] * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = _FALLBACK_TEMPLATE
    return fast


def build_tiny_model(
    out_dir: str | Path,
    arch: Arch = "qwen3",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    seed: int = 0,
    tokenizer_dir: str | Path | None = None,
    fallback_vocab_size: int = 512,
    teach: bool = True,
    fallback_tokenizer: bool = False,
) -> Path:
    """Write a tiny model plus tokenizer to `out_dir` and return the path.

    `tokenizer_dir` overrides the shared real tokenizer; with neither, a byte-level BPE is
    trained here. The `lm_head` is untied so that a trainer update moves logits directly.
    With `teach`, a model with a real tokenizer then learns `DEFAULT_SCRIPTS[arch]` (pass
    `teach=False` for a `tokenizer_dir` whose template cannot print that script); the
    fallback tokenizer's template knows no tools or reasoning, so that model stays random.
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # `fallback_tokenizer`: the small self-trained BPE even where a real tokenizer is at hand;
    # RL demos want its ~400-token vocabulary (fast steps, rewards a random model can find).
    source = None if fallback_tokenizer else Path(tokenizer_dir) if tokenizer_dir else tokenizer_source(arch)
    if source is not None:
        tokenizer = AutoTokenizer.from_pretrained(str(source))
    else:
        tokenizer = _fallback_tokenizer(fallback_vocab_size)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        # vLLM's CPU attention supports head sizes of 32 and up.
        num_attention_heads=hidden_size // 32,
        num_key_value_heads=max(1, hidden_size // 64),
        head_dim=32,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model.to(torch.float32).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    if teach and source is not None:
        teach_tiny_model(out, DEFAULT_SCRIPTS[arch], seed=seed)
    # vLLM reads the sampling defaults from here; keep them neutral so the proxy's
    # explicit fields are the only source of truth. (Written last: saving a model rewrites it.)
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": tokenizer.eos_token_id, "do_sample": True}, indent=2)
    )
    if source is not None:
        for name in _LICENCE_FILES:
            if (source / name).exists():
                shutil.copyfile(source / name, out / name)
    return out


# --- Replies as the model writes them ---------------------------------------------------


def _arguments_text(arguments: str | dict[str, Any]) -> str:
    """`arguments` as the templates print them: `tojson` of the object, default separators.

    vLLM hands templates a dict (and its parsers re-serialise the same way), so this is the
    one spelling that survives a re-render and a parse unchanged.
    """
    value = json.loads(arguments) if isinstance(arguments, str) else arguments
    return json.dumps(value, ensure_ascii=False)


def _call_json(function: dict[str, Any], key: str) -> str:
    """`{"name": NAME, KEY: ARGS}`, spelled as both templates spell it (name printed raw)."""
    return f'{{"name": "{function["name"]}", "{key}": {_arguments_text(function["arguments"])}}}'


def render_reply(message: dict[str, Any], family: Family) -> str:
    """The exact text the model must sample for an OpenAI assistant `message`, EOS excluded.

    It is what the model's own chat template prints for that message in history, so the
    proxy's segment continues, and what vLLM's `family` parser reads back into the message.
    Qwen3 (hermes) prints a `<think>` block only for messages after the last user turn, so a
    reply with `reasoning_content` round-trips until the next user message (by design).
    """
    content = message.get("content") or ""
    calls = [call["function"] for call in message.get("tool_calls") or []]
    if family == "hermes":
        reasoning = message.get("reasoning_content")
        head = f"<think>\n{reasoning}\n</think>\n\n" if reasoning else ""
        blocks = [f"<tool_call>\n{_call_json(f, 'arguments')}\n</tool_call>" for f in calls]
        return head + content + ("\n" if content and blocks else "") + "\n".join(blocks)
    # Llama-3.2's template prints one call and drops content beside it, and trims content.
    if message.get("reasoning_content") or len(calls) > 1 or (calls and content):
        raise ValueError("llama3_json replies are plain content or exactly one tool call")
    return _call_json(calls[0], "parameters") if calls else content.strip()


# --- Teaching a script ------------------------------------------------------------------

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
    """The script rendered on one date: a row per assistant message, N reply tokens in all."""

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


def _script_batch(tokenizer: Any, conversations: list[Conversation], date_string: str) -> _Batch:
    """Tokenize prompt and reply apart, exactly as the proxy sends a rendered prompt and vLLM
    samples after it (one BPE of the joined text could differ at the seam)."""
    import torch

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
    ids = torch.full((len(pairs), max(len(p) + len(r) for p, r in pairs)), tokenizer.eos_token_id)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for row, (prompt, reply) in enumerate(pairs):
        ids[row, : len(prompt) + len(reply)] = torch.tensor(prompt + reply)
        mask[row, : len(prompt) + len(reply)] = 1
        labels[row, len(prompt) : len(prompt) + len(reply)] = torch.tensor(reply)
    # Position j predicts token j + 1.
    rows, cols = (labels[:, 1:] != -100).nonzero(as_tuple=True)
    return _Batch(ids, mask, rows, cols, labels[rows, cols + 1])


def _token_logprobs(model: Any, batch: _Batch) -> torch.Tensor:
    """[N] log-probabilities of the reply tokens, full-vocabulary softmax at temperature 1."""
    import torch

    hidden = model.model(input_ids=batch.ids, attention_mask=batch.mask).last_hidden_state
    # The LM head only where it is trained: vocab-wide logits at every prompt position
    # would cost more than the whole rest of the model.
    logits = model.lm_head(hidden[batch.rows, batch.cols])
    return -torch.nn.functional.cross_entropy(logits, batch.wanted, reduction="none")


def _reply_probs(token_logp: torch.Tensor, batch: _Batch) -> torch.Tensor:
    """[R] probability that temperature-1 sampling writes each whole reply, EOS included."""
    import torch

    return torch.zeros(len(batch.ids)).index_add(0, batch.rows, token_logp.detach()).exp()


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
    batches: list[_Batch] = []
    for day in _TEACH_DATES:  # one batch for templates that print no date
        batch = _script_batch(tokenizer, conversations, day)
        if not any(torch.equal(batch.ids, b.ids) for b in batches):
            batches.append(batch)

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
        batch = batches[step % len(batches)]
        token_logp = _token_logprobs(model, batch)
        streak = streak + 1 if _reply_probs(token_logp, batch).min() >= stop_prob else 0
        if streak == len(batches):
            break
        optim.zero_grad()
        (-token_logp.mean()).backward()
        optim.step()
        warmup.step()
    with torch.no_grad():
        probs = torch.stack([_reply_probs(_token_logprobs(model, b), b) for b in batches]).amin(0).tolist()
    shown = [round(p, 4) for p in probs]
    elapsed = time.monotonic() - start
    print(f"taught {len(probs)} replies in {step} steps, {elapsed:.1f}s; p(reply) >= {shown}")
    if min(probs) < 0.95:
        raise RuntimeError(f"the tiny model did not learn its script: p(reply) = {shown}")
    model.save_pretrained(model_dir, safe_serialization=True)


# --- Scripts ----------------------------------------------------------------------------

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city name."}},
            "required": ["city"],
        },
    },
}


def _weather_call(call_id: str, city: str) -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
    }


def weather_episode(family: Family) -> Conversation:
    """Five tool-using turns: parallel calls (one for Llama, whose template allows only
    one per message), answers from tool results, a follow-up call, a closing reply."""
    if family == "hermes":
        question = "What is the weather in Paris and London?"
        calls = [("call_0", "Paris", "Sunny, 22 C."), ("call_1", "London", "Rainy, 14 C.")]
        answer = "It is sunny and 22 C in Paris, and rainy and 14 C in London."
    else:
        question = "What is the weather in Paris?"
        calls = [("call_0", "Paris", "Sunny, 22 C.")]
        answer = "It is sunny and 22 C in Paris."
    tokyo = f"call_{len(calls)}"
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a weather assistant."},
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [_weather_call(i, c) for i, c, _ in calls]},
        *({"role": "tool", "tool_call_id": i, "content": result} for i, _, result in calls),
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And Tokyo?"},
        {"role": "assistant", "content": None, "tool_calls": [_weather_call(tokyo, "Tokyo")]},
        {"role": "tool", "tool_call_id": tokyo, "content": "Cloudy, 18 C."},
        {"role": "assistant", "content": "It is cloudy and 18 C in Tokyo."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You're welcome!"},
    ]
    return {"family": family, "tools": [WEATHER_TOOL], "messages": messages}


def thinking_episode() -> Conversation:
    """Two reasoning turns for Qwen3, whose template drops the first `<think>` block once the
    second user message arrives: the history rewrite that must seal a segment."""
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "reasoning_content": "The user greets me.", "content": "Hello!"},
        {"role": "user", "content": "How are you?"},
        {"role": "assistant", "reasoning_content": "Answer politely.", "content": "Fine, thanks."},
    ]
    return {"family": "hermes", "tools": None, "messages": messages}


DEFAULT_SCRIPTS: dict[Arch, list[Conversation]] = {
    "qwen3": [weather_episode("hermes"), thinking_episode()],
    "llama": [weather_episode("llama3_json")],
}
"""What `build_tiny_model(teach=True)` teaches, per architecture."""
