"""Constrained decoding: the vLLM structured outputs a request asks for, as vLLM derives them.

`tool_choice` `required` or named, `parallel_tool_calls: false` with tools, `response_format`
`json_object` / `json_schema` and vLLM's own `structured_outputs` field are enforced by vLLM's
structured outputs (a grammar mask over the vocabulary at each sampled token). The request
is turned into `StructuredOutputsParams` by vLLM's own code, the `adjust_request` of the
combined tool and reasoning parser that vLLM's chat route runs, and sent on the generate
route's `sampling_params`; a turn sampled under one is recorded `constrained`.

Forced tool calls are constrained to the template's own tool-call markup (the tool parser's
structural tag, e.g. Hermes' `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`),
never to vLLM's alternative JSON-list form: the sampled bytes are then what the chat template
renders when the agent echoes the call, so the next turn continues the segment, and the
ordinary tool parser reads the call. A tool parser without a structural tag cannot do that,
and such a request is refused rather than sampled in a form the next render rewrites.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.exceptions import VLLMValidationError
from vllm.parser.abstract_parser import Parser

from molt_proxy.errors import BadRequest

_FORCED = ("tool_choice", "tool_choice 'required' or a named function")
_SINGLE = ("parallel_tool_calls", "parallel_tool_calls=false")
"""(param, what the request asked) of the two tool constraints that need a tool parser."""


def _forces_tool_call(request: ChatCompletionRequest) -> bool:
    """`tool_choice` `required` or a named function (vLLM's validator has checked the name)."""
    choice = request.tool_choice
    return bool(request.tools) and (choice == "required" or not isinstance(choice, str | None))


def structured_outputs(
    request: ChatCompletionRequest, parser_cls: type[Parser] | None, tool_parser: str | None, hf: Any
) -> dict[str, Any] | None:
    """The `structured_outputs` of vLLM's `sampling_params` for `request`, or None when it
    asks for no constraint. `parser_cls` is vLLM's combined parser (with the tool parser
    named `tool_parser`, if any); `hf` is the tokenizer it takes. A constraint the proxy
    cannot enforce as asked is a `BadRequest`."""
    forced = _forces_tool_call(request)
    requested = request.extract_structured_outputs()
    if forced and requested is not None:
        param = "response_format" if request.response_format is not None else "structured_outputs"
        raise BadRequest(
            f"{param} cannot be combined with tool_choice 'required' or a named function: "
            "the forced tool call is the reply's format",
            param=param,
        )
    single = request.parallel_tool_calls is False and bool(request.tools) and request.tool_choice != "none"
    if (forced or single) and tool_parser is None:
        param, what = _FORCED if forced else _SINGLE
        raise BadRequest(
            f"{what} needs the proxy to run with --tool-call-parser, which says what a tool call looks like",
            param=param,
        )
    # Only a tool parser adjusts structured outputs, and only for a request with tools: a request
    # without any skips building a parser (the common case, on every turn).
    adjust = parser_cls is not None and bool(request.tools)
    params = _adjusted(request, parser_cls, hf).extract_structured_outputs() if adjust else requested
    # forced calls must be in the template's markup; one call at most needs any constraint
    if (forced and (params is None or params.structural_tag is None)) or (single and params is None):
        param, what = _FORCED if forced else _SINGLE
        raise BadRequest(
            f"{what} needs a tool parser whose call markup vLLM can constrain (a structural tag); "
            f"{tool_parser!r} has none",
            param=param,
        )
    if params is None:
        return None
    return {
        f.name: getattr(params, f.name)
        for f in fields(params)
        if not f.name.startswith("_") and getattr(params, f.name) not in (None, False)
    }


def _adjusted(request: ChatCompletionRequest, parser_cls: type[Parser], hf: Any) -> ChatCompletionRequest:
    """What vLLM's chat route does to a request before sampling (`Parser.adjust_request`:
    structural tags for tool calls), on a copy: the reply parsers read the request as sent.
    A shallow copy is enough (and a long history is not copied): `adjust_request` sets fields,
    it does not change the values they held."""
    parser = parser_cls(hf, request.tools, chat_template_kwargs=request.chat_template_kwargs or {})
    try:
        return parser.adjust_request(request.model_copy())
    except VLLMValidationError as exc:
        message = str(exc.args[0]) if exc.args else "invalid tool constraint"
        raise BadRequest(message[:300], param=exc.parameter or "tool_choice") from None
