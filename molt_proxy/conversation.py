"""The request side of a turn, in no wire format: what a wire module decodes a request into.

A wire module (`wire/openai.py`, `wire/anthropic.py`, `wire/responses.py`) validates its format
at the edge and builds one `Conversation`; the turn (`completions.py`) reads only this. What
stays with the wire format (streaming, usage chunks, reply shapes) stays in the wire module's
own decoded call. What every format builds alike is here: vLLM's request, which vLLM's parsers
read (`chat_request`), checked (`check_sampling`) and read for the sampling fields
(`sampling_fields`), and the tool-call ids a history echoes (`echoed_call_ids`).

It lives here, not in `types.py`, because it names vLLM's request type for the parsers:
`types.py` is the record contract the trainer imports, and it imports nothing from vLLM.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pydantic
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.exceptions import VLLMValidationError

from molt_proxy.errors import BadRequest


@dataclass(slots=True, frozen=True)
class Conversation:
    """One decoded request: what the chat template renders, how to sample, what vLLM's
    parsers read, and the hints that find its session."""

    messages: list[dict[str, Any]]
    """The history as the chat template takes it (role, content, tool_calls, tool_call_id,
    reasoning_content), exactly as the agent sent it, with text-only content."""
    tools: list[dict[str, Any]] | None
    """Tool definitions as the chat template takes them."""
    template_kwargs: dict[str, Any]
    """Extra chat-template variables (e.g. Qwen3's `enable_thinking`)."""
    sampling: dict[str, Any]
    """Every vLLM sampling field but `max_tokens`, explicitly (DESIGN §4), before the proxy's
    pins (`sampling.effective_sampling`). The turn adds `max_tokens`: it needs the prompt."""
    max_tokens: int | None
    """The completion tokens the request asks for at most; None: whatever the context leaves."""
    parser_request: ChatCompletionRequest
    """vLLM's request, for vLLM's tool and reasoning parsers, which take nothing else: they
    read its tools, tool choice, template kwargs, stop conditions, `skip_special_tokens`,
    `include_reasoning` and (Kimi's call ids) its history. A wire module that is not OpenAI's
    builds one, as vLLM's own Anthropic route does."""
    session_id: str | None
    """The session the request names in its body (OpenAI's `metadata.session_id`), if any."""
    call_ids: frozenset[str]
    """The tool-call ids the history echoes; they tell which session a request continues."""
    fit_max_tokens: bool = False
    """A `max_tokens` over the context the prompt leaves is lowered to it, not refused (the
    Anthropic route: Claude Code asks 32,000 of any model, written for 200k-token contexts)."""
    top_logprobs: int | None = None
    """The reply is to show its tokens' logprobs, with this many most likely alternatives per
    token (0: none); None: no logprobs."""


def echoed_call_ids(messages: list[dict[str, Any]]) -> frozenset[str]:
    """The tool-call ids template-shaped messages mention (assistant calls and tool results)."""
    ids = {m["tool_call_id"] for m in messages if isinstance(m.get("tool_call_id"), str)}
    for message in messages:
        for tool_call in message.get("tool_calls") or []:
            if isinstance(tool_call, dict) and isinstance(tool_call.get("id"), str):
                ids.add(tool_call["id"])
    return frozenset(ids)


def with_string_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """A copy for vLLM's model, which takes a call's arguments as a JSON string (as its own
    Anthropic route writes them), of a message whose calls hold them as objects (Anthropic's
    `tool_use.input`, Gemini's `functionCall.args`)."""
    calls = message.get("tool_calls")
    if not calls:
        return dict(message)
    calls = [
        {**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
        for c in calls
    ]
    return {**message, "tool_calls": calls}


def chat_request(data: dict[str, Any], names: Mapping[str, str] | None = None) -> ChatCompletionRequest:
    """vLLM's own model. Its cross-field checks (`tool_choice` without `tools`, `top_logprobs`
    without `logprobs`, ...) raise `VLLMValidationError`, which pydantic does not wrap, and a
    few raise ValueError or TypeError: all are the request's fault. The message names the
    field, never its value (a value may be a whole prompt); `names` maps a chat field to what
    another wire format calls it (Responses' `max_output_tokens`)."""
    try:
        return ChatCompletionRequest.model_validate(data)
    except pydantic.ValidationError as exc:
        error = exc.errors()[0]
        where = [str(part) for part in error["loc"]]
        param = (names or {}).get(where[0] if where else "") or ".".join(where) or None
        raise BadRequest(f"invalid value for '{param}': {error['msg'][:300]}", param=param) from None
    except VLLMValidationError as exc:
        message = str(exc.args[0]) if exc.args else "invalid request"
        raise BadRequest(message[:300], param=exc.parameter) from None
    except (ValueError, TypeError) as exc:
        raise BadRequest(f"invalid request: {type(exc).__name__}") from None


def check_sampling(request: ChatCompletionRequest) -> None:
    """Sampling values in the ranges vLLM's `SamplingParams._verify_args` accepts, checked at
    the edge so a bad one is a 400 with `param` set here rather than an upstream error (or a
    silent default) later. `seed` is bounded to int64 by `ChatCompletionRequest` itself."""
    for name, value in (
        ("max_tokens", _max_tokens(request)),
        ("max_completion_tokens", request.max_completion_tokens),
    ):
        if value is not None and value < 1:
            raise BadRequest(f"'{name}' must be at least 1, got {value}", param=name)
    _in_range(request.temperature, "temperature", 0.0, 2.0)
    if request.top_p is not None and not 0.0 < request.top_p <= 1.0:
        raise BadRequest(f"'top_p' must be in (0, 1], got {request.top_p}", param="top_p")
    if request.top_k is not None and request.top_k < -1:
        raise BadRequest(f"'top_k' must be -1 or 0 (off) or at least 1, got {request.top_k}", param="top_k")
    _in_range(request.min_p, "min_p", 0.0, 1.0)
    _in_range(request.presence_penalty, "presence_penalty", -2.0, 2.0)
    _in_range(request.frequency_penalty, "frequency_penalty", -2.0, 2.0)
    penalty = request.repetition_penalty
    if penalty is not None and not (math.isfinite(penalty) and penalty > 0.0):
        raise BadRequest(f"'repetition_penalty' must be above 0, got {penalty}", param="repetition_penalty")
    max_tokens = requested_max_tokens(request)
    if request.min_tokens < 0 or (max_tokens is not None and request.min_tokens > max_tokens):
        raise BadRequest(
            f"'min_tokens' must be in [0, max_tokens], got {request.min_tokens}", param="min_tokens"
        )
    stop = [request.stop] if isinstance(request.stop, str) else request.stop or []
    if any(not s for s in stop):
        raise BadRequest("'stop' cannot contain an empty string", param="stop")


def _in_range(value: float | None, name: str, low: float, high: float) -> None:
    if value is not None and not (math.isfinite(value) and low <= value <= high):
        raise BadRequest(f"'{name}' must be in [{low:g}, {high:g}], got {value}", param=name)


def sampling_fields(request: ChatCompletionRequest) -> dict[str, Any]:
    """Every sampling field but `max_tokens` (the turn's), explicitly (DESIGN §4): an omitted
    field would fall back to the checkpoint's generation config (e.g. `top_k=20`), not to the
    OpenAI default. The proxy's pins and vLLM's normalisation are applied in the turn
    (`molt_proxy.sampling.effective_sampling`)."""
    fields: dict[str, Any] = {
        "n": 1,
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "top_p": 1.0 if request.top_p is None else request.top_p,
        "top_k": request.top_k or 0,
        "min_p": request.min_p or 0.0,
        "presence_penalty": request.presence_penalty or 0.0,
        "frequency_penalty": request.frequency_penalty or 0.0,
        "repetition_penalty": request.repetition_penalty or 1.0,
        "seed": request.seed,
        "stop": request.stop or [],
        "stop_token_ids": request.stop_token_ids or [],
        "include_stop_str_in_output": request.include_stop_str_in_output,
        "ignore_eos": request.ignore_eos,
        "min_tokens": request.min_tokens,
        "logprobs": request.top_logprobs or 0,
        "logit_bias": request.logit_bias,
        # ids are the product; text is only needed to match stop strings.
        "detokenize": bool(request.stop),
    }
    return fields


def requested_max_tokens(request: ChatCompletionRequest) -> int | None:
    return request.max_completion_tokens or _max_tokens(request)


def _max_tokens(request: ChatCompletionRequest) -> int | None:
    """`request.max_tokens`, the value pydantic validated, read without the DeprecationWarning
    that vLLM's field raises on every read (3.7 µs each, three a request): clients still send
    `max_tokens`, and vLLM reads it as the proxy does."""
    value: int | None = request.__dict__["max_tokens"]
    return value
