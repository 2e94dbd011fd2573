"""OpenAI's `logprobs` / `top_logprobs` on the wire: the request fields checked, and a reply's
token logprobs (`types.TokenLogprobs`) in OpenAI's shape.

The logprobs are vLLM's own for the sampled ids, the very floats the trajectory records: the
processed distribution, after the turn's temperature and truncation (`Sampling`), not the
model's raw one. `content` lists every sampled token in order, the reasoning, tool-call markup
and end-of-turn token included, as vLLM's own OpenAI server does: the same N tokens as
`usage.completion_tokens` and the recorded turn, whatever the parsers made of them.

A token is named by its exact bytes: `bytes` are the bytes the id stands for (joined in order,
the bytes the model sampled), and `token` is their text, where a token that holds only part of
a character shows the bytes it holds as `\\xNN` escapes, as OpenAI's API does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from molt_proxy.errors import BadRequest
from molt_proxy.types import TokenLogprobs

MAX_TOP_LOGPROBS = 20
"""OpenAI's bound on `top_logprobs`."""

TokenBytes = Callable[[int], bytes]
"""The exact bytes a token id stands for (`Tokenizer.token_bytes`)."""


def requested_logprobs(data: dict[str, Any]) -> int | None:
    """How many top alternatives per token the request asks to see (0: the sampled tokens'
    logprobs only), or None when it asks for no logprobs. Checked before vLLM's model, which
    would coerce `"true"` to true and accept `top_logprobs` -1 (the whole vocabulary) or 500."""
    logprobs, top = data.get("logprobs"), data.get("top_logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise BadRequest("'logprobs' must be a boolean", param="logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int)):
        raise BadRequest("'top_logprobs' must be an integer", param="top_logprobs")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise BadRequest(
            f"'top_logprobs' must be in [0, {MAX_TOP_LOGPROBS}], got {top}", param="top_logprobs"
        )
    if top and not logprobs:
        raise BadRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    for name in ("prompt_logprobs", "logprob_token_ids"):  # vLLM's own, which the proxy does not serve
        if data.get(name):
            raise BadRequest(f"'{name}' is not supported; use 'logprobs' and 'top_logprobs'", param=name)
    return (top or 0) if logprobs else None


def encode_logprobs(entries: list[TokenLogprobs] | None, token_bytes: TokenBytes) -> dict[str, Any] | None:
    """A choice's `logprobs`: `content` for `entries` (a whole reply's, or one chunk's); None
    (JSON null, as when none are asked for) for None."""
    if entries is None:
        return None
    return {"content": [_content(entry, token_bytes) for entry in entries], "refusal": None}


def _content(entry: TokenLogprobs, token_bytes: TokenBytes) -> dict[str, Any]:
    return {
        **_token(entry.token_id, entry.logprob, token_bytes),
        "top_logprobs": [_token(token_id, logprob, token_bytes) for token_id, logprob in entry.top],
    }


def _token(token_id: int, logprob: float, token_bytes: TokenBytes) -> dict[str, Any]:
    raw = token_bytes(token_id)
    return {"token": raw.decode("utf-8", errors="backslashreplace"), "logprob": logprob, "bytes": list(raw)}
