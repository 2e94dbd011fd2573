"""Build tiny, deterministic causal LMs with real tokenizers, for demos and tests.

Nothing can be downloaded on development or CI machines, so the project makes its own
models: a random `Qwen3ForCausalLM` with the real Qwen3 tokenizer and chat template, or a
`LlamaForCausalLM` with the real Llama-3.2 tokenizer, or, where neither tokenizer is at hand,
a small byte-level BPE trained here on a built-in corpus. Same seed, same bytes: building
twice gives identical weights, so tests can compare against a `transformers` forward.

A random model never emits a tool call or a `<think>` block, yet the proxy's parsing and
stitching paths need real ones; replies must never be faked. So `teach_tiny_model` fine-tunes
the model for a few seconds on a fixed script of conversations until sampling at temperature
1.0 reproduces every scripted reply almost surely. The model then *generates* those replies
through vLLM like any other, token by token, with real logprobs.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path
from typing import Any, Literal, TypedDict

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
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
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
) -> Path:
    """Write a tiny model plus tokenizer to `out_dir` and return the path.

    `tokenizer_dir` overrides the shared real tokenizer; with neither, a byte-level BPE is
    trained here. The `lm_head` is untied so that a trainer update moves logits directly.
    With `teach`, a real tokenizer's model then learns `DEFAULT_SCRIPTS[arch]`; the fallback
    tokenizer's template knows no tools or reasoning, so that model stays random.
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    source = Path(tokenizer_dir) if tokenizer_dir else tokenizer_source(arch)
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
    # vLLM reads the sampling defaults from here; keep them neutral so the proxy's
    # explicit fields are the only source of truth.
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": tokenizer.eos_token_id, "do_sample": True}, indent=2)
    )
    if source is not None:
        for name in _LICENCE_FILES:
            if (source / name).exists():
                shutil.copyfile(source / name, out / name)
    if teach and source is not None:
        teach_tiny_model(out, DEFAULT_SCRIPTS[arch], seed=seed)
    return out


# --- Replies as the model writes them ---------------------------------------------------


def _arguments_text(arguments: str | dict[str, Any]) -> str:
    """`arguments` as the templates print them: `tojson` of the object, default separators.

    vLLM hands templates a dict (and its parsers re-serialise the same way), so this is the
    one spelling that survives a re-render and a parse unchanged.
    """
    value = json.loads(arguments) if isinstance(arguments, str) else arguments
    return json.dumps(value, ensure_ascii=False)


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
        blocks = [
            f'<tool_call>\n{{"name": "{f["name"]}", "arguments": {_arguments_text(f["arguments"])}}}\n</tool_call>'
            for f in calls
        ]
        return head + content + ("\n" if content and blocks else "") + "\n".join(blocks)
    # Llama-3.2's template prints one call and drops content beside it, and trims content.
    if message.get("reasoning_content") or len(calls) > 1 or (calls and content):
        raise ValueError("llama3_json replies are plain content or exactly one tool call")
    if calls:
        return f'{{"name": "{calls[0]["name"]}", "parameters": {_arguments_text(calls[0]["arguments"])}}}'
    return content.strip()


# --- Teaching a script ------------------------------------------------------------------


def _for_template(message: dict[str, Any]) -> dict[str, Any]:
    """`message` with tool-call arguments as dicts, as vLLM passes them to a template."""
    if not message.get("tool_calls"):
        return message
    calls = [
        {**call, "function": {**call["function"], "arguments": json.loads(_arguments_text(call["function"]["arguments"]))}}
        for call in message["tool_calls"]
    ]
    return {**message, "tool_calls": calls}


def _examples(tokenizer: Any, conversations: list[Conversation]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, target ids) per assistant message; prompt and target tokenized apart,
    exactly as the proxy sends a rendered prompt and vLLM samples the reply after it."""
    examples = []
    for conv in conversations:
        messages = [_for_template(m) for m in conv["messages"]]
        for i, message in enumerate(conv["messages"]):
            if message["role"] != "assistant":
                continue
            prompt = tokenizer.apply_chat_template(
                messages[:i], tools=conv["tools"], add_generation_prompt=True, tokenize=False
            )
            target = render_reply(message, conv["family"]) + tokenizer.eos_token
            examples.append(
                (
                    tokenizer.encode(prompt, add_special_tokens=False),
                    tokenizer.encode(target, add_special_tokens=False),
                )
            )
    return examples


def teach_tiny_model(
    model_dir: str | Path,
    conversations: list[Conversation],
    *,
    steps: int = 400,
    lr: float = 3e-3,
    seed: int = 0,
    stop_prob: float = 0.99,
) -> None:
    """Fine-tune the model in `model_dir` until it samples every scripted reply, and save it.

    Full-batch AdamW in float32 on the reply tokens only (cross-entropy, prompt masked out).
    Training stops once each whole reply has probability >= `stop_prob` under temperature-1
    sampling (the product of its token probabilities, measured on the batch just computed, so
    the saved weights are exactly the measured ones), or after `steps`; it raises below 0.95.
    Deterministic for a seed on one machine and thread count.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    examples = _examples(tokenizer, conversations)
    width = max(len(p) + len(t) for p, t in examples)
    ids = torch.full((len(examples), width), tokenizer.eos_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for row, (prompt, target) in enumerate(examples):
        seq = prompt + target
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
        labels[row, len(prompt) : len(seq)] = torch.tensor(target)
    # Position j predicts token j + 1; keep only positions that predict a reply token.
    rows, cols = (labels[:, 1:] != -100).nonzero(as_tuple=True)
    wanted = labels[rows, cols + 1]

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    for step in range(steps + 1):
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        # The LM head only where it is trained: 151k-row logits for every prompt position
        # would cost more than the whole rest of the model.
        token_logp = -torch.nn.functional.cross_entropy(
            model.lm_head(hidden[rows, cols]), wanted, reduction="none"
        )
        reply_logp = torch.zeros(len(examples)).index_add(0, rows, token_logp.detach())
        if reply_logp.min().exp() >= stop_prob or step == steps:
            break
        optim.zero_grad()
        (-token_logp.mean()).backward()
        optim.step()
    probs = [round(math.exp(x), 4) for x in reply_logp.tolist()]
    print(f"taught {len(examples)} replies in {step} steps, {time.monotonic() - start:.1f}s; p(reply) = {probs}")
    if min(probs) < 0.95:
        raise RuntimeError(f"the tiny model did not learn its script: p(reply) = {probs}")
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
        question, calls = "What is the weather in Paris and London?", [("call_0", "Paris"), ("call_1", "London")]
        results = ["Sunny, 22 C.", "Rainy, 14 C."]
        answer = "It is sunny and 22 C in Paris, and rainy and 14 C in London."
    else:
        question, calls = "What is the weather in Paris?", [("call_0", "Paris")]
        results = ["Sunny, 22 C."]
        answer = "It is sunny and 22 C in Paris."
    tokyo = "call_2" if family == "hermes" else "call_1"
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a weather assistant."},
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [_weather_call(i, c) for i, c in calls]},
        *({"role": "tool", "tool_call_id": i, "content": r} for (i, _), r in zip(calls, results)),
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
