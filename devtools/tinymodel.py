"""Build tiny, deterministic causal LMs with real tokenizers, for demos and tests.

Nothing can be downloaded on development or CI machines, so the project makes its own
models: a random `Qwen3ForCausalLM` with the real Qwen3 tokenizer and chat template, or a
`LlamaForCausalLM` with the real Llama-3.2 tokenizer, or, where neither tokenizer is at hand,
a small byte-level BPE trained here on a built-in corpus. Same seed, same bytes: building
twice gives identical weights, so tests can compare against a `transformers` forward.

With a real tokenizer the model is then taught its script (`devtools.teaching`,
`devtools.scripts.DEFAULT_SCRIPTS`), so that it writes real tool calls and `<think>` blocks.
Where the tokenizers are found: `devtools.tokenizers`.

Teaching the Qwen3 model costs minutes on 2 cores, so a build is cached (`_cached`), keyed by
everything it depends on: the arguments, the tokenizer's files, `devtools`' own source (the
scripts and the teaching) and the rollout adapters' (the captures run the CLIs as a rollout
does: their environment, config and command line), the versions of torch and transformers,
and, where the Claude Code, Codex and Gemini CLIs are installed (their captured episodes are
taught), their versions and today's date. Change any of them and the next build is made afresh.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from datetime import date
from pathlib import Path
from typing import Any, Literal

import rollout.harnesses.claude_code
import rollout.harnesses.cli
import rollout.harnesses.codex
import rollout.harnesses.gemini_cli
from devtools import claude_code, codex, gemini_cli
from devtools.claude_code import claude_code_episodes
from devtools.codex import codex_episode
from devtools.gemini_cli import gemini_cli_episode
from devtools.scripts import DEFAULT_SCRIPTS, Conversation
from devtools.teaching import teach_tiny_model
from devtools.tokenizers import Arch, tokenizer_source

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


Harness = Literal["claude_code", "codex", "gemini_cli"]
HARNESSES: tuple[Harness, ...] = ("claude_code", "codex", "gemini_cli")
_EPISODES: dict[Harness, Callable[[], list[Conversation]]] = {
    "claude_code": claude_code_episodes,
    "codex": codex_episode,
    "gemini_cli": gemini_cli_episode,
}
_CLIS = {"claude_code": claude_code, "codex": codex, "gemini_cli": gemini_cli}
_ADAPTERS = (
    rollout.harnesses.cli,
    rollout.harnesses.claude_code,
    rollout.harnesses.codex,
    rollout.harnesses.gemini_cli,
)
"""What the captures run the CLIs through (`devtools.claude_code`, `devtools.codex`,
`devtools.gemini_cli`)."""


def taught_scripts(
    arch: Arch, harnesses: Sequence[Harness] = HARNESSES, scripts: Sequence[Conversation] | None = None
) -> list[Conversation]:
    """What `build_tiny_model(teach=True)` teaches: `scripts` (by default `DEFAULT_SCRIPTS[arch]`,
    every test's), and for Qwen3 also the episodes of the `harnesses` whose CLIs are installed
    (`devtools.claude_code`, `devtools.codex`, `devtools.gemini_cli`: captured from the CLIs
    themselves, so only then).
    Teaching costs by the reply and by the prompt token (Claude Code's 19k-token prompts double
    it): an example that plays one script or harness learns only that, in seconds to a minute
    or two, where every test's script costs minutes."""
    captured = [e for harness in harnesses for e in _EPISODES[harness]()] if arch == "qwen3" else []
    return [*(DEFAULT_SCRIPTS[arch] if scripts is None else scripts), *captured]


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
    harnesses: Sequence[Harness] = HARNESSES,
    scripts: Sequence[Conversation] | None = None,
    stop_prob: float = 0.99,
) -> Path:
    """Write a tiny model plus tokenizer to `out_dir` and return the path.

    `tokenizer_dir` names the real tokenizer; by default it is `tokenizer_source(arch)`
    (`$MOLT_PROXY_TOKENIZERS` or the checkout's); with neither, a byte-level BPE is trained
    here. The `lm_head` is untied so that a trainer update moves logits directly.
    With `teach`, a model with a real tokenizer then learns `scripts` (by default
    `DEFAULT_SCRIPTS[arch]`; pass `teach=False` for a `tokenizer_dir` whose template cannot
    print that script) and the episodes of `harnesses` (`taught_scripts`); the fallback
    tokenizer's template knows no tools or reasoning, so that model stays random. Teaching
    stops once every reply has probability `stop_prob` (over its share in a mixed script,
    `Conversation.weight`: `devtools.line_count`'s is taught to 0.9).
    """
    out = Path(out_dir)
    # `fallback_tokenizer`: the small self-trained BPE even where a real tokenizer is at hand;
    # RL demos want its ~400-token vocabulary (fast steps, rewards a random model can find).
    source = None if fallback_tokenizer else Path(tokenizer_dir) if tokenizer_dir else tokenizer_source(arch)
    args = dict(
        arch=arch,
        hidden_size=hidden_size,
        num_layers=num_layers,
        seed=seed,
        fallback_vocab_size=fallback_vocab_size,
        teach=teach and source is not None,
        harnesses=sorted(harnesses) if arch == "qwen3" else [],
        scripts=list(scripts) if scripts is not None else None,
        stop_prob=stop_prob,
    )
    return _cached(out, _build_key(args, source), lambda folder: _build(folder, source, **args))


def _build(
    out: Path,
    source: Path | None,
    *,
    arch: Arch,
    hidden_size: int,
    num_layers: int,
    seed: int,
    fallback_vocab_size: int,
    teach: bool,
    harnesses: list[Harness],
    scripts: list[Conversation] | None,
    stop_prob: float,
) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
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
        # Claude Code's default prompt alone is about 19k tokens.
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    if arch == "qwen3":
        # Sliding-window attention in every layer (as Qwen2/3 and Mistral configs allow): a reply
        # then depends on the last 2 x 1,024 prompt tokens only, so teaching the 19k-token
        # prompt Claude Code sends on its tail is teaching the prompt (`devtools.teaching`).
        # Every other script's prompt is shorter than the window, where nothing changes.
        window = dict(use_sliding_window=True, sliding_window=1024, max_window_layers=0)
        model = Qwen3ForCausalLM(Qwen3Config(**common, **window))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model.to(torch.float32).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    if teach:
        teach_tiny_model(out, taught_scripts(arch, harnesses, scripts), seed=seed, stop_prob=stop_prob)
    # vLLM reads the sampling defaults from here; keep them neutral so the proxy's
    # explicit fields are the only source of truth. (Written last: saving a model rewrites it.)
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": tokenizer.eos_token_id, "do_sample": True}, indent=2)
    )
    if source is not None:
        for name in _LICENCE_FILES:
            if (source / name).exists():
                shutil.copyfile(source / name, out / name)


def _build_key(args: dict[str, Any], source: Path | None) -> str:
    """A digest of everything a build depends on (the module docstring lists it)."""
    import torch
    import transformers

    digest = hashlib.sha256(json.dumps(args, sort_keys=True).encode())
    digest.update(f"torch {torch.__version__} transformers {transformers.__version__}".encode())
    files = sorted(Path(__file__).parent.glob("*.py")) + [Path(m.__file__) for m in _ADAPTERS]
    if source is not None:
        files += sorted(f for f in source.iterdir() if f.is_file())
    for file in files:
        digest.update(file.name.encode() + b"\0" + file.read_bytes())
    installed = [f"{h} {_CLIS[h].CLI_VERSION}" for h in args["harnesses"] if _CLIS[h].CLI.exists()]
    if args["teach"] and installed:  # their captures are taught: the CLIs, the day they run on
        digest.update(f"{installed} {date.today().isoformat()}".encode())
    return digest.hexdigest()[:24]


def cache_root() -> Path:
    """`$MOLT_PROXY_CACHE`, else `~/.cache/molt-proxy`."""
    return Path(os.environ.get("MOLT_PROXY_CACHE") or Path.home() / ".cache" / "molt-proxy")


def _cached(out: Path, key: str, build: Callable[[Path], None]) -> Path:
    """`out` filled with the build cached under `key`, built first where it is not cached.
    A build lands in the cache by one rename, so a build that dies half-way leaves nothing
    behind and two that race both finish with the same bytes."""
    cached = cache_root() / "tiny-models" / key
    if not cached.is_dir():
        cached.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f"{key}.", dir=cached.parent))
        build(staging)
        try:
            staging.rename(cached)
        except OSError:  # another build of the same key landed first
            shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(cached, out, dirs_exist_ok=True)
    return out
