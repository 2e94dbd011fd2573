"""Build tiny, deterministic causal LMs with real tokenizers, for demos and tests.

Nothing can be downloaded on development or CI machines, so the project makes its own
models: a random `Qwen3ForCausalLM` with the real Qwen3 tokenizer and chat template, or a
`LlamaForCausalLM` with the real Llama-3.2 tokenizer, or, where neither tokenizer is at hand,
a small byte-level BPE trained here on a built-in corpus. Same seed, same bytes: building
twice gives identical weights, so tests can compare against a `transformers` forward.

With a real tokenizer the model is then taught its script (`devtools.teaching`,
`devtools.scripts.DEFAULT_SCRIPTS`, and for Qwen3 the episodes captured from the harness CLIs),
so that it writes real tool calls and `<think>` blocks. Where the tokenizers are found:
`devtools.tokenizers`.

Builds are cached under `cache_root()` (`_cached`), each keyed by exactly what its bytes
depend on, so examples and tests that ask for one model and one script share one build:
- a random model: its arguments, the tokenizer's files, this module's source, the versions of
  torch and transformers;
- a taught one: the random model's key, the teaching's source and seed, and the script as the
  teaching shows it, token for token (`teaching.lesson_digest`). Editing a script re-teaches the
  models that learn it; editing a harness adapter or the proxy re-teaches none whose tokens stay;
- a harness CLI's capture (the requests it sends for its episode, `devtools.claude_code`,
  `devtools.codex`): the CLI's version, today's date and the source the capture runs through
  (`_captured`), so a CLI runs once a day for every build of that day, not once per build.
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
from devtools import claude_code, codex, recording, teaching
from devtools.scripts import DEFAULT_SCRIPTS
from devtools.teaching import lesson_digest, teach_tiny_model
from devtools.tokenizers import Arch, tokenizer_source
from devtools.types import Conversation

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


Harness = Literal["claude_code", "codex"]
HARNESSES: tuple[Harness, ...] = ("claude_code", "codex")
_CLIS = {"claude_code": claude_code, "codex": codex}
_CAPTURED_THROUGH = {
    "claude_code": (claude_code, recording, rollout.harnesses.cli, rollout.harnesses.claude_code),
    "codex": (codex, recording, rollout.harnesses.cli, rollout.harnesses.codex),
}
"""The modules a capture runs the CLI through: its environment, config and command line, the
stand-in server and the scripted answers."""


def taught_scripts(arch: Arch, harnesses: Sequence[Harness] = HARNESSES) -> list[Conversation]:
    """What `build_tiny_model(teach=True)` teaches: `DEFAULT_SCRIPTS[arch]`, and for Qwen3 also
    the episodes of the `harnesses` whose CLIs are installed (`devtools.claude_code`,
    `devtools.codex`: captured from the CLIs themselves, so only then). An example that plays
    one harness learns only its episodes."""
    captured = [e for harness in harnesses for e in _episodes(harness)] if arch == "qwen3" else []
    return DEFAULT_SCRIPTS[arch] + captured


def _episodes(harness: Harness) -> list[Conversation]:
    """The harness's episodes, from its capture of today (`_captured`); none where its CLI is
    not installed."""
    cli = _CLIS[harness]
    if not cli.installed():
        return []
    digest = hashlib.sha256(f"{harness} {cli.CLI_VERSION} {date.today().isoformat()}".encode())
    for module in _CAPTURED_THROUGH[harness]:
        digest.update(Path(module.__file__).read_bytes())
    return cli.episodes(
        _captured(cache_root() / "captures" / f"{digest.hexdigest()[:24]}.json", cli.capture_script)
    )


def _captured(path: Path, capture: Callable[[], Any]) -> Any:
    """The JSON at `path`, captured first where it is missing: written by one rename, so a
    capture that dies half-way leaves nothing behind."""
    if not path.exists():
        captured = capture()
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".part", delete=False) as part:
            json.dump(captured, part)
        Path(part.name).replace(path)
    return json.loads(path.read_text())


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
) -> Path:
    """Write a tiny model plus tokenizer to `out_dir` and return the path.

    `tokenizer_dir` names the real tokenizer; by default it is `tokenizer_source(arch)`
    (`$MOLT_PROXY_TOKENIZERS` or the checkout's); with neither, a byte-level BPE is trained
    here. The `lm_head` is untied so that a trainer update moves logits directly.
    With `teach`, a model with a real tokenizer then learns `DEFAULT_SCRIPTS[arch]` (pass
    `teach=False` for a `tokenizer_dir` whose template cannot print that script) and the
    episodes of `harnesses` (`taught_scripts`); the fallback tokenizer's template knows no
    tools or reasoning, so that model stays random.
    """
    # `fallback_tokenizer`: the small self-trained BPE even where a real tokenizer is at hand;
    # RL demos want its ~400-token vocabulary (fast steps, rewards a random model can find).
    source = None if fallback_tokenizer else Path(tokenizer_dir) if tokenizer_dir else tokenizer_source(arch)
    args = dict(
        arch=arch,
        hidden_size=hidden_size,
        num_layers=num_layers,
        seed=seed,
        fallback_vocab_size=fallback_vocab_size,
    )
    key = _random_key(args, source)
    random = built = _cached(key, lambda folder: _build(folder, source, **args))
    if teach and source is not None:
        scripts = taught_scripts(arch, harnesses)
        digest = hashlib.sha256(f"{key} {seed} {lesson_digest(random, scripts)}".encode())
        digest.update(Path(teaching.__file__).read_bytes())
        built = _cached(digest.hexdigest()[:24], lambda folder: _taught(random, folder, scripts, seed))
    out = Path(out_dir)
    shutil.copytree(built, out, dirs_exist_ok=True)
    return out


def _taught(random: Path, out: Path, scripts: list[Conversation], seed: int) -> None:
    """The model at `random`, taught `scripts`, in `out`."""
    shutil.copytree(random, out, dirs_exist_ok=True)
    neutral = (random / "generation_config.json").read_bytes()
    teach_tiny_model(out, scripts, seed=seed)
    (out / "generation_config.json").write_bytes(neutral)  # saving a model rewrites it (`_build`)


def _build(
    out: Path,
    source: Path | None,
    *,
    arch: Arch,
    hidden_size: int,
    num_layers: int,
    seed: int,
    fallback_vocab_size: int,
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
    # vLLM reads the sampling defaults from here; keep them neutral so the proxy's
    # explicit fields are the only source of truth. (Written last: saving a model rewrites it.)
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": tokenizer.eos_token_id, "do_sample": True}, indent=2)
    )
    if source is not None:
        for name in _LICENCE_FILES:
            if (source / name).exists():
                shutil.copyfile(source / name, out / name)


def _random_key(args: dict[str, Any], source: Path | None) -> str:
    """A digest of what a random model's bytes depend on (the module docstring lists it)."""
    import torch
    import transformers

    digest = hashlib.sha256(json.dumps(args, sort_keys=True).encode())
    digest.update(f"torch {torch.__version__} transformers {transformers.__version__}".encode())
    files = [Path(__file__)] + (sorted(f for f in source.iterdir() if f.is_file()) if source else [])
    for file in files:
        digest.update(file.name.encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()[:24]


def cache_root() -> Path:
    """`$MOLT_PROXY_CACHE`, else `~/.cache/molt-proxy`."""
    return Path(os.environ.get("MOLT_PROXY_CACHE") or Path.home() / ".cache" / "molt-proxy")


def _cached(key: str, build: Callable[[Path], None]) -> Path:
    """The cache's folder for `key`, filled by `build` first where it is missing. A build lands
    in the cache by one rename, so a build that dies half-way leaves nothing behind and two that
    race both finish with the same bytes."""
    cached = cache_root() / "tiny-models" / key
    if not cached.is_dir():
        cached.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f"{key}.", dir=cached.parent))
        build(staging)
        try:
            staging.rename(cached)
        except OSError:  # another build of the same key landed first
            shutil.rmtree(staging, ignore_errors=True)
    return cached
