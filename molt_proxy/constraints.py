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

Two things the proxy tightens past vLLM's own derivation, because a weak policy (RL starts from
one) otherwise fills its budget with them:

- Whitespace. vLLM 0.32's JSON grammars admit any whitespace between tokens (its
  `disable_any_whitespace` is a server flag, and picks `,`/`:`), so an untaught model pads
  (`{"zone"\r\n\r\n...` until `max_tokens`). Every JSON schema, in `json`, `json_object` and
  inside a tool call's structural tag, is sent instead as the EBNF grammar xgrammar (vLLM's
  backend) derives from it with no free whitespace and the separators the chat template's
  `tojson` prints (`Tokenizer.json_separators`, `{"a": 1, "b": 2}` for Qwen3): the sampled
  bytes are then what the template renders when the agent echoes them as an object.
- Tool arguments. A tool that is not pinned to its schema (vLLM's `--tool-strict-level`,
  `ToolStrictLevel`) gets vLLM's `json_schema: true` (any JSON value, a string included); here
  it is any JSON *object*, as every API's tool arguments are (Anthropic's `input`).

A grammar is compiled by vLLM before the request samples, and compiling a large one holds up
the other sessions on that replica (a 20k-value enum took 21 s): a constraint larger than
`MAX_GRAMMAR_BYTES` is refused.
"""

from __future__ import annotations

import json
import re
from dataclasses import fields
from typing import Any

import xgrammar
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.exceptions import VLLMValidationError
from vllm.parser.abstract_parser import Parser
from vllm.sampling_params import StructuredOutputsParams, check_json_nesting
from vllm.v1.structured_output.backend_xgrammar import has_xgrammar_unsupported_json_features
from vllm.v1.structured_output.utils import grammar_is_likely_lark

from molt_proxy.errors import BadRequest

MAX_GRAMMAR_BYTES = 256 * 1024
"""The largest constraint sent to vLLM (its JSON, grammars included), in bytes. xgrammar
compiles a 200 KB grammar (a 10,000-value enum) in about 1 s on a shared CPU core, while other
requests on the replica wait; a 20,000-value enum is 410 KB and took 21 s in vLLM."""

Separators = tuple[str, str]
"""(item, key) separators of JSON text, as `json.dumps` takes them."""

_FORCED = ("tool_choice", "tool_choice 'required' or a named function")
_SINGLE = ("parallel_tool_calls", "parallel_tool_calls=false")
"""(param, what the request asked) of the two tool constraints that need a tool parser."""


def _forces_tool_call(request: ChatCompletionRequest) -> bool:
    """`tool_choice` `required` or a named function (vLLM's validator has checked the name)."""
    choice = request.tool_choice
    return bool(request.tools) and (choice == "required" or not isinstance(choice, str | None))


def structured_outputs(
    request: ChatCompletionRequest,
    parser_cls: type[Parser] | None,
    tool_parser: str | None,
    hf: Any,
    separators: Separators = (", ", ": "),
) -> dict[str, Any] | None:
    """The `structured_outputs` of vLLM's `sampling_params` for `request`, or None when it
    asks for no constraint. `parser_cls` is vLLM's combined parser (with the tool parser
    named `tool_parser`, if any, at its strict level); `hf` is the tokenizer it takes;
    `separators` are those JSON is constrained to. A constraint the proxy cannot enforce as
    asked is a `BadRequest`."""
    forced = _forces_tool_call(request)
    requested = _requested(request)
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
    params = requested
    if parser_cls is not None and request.tools:
        params = _adjusted(request, parser_cls, hf).extract_structured_outputs()
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
    constraint = {
        f.name: getattr(params, f.name)
        for f in fields(params)
        if not f.name.startswith("_") and getattr(params, f.name) not in (None, False)
    }
    where = "tools" if params.structural_tag is not None and requested is None else _format_param(request)
    tightened = _without_free_whitespace(constraint, separators, where)
    size = len(json.dumps(tightened))
    if size > MAX_GRAMMAR_BYTES:
        raise BadRequest(
            f"the {where} constraint compiles to a grammar of {size} bytes, more than the "
            f"{MAX_GRAMMAR_BYTES} this proxy compiles (large enums and schemas hold up every "
            "other request on the replica while vLLM compiles them)",
            param=where,
        )
    return tightened


def _format_param(request: ChatCompletionRequest) -> str:
    return "response_format" if request.response_format is not None else "structured_outputs"


def _requested(request: ChatCompletionRequest) -> StructuredOutputsParams | None:
    """The output format the request asks for (vLLM's `extract_structured_outputs`), its
    refusals named as the request's fault (an empty `structured_outputs`, a json_schema
    without a schema)."""
    schema = request.response_format.json_schema if request.response_format is not None else None
    if schema is not None and schema.json_schema is None:
        raise BadRequest(
            "'response_format.json_schema.schema' must be a JSON schema object",
            param="response_format.json_schema.schema",
        )
    try:
        return request.extract_structured_outputs()
    except VLLMValidationError:
        param = _format_param(request)
        raise BadRequest(
            f"'{param}' must name one kind of constraint: json, regex, choice, grammar, "
            "json_object or structural_tag",
            param=param,
        ) from None


def _without_free_whitespace(
    constraint: dict[str, Any], separators: Separators, where: str
) -> dict[str, Any]:
    """`constraint` with each JSON schema (top level or in a structural tag) as xgrammar's
    grammar for it without free whitespace (module docstring). A schema xgrammar cannot
    express (vLLM then samples it with its `guidance` backend) is sent as it was."""
    constraint = dict(constraint)
    if "json" in constraint:
        schema = _parsed(constraint["json"], where)
        if not (isinstance(schema, dict) and has_xgrammar_unsupported_json_features(schema)):
            constraint["grammar"] = _grammar(schema, separators, where)
            del constraint["json"]
    elif constraint.get("json_object"):
        constraint["grammar"] = _grammar({"type": "object"}, separators, where)
        del constraint["json_object"]
    elif "grammar" in constraint:
        _check_grammar(constraint["grammar"], where)
    elif "structural_tag" in constraint:
        tag = _parsed(constraint["structural_tag"], where, structural_tag=True)
        constraint["structural_tag"] = json.dumps(_tag_grammars(tag, separators, where))
    return constraint


def _parsed(spec: str | dict[str, Any], where: str, *, structural_tag: bool = False) -> Any:
    """A schema or structural tag as a value, nested no deeper than vLLM allows
    (`check_json_nesting`, which vLLM runs before compiling it)."""
    try:
        check_json_nesting(spec, structural_tag=structural_tag)
        return json.loads(spec) if isinstance(spec, str) else spec
    except json.JSONDecodeError:
        raise BadRequest(f"the {where} constraint is not valid JSON", param=where) from None
    except VLLMValidationError as exc:
        raise BadRequest(f"the {where} constraint: {exc.args[0] if exc.args else exc}", param=where) from None


def _tag_grammars(node: Any, separators: Separators, where: str) -> Any:
    """A structural tag (xgrammar's format tree) with each plain JSON content as a grammar;
    content that is any JSON (`true`: a tool not pinned to its schema) becomes any object."""
    if isinstance(node, list):
        return [_tag_grammars(item, separators, where) for item in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and _plain_json(node):
        schema = node["json_schema"]
        if not (isinstance(schema, dict) and has_xgrammar_unsupported_json_features(schema)):
            schema = {"type": "object"} if schema is True else schema
            return {"type": "grammar", "grammar": _grammar(schema, separators, where)}
    return {key: _tag_grammars(value, separators, where) for key, value in node.items()}


def _check_grammar(grammar: str, where: str) -> None:
    """A grammar the request sends parses as vLLM's xgrammar backend will parse it (Lark or
    EBNF), or the request is refused here rather than failing in vLLM."""
    try:
        if grammar_is_likely_lark(grammar):
            xgrammar.Grammar.from_lark(grammar)
        else:
            xgrammar.Grammar.from_ebnf(grammar)
    except Exception:
        raise BadRequest(f"the {where} grammar is not valid Lark or EBNF", param=where) from None


def _plain_json(node: dict[str, Any]) -> bool:
    """A structural tag's JSON content with none of xgrammar's options past the schema (any
    key order, a whitespace cap, excluded substrings), which a grammar would drop."""
    return (
        node.get("style", "json") == "json"
        and not node.get("any_order")
        and node.get("max_whitespace_cnt") is None
        and not node.get("excludes")
    )


def _grammar(schema: Any, separators: Separators, where: str) -> str:
    """xgrammar's EBNF for `schema`, the JSON text in one line with exactly `separators`."""
    try:
        grammar = xgrammar.Grammar.from_json_schema(
            json.dumps(schema), any_whitespace=False, separators=separators
        )
    except Exception as exc:  # xgrammar raises RuntimeError (and others) on a schema it refuses
        # its message starts with a timestamp and a source line: "[04:55:56] /project/...cc:4944: "
        reason = re.sub(r"^\[[^\]]*\] \S+: ", "", str(exc)).strip()
        raise BadRequest(f"the {where} JSON schema cannot be compiled: {reason[:300]}", param=where) from None
    return str(grammar)


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
