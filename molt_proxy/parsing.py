"""Sampled ids → an OpenAI assistant message, with vLLM's own parsers.

The names are those of `vllm serve --tool-call-parser / --reasoning-parser`, and the parsers
are vLLM's classes, constructed per request exactly as vLLM's chat route does (the reasoning
parser sees the request's `chat_template_kwargs`, e.g. Qwen3's `enable_thinking`).

One deliberate difference from vLLM: a tool call's `arguments` is the exact JSON text the
model sampled where we can find it, not vLLM's re-serialisation. An agent that echoes the
reply then re-renders to the very same bytes and the segment continues (DESIGN §2).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.reasoning import ReasoningParser, ReasoningParserManager
from vllm.tool_parsers import ToolParser, ToolParserManager

from molt_proxy.tokenizer import Tokenizer

_decoder = json.JSONDecoder()


@dataclass(slots=True)
class ParsedReply:
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def sampled_json_text(text: str, value: Any, start: int = 0) -> tuple[str, int] | None:
    """The first substring of `text` at or after `start` that parses to the JSON `value`.

    Returns it with the index just past it, so consecutive calls find consecutive calls.
    """
    index = text.find("{", start)
    while index != -1:
        try:
            parsed, end = _decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            parsed, end = None, index + 1
        if parsed == value and isinstance(parsed, dict):
            return text[index:end], end
        index = text.find("{", index + 1)
    return None


class ReplyParser:
    """Builds the assistant message for one completion."""

    def __init__(self, tokenizer: Tokenizer, tool_parser: str | None, reasoning_parser: str | None):
        self.tokenizer = tokenizer
        self._tool_cls: type[ToolParser] | None = (
            ToolParserManager.get_tool_parser(tool_parser) if tool_parser else None
        )
        self._reasoning_cls: type[ReasoningParser] | None = (
            ReasoningParserManager.get_reasoning_parser(reasoning_parser) if reasoning_parser else None
        )
        self.stop_ids = {tokenizer.eos_token_id, *tokenizer.generation_eos_ids}

    def parse(
        self,
        sampled_ids: list[int],
        finish_reason: str,
        request: ChatCompletionRequest,
        prompt_ids: list[int],
    ) -> tuple[ParsedReply, str]:
        """The reply message and the OpenAI `finish_reason` for it."""
        ids = sampled_ids
        if finish_reason == "stop" and ids and ids[-1] in self.stop_ids | set(request.stop_token_ids or []):
            ids = ids[:-1]
        tool_parser = self._tool_parser(request)
        skip_special = request.skip_special_tokens and tool_parser is None and self._reasoning_cls is None
        text = self.tokenizer.decode(ids, skip_special_tokens=skip_special)
        text = _cut_at_stop_string(text, request.stop)
        reply = ParsedReply(content=text)
        if self._reasoning_cls is not None:
            parser = self._reasoning_cls(
                self.tokenizer.hf, chat_template_kwargs=request.chat_template_kwargs or {}
            )
            parser.adjust_initial_state_from_prompt(prompt_ids)
            reply.reasoning_content, reply.content = parser.extract_reasoning(text, request)
        if tool_parser is not None and reply.content:
            extracted = tool_parser.extract_tool_calls(reply.content, request)
            if extracted.tools_called:
                reply.tool_calls = _exact_tool_calls(reply.content, extracted.tool_calls)
                reply.content = extracted.content
        if reply.tool_calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return reply, finish_reason

    def _tool_parser(self, request: ChatCompletionRequest) -> ToolParser | None:
        if self._tool_cls is None or not request.tools or request.tool_choice == "none":
            return None
        return self._tool_cls(self.tokenizer.hf, request.tools)


def _exact_tool_calls(text: str, calls: list[Any]) -> list[dict[str, Any]]:
    result = []
    cursor = 0
    for call in calls:
        arguments = call.function.arguments
        found = sampled_json_text(text, json.loads(arguments), cursor) if arguments else None
        if found is not None:
            arguments, cursor = found
        result.append(
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": arguments},
            }
        )
    return result


def _cut_at_stop_string(text: str, stop: str | list[str] | None) -> str:
    """vLLM ends generation at a stop string but the ids keep it; the reply must not."""
    if not stop:
        return text
    for s in [stop] if isinstance(stop, str) else stop:
        index = text.find(s)
        if index != -1:
            text = text[:index]
    return text
