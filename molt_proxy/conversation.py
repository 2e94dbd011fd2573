"""The request side of a turn, in no wire format: what a wire module decodes a request into.

A wire module (`wire/openai.py`, and later Anthropic Messages and the Responses API) validates
its format at the edge and builds one `Conversation`; the turn (`completions.py`) reads only
this. What stays with the wire format (streaming, usage chunks, reply shapes) stays in the
wire module's own decoded call.

It lives here, not in `types.py`, because it names vLLM's request type for the parsers:
`types.py` is the record contract the trainer imports, and it imports nothing from vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest


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
