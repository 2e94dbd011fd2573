"""Sampled ids → an OpenAI assistant message, with vLLM's own parsers.

The names are those of `vllm serve --tool-call-parser / --reasoning-parser`, and the parsers
are vLLM's classes, constructed per request exactly as vLLM's chat route does (the reasoning
parser sees the request's `chat_template_kwargs`, e.g. Qwen3's `enable_thinking`). They read
vLLM's own request, whatever the wire format: the conversation's `parser_request`.

One deliberate difference from vLLM: a tool call's `arguments` is the exact JSON text the
model sampled where we can find it, not vLLM's re-serialisation. An agent that echoes the
reply then re-renders to the very same bytes and the segment continues (DESIGN §2).
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Sequence
from typing import Any

import jiter
from vllm.entrypoints.generate.base.protocol import DeltaMessage
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.parser import ParserManager
from vllm.parser.abstract_parser import Parser
from vllm.reasoning import ReasoningParser, ReasoningParserManager
from vllm.tool_parsers import ToolParser, ToolParserManager
from vllm.tool_parsers.tool_strict_level import ToolStrictLevelName

from molt_proxy.constraints import structured_outputs
from molt_proxy.tokenizer import Tokenizer
from molt_proxy.types import ParsedReply

_decoder = json.JSONDecoder()


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


def arguments_object(arguments: Any) -> dict[str, Any]:
    """The object a call's `arguments` stand for (Anthropic's `tool_use.input`): the JSON text
    parsed, or for a call cut off by `max_tokens`, its complete part, read as the `anthropic`
    SDK reads the streamed `input_json_delta` pieces (jiter's partial mode), so a whole and a
    streamed reply show the same object; {} where there is none."""
    if isinstance(arguments, dict):
        return arguments
    if not isinstance(arguments, str) or not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        try:
            value = jiter.from_json(arguments.encode(), partial_mode=True)
        except ValueError:
            return {}
    return value if isinstance(value, dict) else {}


class ReplyParser:
    """Builds the assistant message for one completion."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        tool_parser: str | None,
        reasoning_parser: str | None,
        tool_strict_level: ToolStrictLevelName = "auto",
    ):
        self.tokenizer = tokenizer
        self._tool_parser_name = tool_parser
        self._tool_cls: type[ToolParser] | None = (
            ToolParserManager.get_tool_parser(tool_parser) if tool_parser else None
        )
        self._reasoning_cls: type[ReasoningParser] | None = (
            ReasoningParserManager.get_reasoning_parser(reasoning_parser) if reasoning_parser else None
        )
        self.stop_ids = {tokenizer.eos_token_id, *tokenizer.generation_eos_ids}
        # The streaming path uses vLLM's combined parser, with and without the tool half.
        # `tool_strict_level` is `vllm serve --tool-strict-level`: the combined parser derives
        # the structural tags of tool calls at that level, as vLLM's chat route does.
        self._stream_cls = ParserManager.get_parser(
            tool_parser, reasoning_parser, enable_auto_tools=True, tool_strict_level=tool_strict_level
        )
        self._stream_cls_no_tools = ParserManager.get_parser(None, reasoning_parser)

    def parse(
        self,
        sampled_ids: list[int],
        finish_reason: str,
        request: ChatCompletionRequest,
        prompt_ids: Sequence[int],
    ) -> ParsedReply:
        """The reply message. `finish_reason` (vLLM's) says whether a trailing stop id ends it."""
        ids = sampled_ids
        if self.ends_with_stop_id(ids, finish_reason, request):
            ids = ids[:-1]
        tool_parser = self._tool_parser(request)
        text = self.tokenizer.decode(ids, skip_special_tokens=self._skip_special(request))
        text = _cut_at_stop_string(text, request.stop, request.include_stop_str_in_output)
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
            elif finish_reason == "length":
                return self._as_streamed(sampled_ids, finish_reason, request, prompt_ids) or reply
        return reply

    def _as_streamed(
        self, ids: list[int], finish_reason: str, request: ChatCompletionRequest, prompt_ids: Sequence[int]
    ) -> ParsedReply | None:
        """The reply a stream of `ids` adds up to, if it holds calls. `max_tokens` can cut a call
        off: the whole-reply parser then finds none (its JSON is incomplete) while the
        streaming parser has already sent the call out; the whole reply is what the streamed
        one would be, so the two agree (and an echo of either is restored alike, `echo.py`)."""
        stream = self.stream(request, prompt_ids)
        for token_id in ids:  # one id at a time, as vLLM streams them
            stream.feed([token_id])
        stream.finish(finish_reason)
        return stream.reply if stream.reply.tool_calls else None

    def structured_outputs(self, request: ChatCompletionRequest) -> dict[str, Any] | None:
        """The vLLM structured outputs the request asks for (`constraints.py`), derived by the
        same combined parser vLLM's chat route would use; None: unconstrained."""
        cls = self._stream_cls if self._tools_enabled(request) else self._stream_cls_no_tools
        return structured_outputs(
            request, cls, self._tool_parser_name, self.tokenizer.hf, self.tokenizer.json_separators
        )

    def ends_with_stop_id(self, ids: list[int], finish_reason: str, request: ChatCompletionRequest) -> bool:
        """Whether the turn ended on a stop id (the model's end of turn, or one of the request's
        `stop_token_ids`), which the reply leaves out."""
        stop_ids = self.stop_ids | set(request.stop_token_ids or [])
        return finish_reason == "stop" and bool(ids) and ids[-1] in stop_ids

    def _tools_enabled(self, request: ChatCompletionRequest) -> bool:
        return self._tool_cls is not None and bool(request.tools) and request.tool_choice != "none"

    def _tool_parser(self, request: ChatCompletionRequest) -> ToolParser | None:
        if self._tool_cls is None or not self._tools_enabled(request):
            return None
        return self._tool_cls(self.tokenizer.hf, request.tools)

    def _skip_special(self, request: ChatCompletionRequest) -> bool:
        """Parsers need special tokens (`<tool_call>`, `</think>`) in the text they read."""
        return (
            request.skip_special_tokens and not self._tools_enabled(request) and self._reasoning_cls is None
        )

    def stream(self, request: ChatCompletionRequest, prompt_ids: Sequence[int]) -> ReplyStream:
        cls = self._stream_cls if self._tools_enabled(request) else self._stream_cls_no_tools
        parser = (
            cls(self.tokenizer.hf, request.tools, chat_template_kwargs=request.chat_template_kwargs or {})
            if cls is not None
            else None
        )
        stop_ids = self.stop_ids | set(request.stop_token_ids or [])
        return ReplyStream(self.tokenizer, parser, request, prompt_ids, stop_ids, self._skip_special(request))


class ReplyStream:
    """Sampled ids → OpenAI deltas as they arrive, with vLLM's streaming parsers.

    The text is what `ReplyParser.parse` reads, built incrementally from the exact bytes of
    each id. Two things are held back until the next ids show they belong to the reply: a
    trailing stop id (the model's end-of-turn is not content) and the tail that could still
    grow into a stop string.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        parser: Parser | None,
        request: ChatCompletionRequest,
        prompt_ids: Sequence[int],
        stop_ids: set[int],
        skip_special: bool,
    ):
        self.tokenizer, self.parser, self.request, self.prompt_ids = tokenizer, parser, request, prompt_ids
        self.stop_ids, self.skip_special = stop_ids, skip_special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        stop = request.stop or []
        self._stop_strings = [stop] if isinstance(stop, str) else list(stop)
        self._held_id: int | None = None
        self._text = ""
        """Decoded text not yet handed to the parser."""
        self._stopped = False
        self.reply = ParsedReply(content=None)
        """Every delta so far, accumulated as the agent's client accumulates them."""

    def feed(self, ids: list[int]) -> DeltaMessage | None:
        if self._held_id is not None:
            ids = [self._held_id, *ids]
            self._held_id = None
        if ids and ids[-1] in self.stop_ids:  # held back without touching the caller's list
            self._held_id, ids = ids[-1], ids[:-1]
        return self._advance(ids, finished=False)

    def finish(self, finish_reason: str) -> DeltaMessage | None:
        ids = [] if self._held_id is None or finish_reason == "stop" else [self._held_id]
        return self._advance(ids, finished=True)

    def _advance(self, ids: list[int], *, finished: bool) -> DeltaMessage | None:
        if self.skip_special:
            ids = [i for i in ids if i not in self.tokenizer.special_ids]
        if not self._stopped:
            self._text += self._decoder.decode(self.tokenizer.ids_bytes(ids), final=finished)
        delta_text = self._release(finished)
        if not delta_text and not finished:
            return None
        if self.parser is None:
            delta = DeltaMessage(content=delta_text) if delta_text else None
        else:
            delta = self.parser.parse_delta(
                delta_text, ids, self.request, prompt_token_ids=self.prompt_ids, finished=finished
            )
        if delta is not None:
            self._accumulate(delta)
        return delta

    def _release(self, finished: bool) -> str:
        """The text that can go out now: up to a stop string, minus a tail that may start one."""
        if self._stopped:
            return ""
        found = [(i, s) for s in self._stop_strings if (i := self._text.find(s)) != -1]
        if found:
            cut, stop = min(found)
            self._stopped = True
            end = cut + len(stop) if self.request.include_stop_str_in_output else cut
            out, self._text = self._text[:end], ""
            return out
        keep = 0 if finished else max((len(s) - 1 for s in self._stop_strings), default=0)
        out_len = max(len(self._text) - keep, 0)
        out, self._text = self._text[:out_len], self._text[out_len:]
        return out

    def _accumulate(self, delta: DeltaMessage) -> None:
        reply = self.reply
        if delta.content:
            reply.content = (reply.content or "") + delta.content
        if delta.reasoning:
            reply.reasoning_content = (reply.reasoning_content or "") + delta.reasoning
        for call in delta.tool_calls:
            while len(reply.tool_calls) <= call.index:
                reply.tool_calls.append(
                    {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
                )
            slot = reply.tool_calls[call.index]
            slot["id"] = call.id or slot["id"]
            if call.function is not None:
                slot["function"]["name"] += call.function.name or ""
                slot["function"]["arguments"] += call.function.arguments or ""


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


def _cut_at_stop_string(text: str, stop: str | list[str] | None, include: bool) -> str:
    """vLLM ends generation at a stop string but the ids keep the whole token holding it; the
    reply ends before the stop string, or just after it with `include_stop_str_in_output`."""
    if not stop:
        return text
    for s in [stop] if isinstance(stop, str) else stop:
        index = text.find(s)
        if index != -1:
            text = text[: index + len(s) if include else index]
    return text
