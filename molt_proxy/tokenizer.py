"""The model's text side: chat template rendering, tokenizing, and exact token bytes.

Stitching compares the bytes a segment's ids decode to with the bytes of a new render, so
this module gives each id its exact bytes (byte-level BPE maps every id to a fixed byte
string, special tokens to their literal text). That is incremental: a turn costs only its
new ids, never a decode of the whole history.
"""

from __future__ import annotations

import json
import logging
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from jinja2 import TemplateError
from tokenizers.normalizers import NFC
from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase
from transformers.convert_slow_tokenizer import bytes_to_unicode

from molt_proxy.errors import BadRequest

log = logging.getLogger(__name__)

_PROBE_ARGUMENTS = '{"probe":1}'
_PROBE_OBJECT = {"probe": [1, 2]}
_SEPARATORS = ((", ", ": "), (",", ":"), (",", ": "), (", ", ":"))
"""(item, key) separators a template's `tojson` may print, Python's `json.dumps` default first."""
_PROBE_CONTENT = "probe-content"


@dataclass(slots=True, frozen=True)
class Closing:
    """How the chat template closes an assistant message: `end`, the special token a sampled
    stop id stands for (Qwen3's `<|im_end|>`, Llama-3.2's `<|eot_id|>`; empty if the closing
    starts with none), then `after`, what the template writes past it (Qwen3's `\\n`)."""

    end: str
    after: str


class Tokenizer:
    """A Hugging Face tokenizer with the model's chat template."""

    def __init__(self, hf: PreTrainedTokenizerBase, generation_eos_ids: frozenset[int] = frozenset()):
        if not hf.chat_template:
            raise ValueError("the tokenizer has no chat template")
        self.hf = hf
        self.generation_eos_ids = generation_eos_ids
        """Extra stop ids from the model's generation config (Llama-3 ends turns with several)."""
        self._byte_decoder = {ch: b for b, ch in bytes_to_unicode().items()}
        self._added = {tok.content for tok in hf.added_tokens_decoder.values()}
        self._cache: dict[int, bytes] = {}
        self.special_ids = frozenset(hf.all_special_ids)

    @classmethod
    def load(cls, path: str) -> Tokenizer:
        try:
            eos = GenerationConfig.from_pretrained(path).eos_token_id
        except OSError:
            eos = None
        ids = frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])
        return cls(AutoTokenizer.from_pretrained(path), ids)

    @property
    def added_tokens(self) -> frozenset[str]:
        """The text of every token added to the vocabulary (special tokens, Qwen3's `<think>`)."""
        return frozenset(self._added)

    @property
    def eos_token_id(self) -> int:
        return self.hf.eos_token_id

    @cached_property
    def _template_takes_string_arguments(self) -> bool:
        """Whether the template prints a tool call's `arguments` string verbatim.

        vLLM turns `arguments` into a dict before rendering, so a template re-serialises it
        (`tojson`) and `{"x":1}` as sampled comes back as `{"x": 1}`. Templates that print a
        string as is (Qwen3's) take the exact sampled text, so we keep the string there and
        an echo renders the sampled bytes; others (Llama-3.2's `| tojson`) get the dict, as in
        vLLM, and an echo continues through the reply's echo view (`echo.py`).
        """
        call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": _PROBE_ARGUMENTS}}
        messages = [
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c", "content": "r"},
        ]
        try:
            text = self.hf.apply_chat_template(messages, tokenize=False)
        except Exception as exc:  # a template that cannot render tool calls at all: no string to keep
            log.warning(
                "the chat template does not render a probe tool call (%s); tool arguments are "
                "passed to it as dicts",
                type(exc).__name__,
            )
            return False
        return _PROBE_ARGUMENTS in text

    @cached_property
    def json_separators(self) -> tuple[str, str]:
        """The (item, key) separators the template prints a tool call's dict arguments with
        (transformers' `tojson` is `json.dumps`: `", "` and `": "` unless the template asks
        otherwise). Grammars for JSON output use them (`constraints.py`), so what the model
        samples is what the template prints when an agent echoes the call as an object."""
        call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": _PROBE_OBJECT}}
        messages = [
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
        ]
        try:
            text = self.hf.apply_chat_template(messages, tokenize=False)
        except Exception:  # a template that cannot render a tool call: JSON's own default
            return _SEPARATORS[0]
        found = [s for s in _SEPARATORS if json.dumps(_PROBE_OBJECT, separators=s) in text]
        return found[0] if found else _SEPARATORS[0]

    @cached_property
    def closing(self) -> Closing | None:
        """The template's closing of an assistant message (None: it does not render one)."""
        messages = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _PROBE_CONTENT}]
        try:
            text = self.hf.apply_chat_template(messages, tokenize=False)
        except Exception:  # a template that cannot end on an assistant message
            return None
        if _PROBE_CONTENT not in text:
            return None
        tail = text[text.rindex(_PROBE_CONTENT) + len(_PROBE_CONTENT) :]
        end = max((token for token in self._added if tail.startswith(token)), key=len, default="")
        return Closing(end, tail[len(end) :]) if tail else None

    def _prepare(self, message: dict[str, Any]) -> dict[str, Any]:
        calls = message.get("tool_calls")
        if not calls:
            # `tool_calls: null` or `[]` (as some agents send) crash templates that test
            # `is defined` (Llama-3.2's); vLLM drops the key too.
            return (
                {k: v for k, v in message.items() if k != "tool_calls"}
                if "tool_calls" in message
                else message
            )
        prepared = []
        for call in calls:
            function = dict(call.get("function") or {})
            arguments = function.get("arguments")
            if isinstance(arguments, str) and not self._template_takes_string_arguments:
                try:
                    arguments = json.loads(arguments) if arguments else {}
                except json.JSONDecodeError:
                    raise BadRequest(
                        f"tool call arguments are not valid JSON: {arguments[:80]!r}",
                        param="messages",
                    ) from None
            function["arguments"] = arguments
            prepared.append({**call, "function": function})
        return {**message, "tool_calls": prepared}

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        template_kwargs: dict[str, Any],
        *,
        add_generation_prompt: bool = True,
    ) -> str:
        """The full prompt text `F` for a request, generation prompt included (without it: a
        history, as `echo.echo_view` renders one)."""
        try:
            return self.hf.apply_chat_template(
                [self._prepare(m) for m in messages],
                tools=tools or None,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **template_kwargs,
            )
        except BadRequest:
            raise
        except TemplateError as exc:  # the template's own raise_exception(), or a syntax error
            message = f"the chat template rejected the messages: {exc}"[:300]
            raise BadRequest(message, param="messages") from exc
        except Exception as exc:  # type errors inside the template: their text may quote the prompt
            raise BadRequest(
                f"the chat template could not render the messages ({type(exc).__name__})", param="messages"
            ) from exc

    def encode(self, text: str) -> list[int]:
        """Ids for rendered text; the template already wrote any special tokens."""
        return self.hf.encode(text, add_special_tokens=False)

    @cached_property
    def max_token_bytes(self) -> int:
        """The most bytes any one id stands for (128 for Qwen3). A piece that is not byte-level
        (sentencepiece's `▁x`, a byte fallback `<0x0A>`) stands for at most its own UTF-8."""
        most = 0
        for piece in self.hf.get_vocab():
            byte_level = piece not in self._added and all(ch in self._byte_decoder for ch in piece)
            most = max(most, len(piece) if byte_level else len(piece.encode()))  # 1 byte per char
        return most

    def min_tokens(self, text: str) -> int:
        """A lower bound on `len(self.encode(text))`, without tokenizing: each id covers at
        most `max_token_bytes` bytes of the text the model reads. That text is `text` itself
        unless a normalizer rewrites it; NFC (Qwen3's) leaves NFC text alone, any other
        normalizer could shrink it, so then there is no bound (0)."""
        normalizer = self.hf.backend_tokenizer.normalizer if self.hf.is_fast else None
        if normalizer is not None and not (
            isinstance(normalizer, NFC) and unicodedata.is_normalized("NFC", text)
        ):
            return 0
        return -(-len(text.encode()) // self.max_token_bytes)

    def token_bytes(self, token_id: int) -> bytes:
        cached = self._cache.get(token_id)
        if cached is not None:
            return cached
        piece = self.hf.convert_ids_to_tokens(token_id)
        if piece in self._added:
            raw = piece.encode()
        elif all(ch in self._byte_decoder for ch in piece):
            raw = bytes(self._byte_decoder[ch] for ch in piece)
        else:  # not byte-level (e.g. sentencepiece): fall back to the decoder
            raw = self.hf.decode([token_id]).encode()
        self._cache[token_id] = raw
        return raw

    def ids_bytes(self, ids: Sequence[int]) -> bytes:
        """The bytes of `ids`, read off the cache in C where every id is in it (a turn's ids
        mostly are: 3-5x faster than a call per id); else id by id, filling it."""
        try:
            return b"".join(map(self._cache.__getitem__, ids))
        except KeyError:
            return b"".join(self.token_bytes(i) for i in ids)

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        """The exact text of `ids`: no clean-up of spaces (Llama-3.2's tokenizer asks for it),
        so the reply re-renders to the bytes the model sampled."""
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
        return self.ids_bytes(ids).decode(errors="replace")
