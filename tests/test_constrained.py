"""Constrained decoding: `tool_choice` required or named, `parallel_tool_calls: false`,
`response_format` JSON and vLLM's `structured_outputs` are sent to vLLM as structured outputs,
and each such turn is recorded `constrained`.

What the proxy sends and records runs in-process in front of the stand-in vLLM (which lists
the body of every generate request it got); what a grammar does to real sampling runs
against the session's real vLLM on the taught tiny Qwen3 (`tests/conftest.py`).
"""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import xgrammar
from openai import OpenAI
from xgrammar.testing import _is_grammar_accept_string

from devtools.scripts import WEATHER_TOOL, weather_episode
from molt_proxy import store
from molt_proxy.cli import launched_vllm_args, parser, settings_from_args
from molt_proxy.constraints import MAX_GRAMMAR_BYTES
from tests.helpers import forward_logprobs, reopened, reply_as_message, trajectories, write_old_store
from tests.inprocess import chat_body, inprocess_proxy, post

PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": PARAMETERS}}]
STRICT = [{"type": "function", "function": {"name": "f", "parameters": PARAMETERS, "strict": True}}]
NAMED = {"type": "function", "function": {"name": "f"}}
BEGINS = ['<tool_call>\n{"name": "f", "arguments": ', '<tool_call>{"name": "f", "arguments": ']
"""The two forms of vLLM's Hermes structural tag: the template's own markup, and a compact one."""
ANY_OBJECT = {"type": "object"}


def grammar(schema: dict[str, Any]) -> dict[str, str]:
    """xgrammar's grammar for `schema` in one line with Qwen3's `tojson` separators, as the
    proxy sends it in place of the schema (`constraints.py`)."""
    text = xgrammar.Grammar.from_json_schema(
        json.dumps(schema), any_whitespace=False, separators=(", ", ": ")
    )
    return {"type": "grammar", "grammar": str(text)}


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The in-process proxy with the Hermes tool parser, in front of the stand-in vLLM."""
    with inprocess_proxy(tmp_path_factory.mktemp("constrained") / "p.db", tool_call_parser="hermes") as url:
        yield url


def sent_constraint(proxy: str, session: str, **fields: Any) -> tuple[dict[str, Any] | None, bool]:
    """Send one chat in `session` and close it: the `structured_outputs` vLLM got (None: none)
    and the turn's `constrained` in the trajectory."""
    response = post(proxy, f"/s/{session}/v1/chat/completions", json=chat_body(**fields))
    assert response.status_code == 200, response.text
    upstream = httpx.get(f"{proxy}/health").json()["replicas"][0]["url"]
    params = httpx.get(f"{upstream}/_generated").json()[-1]["sampling_params"]
    post(proxy, "/v1/rewards", json={"session_id": session, "reward": 1.0}).raise_for_status()
    [record] = [t for t in trajectories(proxy) if t["session_id"] == session]
    return params.get("structured_outputs"), record["turns"][0]["constrained"]


def tag_format(constraint: dict[str, Any] | None) -> dict[str, Any]:
    assert constraint is not None and set(constraint) == {"structural_tag"}
    return json.loads(constraint["structural_tag"])["format"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_choice_is_constrained_to_the_templates_call_markup(proxy, stream):
    constraint, constrained = sent_constraint(
        proxy, f"named-{stream}", tools=STRICT, tool_choice=NAMED, stream=stream
    )
    assert constrained is True
    tags = tag_format(constraint)
    assert (tags["type"], tags["at_least_one"], tags["stop_after_first"]) == (
        "tags_with_separator",
        True,
        True,
    )
    assert [tag["begin"] for tag in tags["tags"]] == BEGINS
    assert [tag["end"] for tag in tags["tags"]] == ["}\n</tool_call>", "}</tool_call>"]
    # a strict tool's arguments follow its schema, without free whitespace
    assert [tag["content"] for tag in tags["tags"]] == [grammar(PARAMETERS), grammar(PARAMETERS)]


def test_required_allows_several_calls_and_a_loose_tool_any_json_object_arguments(proxy):
    """vLLM's `json_schema: true` (any JSON value, a bare string too) for a tool not pinned to
    its schema is sent as any object: a call's arguments are an object in every API."""
    constraint, constrained = sent_constraint(proxy, "required", tools=TOOLS, tool_choice="required")
    tags = tag_format(constraint)
    assert constrained is True and (tags["at_least_one"], tags["stop_after_first"]) == (True, False)
    assert [tag["content"] for tag in tags["tags"]] == [grammar(ANY_OBJECT), grammar(ANY_OBJECT)]


@pytest.mark.parametrize(
    ("schema", "text", "admitted"),
    [
        (PARAMETERS, '{"city": "Paris"}', True),  # what Qwen3's `tojson` prints
        (PARAMETERS, '{"city":"Paris"}', False),
        (PARAMETERS, '{ "city": "Paris"}', False),
        (PARAMETERS, '{"city"\r\n: "Paris"}', False),
        (PARAMETERS, '{"city": "Paris"}\n', False),
        (PARAMETERS, '{"city": "Paris", "zone": "x"}', False),
        (ANY_OBJECT, '{"zone": [1, {"a": null}]}', True),
        (ANY_OBJECT, '{"zone": [1,2]}', False),
        (ANY_OBJECT, '"Paris"', False),
    ],
)
def test_json_grammars_admit_exactly_the_bytes_the_template_prints(schema, text, admitted):
    assert _is_grammar_accept_string(grammar(schema)["grammar"], text) is admitted


def test_parallel_tool_calls_false_allows_text_and_at_most_one_call(proxy):
    constraint, constrained = sent_constraint(proxy, "single", tools=TOOLS, parallel_tool_calls=False)
    tags = tag_format(constraint)
    assert constrained is True
    assert (tags["type"], tags["triggers"], tags["stop_after_first"]) == (
        "triggered_tags",
        ["<tool_call>"],
        True,
    )


def test_a_strict_tool_constrains_its_calls_under_auto_as_in_vllm(proxy):
    """Text stays free until `<tool_call>`; a call then follows the strict schema. The turn is
    constrained (vLLM's chat route does the same)."""
    constraint, constrained = sent_constraint(proxy, "strict-auto", tools=STRICT)
    tags = tag_format(constraint)
    assert constrained is True
    assert (tags["type"], tags["triggers"], tags["stop_after_first"]) == (
        "triggered_tags",
        ["<tool_call>"],
        False,
    )
    assert [tag["content"] for tag in tags["tags"]] == [grammar(PARAMETERS), grammar(PARAMETERS)]


@pytest.mark.parametrize(
    ("level", "fields", "kind", "content"),
    [
        ("auto", {"tool_choice": NAMED}, "tags_with_separator", grammar(ANY_OBJECT)),
        ("parameter", {"tool_choice": NAMED}, "tags_with_separator", grammar(PARAMETERS)),
        ("function", {}, "triggered_tags", grammar(ANY_OBJECT)),
        ("parameter", {}, "triggered_tags", grammar(PARAMETERS)),
        ("auto", {}, None, None),
    ],
)
def test_the_tool_strict_level_is_vllms(tmp_path, level, fields, kind, content):
    """`--tool-strict-level` as in `vllm serve`: `parameter` pins every tool's arguments to its
    schema; `function` and `parameter` constrain every request with tools to the call markup."""
    with inprocess_proxy(tmp_path / "p.db", tool_call_parser="hermes", tool_strict_level=level) as url:
        constraint, constrained = sent_constraint(url, "s", tools=TOOLS, **fields)
    assert constrained is (kind is not None)
    if kind is not None:
        tags = tag_format(constraint)
        assert tags["type"] == kind and [tag["content"] for tag in tags["tags"]] == [content, content]


def test_serve_takes_vllms_tool_strict_levels_only():
    flags = parser().parse_args(["serve", "--model", "m", "--tool-strict-level", "parameter"])
    assert settings_from_args(flags, None, []).tool_strict_level == "parameter"
    with pytest.raises(SystemExit):
        parser().parse_args(["serve", "--model", "m", "--tool-strict-level", "all"])


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": PARAMETERS}}},
         {"grammar": grammar(PARAMETERS)["grammar"]}),
        ({"response_format": {"type": "json_object"}}, {"grammar": grammar(ANY_OBJECT)["grammar"]}),
        ({"structured_outputs": {"json": PARAMETERS}}, {"grammar": grammar(PARAMETERS)["grammar"]}),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, {"choice": ["yes", "no"]}),
        ({"structured_outputs": {"regex": "[0-9]+"}}, {"regex": "[0-9]+"}),
        ({"response_format": {"type": "text"}}, None),
        ({"tools": TOOLS}, None),
        ({"tools": TOOLS, "tool_choice": "none", "parallel_tool_calls": False}, None),
    ],
)  # fmt: skip
def test_output_formats_are_sent_as_vllm_structured_outputs(proxy, fields, expected):
    session = "format-" + hashlib.sha256(json.dumps(fields).encode()).hexdigest()[:16]  # a valid id
    constraint, constrained = sent_constraint(proxy, session, **fields)
    assert (constraint, constrained) == (expected, expected is not None)


@pytest.mark.parametrize(
    "tool_choice, chat_fields",
    [
        ({"type": "tool", "name": "f"}, {"tool_choice": NAMED}),
        ({"type": "any"}, {"tool_choice": "required"}),
        ({"type": "auto", "disable_parallel_tool_use": True}, {"parallel_tool_calls": False}),
    ],
)
def test_anthropic_forced_tool_use_is_the_constraint_chat_completions_sends(proxy, tool_choice, chat_fields):
    """`/v1/messages` decodes into the same conversation: its forced tool use is the same
    structured output sent to vLLM, and its turn is recorded constrained."""
    name = tool_choice["type"]
    chat, _ = sent_constraint(proxy, f"chat-{name}", tools=TOOLS, **chat_fields)
    body = {
        "model": "m",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"name": "f", "input_schema": PARAMETERS}],
        "tool_choice": tool_choice,
    }
    response = post(proxy, f"/s/messages-{name}/v1/messages", json=body)
    assert response.status_code == 200, response.text
    upstream = httpx.get(f"{proxy}/health").json()["replicas"][0]["url"]
    sent = httpx.get(f"{upstream}/_generated").json()[-1]["sampling_params"]
    assert chat is not None and sent["structured_outputs"] == chat
    post(proxy, "/v1/rewards", json={"session_id": f"messages-{name}", "reward": 1.0}).raise_for_status()
    [record] = [t for t in trajectories(proxy) if t["session_id"] == f"messages-{name}"]
    assert record["turns"][0]["constrained"] is True


def assert_refused(response: httpx.Response, param: str, message: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"], error["message"]) == ("invalid_request_error", param, message)


FORCED = "the forced tool call is the reply's format"


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
         f"response_format cannot be combined with tool_choice 'required' or a named function: {FORCED}"),
        ({"tool_choice": NAMED, "structured_outputs": {"json_object": True}}, "structured_outputs",
         f"structured_outputs cannot be combined with tool_choice 'required' or a named function: {FORCED}"),
    ],
)  # fmt: skip
def test_an_output_format_beside_a_forced_call_is_refused(proxy, fields, param, message):
    assert_refused(post(proxy, "/v1/chat/completions", json=chat_body(tools=TOOLS, **fields)), param, message)


KINDS = "json, regex, choice, grammar, json_object, structural_tag"


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        *[({"structured_outputs": value}, "structured_outputs", "'structured_outputs' must be an object")
          for value in ("x", 1, True, [])],
        ({"structured_outputs": {}}, "structured_outputs",
         f"'structured_outputs' must name exactly one of {KINDS}"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
         f"'structured_outputs' must name exactly one of {KINDS}"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs",
         "the structured_outputs constraint is not valid JSON"),
        ({"structured_outputs": {"json": "5"}}, "structured_outputs",
         "the structured_outputs JSON schema cannot be compiled: "
         "Schema should be an object or bool, but got 5"),
        ({"structured_outputs": {"grammar": "root ::="}}, "structured_outputs",
         "the structured_outputs grammar is not valid Lark or EBNF"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": None}}},
         "response_format.json_schema.schema",
         "'response_format.json_schema.schema' must be a JSON schema object"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": 5}}}},
         "response_format", "the response_format JSON schema cannot be compiled: Type should be a string"),
        *[({"logit_bias": {key: 1}}, "logit_bias",
           f"'logit_bias' keys must be token ids in decimal digits, got {key!r}")
          for key in ("abc", "1e3", "0x10", "-1", " 1")],
        ({"logit_bias": [1]}, "logit_bias", "'logit_bias' must be an object of token ids to numbers"),
    ],
)  # fmt: skip
def test_malformed_output_constraints_are_refused_by_name(proxy, fields, param, message):
    """Issue 26.6: each of these was a 500 (vLLM's validator raised AttributeError, or its
    `StructuredOutputsParams` a bare error; a `logit_bias` key reached `int()`)."""
    with httpx.Client(base_url=proxy, timeout=60) as client:
        assert_refused(client.post("/v1/chat/completions", json=chat_body(**fields)), param, message)
        # the connection stays open for the next request (a 500 dropped it)
        assert client.post("/v1/chat/completions", json=chat_body()).status_code == 200


@pytest.mark.parametrize(
    ("text", "param", "message"),
    [
        ({"format": {"type": "json_schema", "name": "a", "schema": None}}, "text.format.schema",
         "'text.format.schema' must be a JSON schema object"),
        ({"format": {"type": "json_schema", "name": "a"}}, "text.format.schema",
         "'text.format.schema' must be a JSON schema object"),
        ({"format": "json"}, "text.format", "'text.format.type' must be text, json_object or json_schema"),
    ],
)  # fmt: skip
def test_a_malformed_responses_text_format_is_refused_by_name(proxy, text, param, message):
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 4, "text": text}
    assert_refused(post(proxy, "/v1/responses", json=body), param, message)


def test_a_grammar_too_large_to_compile_off_the_other_sessions_path_is_refused(proxy):
    """Issue 26.8: a json_schema with a 20,000-value enum compiled in vLLM for 21 s and held up
    another agent's request. Its grammar is 530 KB, past `MAX_GRAMMAR_BYTES`: refused before it
    reaches vLLM. A 2,000-value enum is served."""

    def enum_schema(n: int) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {"v": {"enum": [f"value{i}" for i in range(n)]}},
            "required": ["v"],
        }

    large = enum_schema(20_000)
    size = len(json.dumps({"grammar": grammar(large)["grammar"]}))
    assert size == 530_260
    body = chat_body(response_format={"type": "json_schema", "json_schema": {"name": "e", "schema": large}})
    assert_refused(
        post(proxy, "/v1/chat/completions", json=body),
        "response_format",
        f"the response_format constraint compiles to a grammar of {size} bytes, more than the "
        f"{MAX_GRAMMAR_BYTES} this proxy compiles (large enums and schemas hold up every other "
        "request on the replica while vLLM compiles them)",
    )
    small = chat_body(
        response_format={"type": "json_schema", "json_schema": {"name": "e", "schema": enum_schema(2_000)}}
    )
    assert post(proxy, "/v1/chat/completions", json=small).status_code == 200


def test_a_tool_parser_without_a_structural_tag_cannot_force_calls(tmp_path):
    with inprocess_proxy(tmp_path / "p.db", tool_call_parser="pythonic") as url:
        for fields, param, what in [
            ({"tool_choice": "required"}, "tool_choice", "tool_choice 'required' or a named function"),
            ({"tool_choice": NAMED}, "tool_choice", "tool_choice 'required' or a named function"),
            ({"parallel_tool_calls": False}, "parallel_tool_calls", "parallel_tool_calls=false"),
        ]:
            response = post(url, "/v1/chat/completions", json=chat_body(tools=TOOLS, **fields))
            assert_refused(
                response,
                param,
                f"{what} needs a tool parser whose call markup vLLM can constrain (a structural tag); "
                "'pythonic' has none",
            )


def test_a_store_from_before_constraints_were_recorded_reads_unconstrained(tmp_path):
    db_path = tmp_path / "old.db"
    write_old_store(db_path, store._SCHEMA.replace(",\n    constrained INTEGER", ""), "{}")
    with sqlite3.connect(db_path) as db:
        assert "constrained" not in [row[1] for row in db.execute("PRAGMA table_info(turns)")]

    [(session, turns)] = reopened(db_path)
    assert session.id == "s" and turns[0].generation.constrained is False
    with sqlite3.connect(db_path) as db:
        assert [row[1] for row in db.execute("PRAGMA table_info(turns)")][-1] == "constrained"


def test_a_launched_vllm_gets_the_reasoning_parser_so_grammars_wait_for_the_reasoning():
    assert launched_vllm_args(["--seed", "1"], "qwen3") == ["--seed", "1", "--reasoning-parser", "qwen3"]
    own = ["--reasoning-parser=deepseek_r1"]  # the user's own choice stands
    assert launched_vllm_args(own, "qwen3") == own
    assert launched_vllm_args([], None) == []


# -- real sampling: the session's vLLM on the taught tiny Qwen3 ---------------------------------

STRICT_WEATHER = {
    "type": "function",
    "function": {
        **WEATHER_TOOL["function"],
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {
                "city": {
                    "type": "string",
                    "description": "The city name.",
                    "enum": ["Paris", "London", "Tokyo"],
                }
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
"""The script's tool, strict: its arguments must follow its schema (one of three cities, nothing
else). The cities are listed because a free string lets the untaught model, greedy, loop inside
it until `max_tokens`."""


def _history(upto: int) -> list[dict[str, Any]]:
    """The weather script's first `upto` messages (its tool calls as an agent echoes them)."""
    return json.loads(json.dumps(weather_episode("hermes")["messages"][:upto]))


def _continue_exactly(
    proxy, client: OpenAI, session: str, history: list[dict[str, Any]], tool: dict[str, Any]
) -> list[dict[str, Any]]:
    """One more turn on `history` (with the same `tool`, so the same system prompt), then the
    session's turns; its one segment's unconstrained sampled tokens are the model's own
    logprobs (<= 1e-4). The turn is unconstrained with tool_choice none: with `auto`, a strict
    tool constrains the calls (vLLM's structural tag), and the turn would be constrained."""
    client.chat.completions.create(
        model="tiny", messages=history, tools=[tool], tool_choice="none", max_tokens=16, seed=3
    )
    post(proxy.url, "/v1/rewards", json={"session_id": session, "reward": 1.0}).raise_for_status()
    [record] = trajectories(proxy.url)  # one segment: the echo re-rendered the sampled bytes
    reference = forward_logprobs(proxy.model, record["token_ids"])
    for turn in record["turns"]:
        if not turn["constrained"]:
            sampled = range(turn["completion_start"], turn["completion_end"])
            assert max(abs(record["logprobs"][i] - reference[i]) for i in sampled) <= 1e-4
    return record["turns"]


def test_a_forced_call_on_the_untaught_tiny_model_is_valid_json_and_its_echo_continues_exactly(
    qwen3_model: Path, qwen3_vllm, start_proxy
):
    """After "Thanks!" the model was taught to answer "You're welcome!", never to call a tool:
    the grammar makes it call `get_weather` (greedy, so the reply is the same every run) with
    arguments that follow the strict schema. The agent echoes the call; the template renders
    exactly the sampled bytes, so the next, unconstrained turn continues the segment, exact."""
    proxy = start_proxy(qwen3_model, qwen3_vllm, "--tool-call-parser", "hermes")
    client = OpenAI(base_url=proxy.base_url("forced"), api_key="x")
    history = _history(11)
    forced = client.chat.completions.create(
        model="tiny",
        messages=history,
        tools=[STRICT_WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=40,
    )
    choice = forced.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and list(arguments) == ["city"]
    assert isinstance(arguments["city"], str)
    history += [
        reply_as_message(choice.message),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny."},
    ]
    first, second = _continue_exactly(proxy, client, "forced", history, STRICT_WEATHER)
    assert (first["constrained"], second["constrained"]) == (True, False)


def test_a_json_schema_reply_is_schema_valid_and_its_echo_continues_exactly(
    qwen3_model: Path, qwen3_vllm, start_proxy
):
    proxy = start_proxy(qwen3_model, qwen3_vllm, "--tool-call-parser", "hermes")
    client = OpenAI(base_url=proxy.base_url("json"), api_key="x")
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "London"]}},
        "required": ["city"],
        "additionalProperties": False,
    }
    history = _history(2)
    shaped = client.chat.completions.create(
        model="tiny",
        messages=history,
        tools=[WEATHER_TOOL],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "w", "strict": True, "schema": schema},
        },
        max_tokens=40,
        seed=1,
    )
    assert shaped.choices[0].finish_reason == "stop"
    content = json.loads(shaped.choices[0].message.content)
    assert list(content) == ["city"] and content["city"] in ("Paris", "London")
    history += [reply_as_message(shaped.choices[0].message), {"role": "user", "content": "And Tokyo?"}]
    first, second = _continue_exactly(proxy, client, "json", history, WEATHER_TOOL)
    assert (first["constrained"], second["constrained"]) == (True, False)


# -- real sampling on the untaught tiny Qwen3: a weak policy, as RL starts from -------------------

ZONES = ["Europe/Paris", "Asia/Tokyo", "America/Lima"]
ZONE_SCHEMA = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ZONES}},
    "required": ["zone"],
    "additionalProperties": False,
}
"""A time zone out of three: a free string lets a random model loop inside it until `max_tokens`."""
TIME_QUESTION = [{"role": "user", "content": "What time is it in Paris?"}]
FORCED_TIME = {"type": "function", "function": {"name": "get_time"}}
CALL_MARKUP = (
    r'<tool_call>(\n?){"name": "get_time", "arguments": (?P<arguments>\{.*\})}\1</tool_call><\|im_end\|>'
)
"""The sampled text of a forced call: Hermes' markup as the template prints it (or vLLM's compact
form, `\\n` left out), the arguments in one line with `", "` and `": "`, then the end of turn."""


def time_tool(strict: bool | None) -> dict[str, Any]:
    function = {"name": "get_time", "description": "The time in a zone.", "parameters": ZONE_SCHEMA}
    return {"type": "function", "function": function | ({} if strict is None else {"strict": strict})}


def sampled_text(proxy_url: str, model: Path, session: str) -> list[str]:
    """Close `session` and decode what each of its turns sampled, exactly (one segment)."""
    from transformers import AutoTokenizer

    post(proxy_url, "/v1/rewards", json={"session_id": session, "reward": 0.0}).raise_for_status()
    [record] = [t for t in trajectories(proxy_url) if t["session_id"] == session]
    tokenizer = AutoTokenizer.from_pretrained(model)
    return [
        tokenizer.decode(record["token_ids"][turn["completion_start"] : turn["completion_end"]])
        for turn in record["turns"]
    ]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_forced_strict_call_on_the_untaught_model_samples_no_whitespace_and_its_echo_continues(
    untaught_qwen3_model: Path, untaught_qwen3_vllm, start_proxy, seed
):
    """Issue 26.10: under vLLM's own grammar the untaught model padded a strict tool's
    arguments with whitespace until `max_tokens` (`{\\r\\n   \\n\\t...`, 300 of 300 tokens, seeds
    2 and 3). Now the call is in the template's bytes and ends within a few dozen tokens; the
    agent echoes it and the next turn continues the same segment."""
    proxy = start_proxy(untaught_qwen3_model, untaught_qwen3_vllm, "--tool-call-parser", "hermes")
    session = f"strict-{seed}"
    client = OpenAI(base_url=proxy.base_url(session), api_key="x")
    tools = [time_tool(strict=True)]
    forced = client.chat.completions.create(
        model="tiny", messages=TIME_QUESTION, tools=tools, tool_choice=FORCED_TIME, max_tokens=300, seed=seed
    )
    choice = forced.choices[0]
    assert choice.finish_reason == "tool_calls" and forced.usage.completion_tokens < 60
    [call] = choice.message.tool_calls
    assert json.loads(call.function.arguments)["zone"] in ZONES
    history = [
        *TIME_QUESTION,
        reply_as_message(choice.message),
        {"role": "tool", "tool_call_id": call.id, "content": "12:00"},
    ]
    client.chat.completions.create(
        model="tiny", messages=history, tools=tools, tool_choice="none", max_tokens=4
    )
    first, _ = sampled_text(proxy.url, untaught_qwen3_model, session)
    match = re.fullmatch(CALL_MARKUP, first, re.DOTALL)
    assert match is not None, first
    assert (
        match["arguments"]
        == call.function.arguments
        == json.dumps({"zone": json.loads(match["arguments"])["zone"]})
    )


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_schema_output_on_the_untaught_model_samples_no_whitespace_and_its_echo_continues(
    untaught_qwen3_model: Path, untaught_qwen3_vllm, start_proxy, seed
):
    """Issue 26.10: the JSON output of vLLM's grammar was `{` then whitespace until
    `max_tokens` (300 of 300 tokens, every seed); now it is the object, in one line."""
    proxy = start_proxy(untaught_qwen3_model, untaught_qwen3_vllm, "--tool-call-parser", "hermes")
    session = f"json-{seed}"
    client = OpenAI(base_url=proxy.base_url(session), api_key="x")
    shaped = client.chat.completions.create(
        model="tiny",
        messages=TIME_QUESTION,
        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": ZONE_SCHEMA}},
        max_tokens=300,
        seed=seed,
    )
    content = shaped.choices[0].message.content
    assert shaped.choices[0].finish_reason == "stop" and shaped.usage.completion_tokens < 30
    assert content == json.dumps({"zone": json.loads(content)["zone"]})
    history = [
        *TIME_QUESTION,
        reply_as_message(shaped.choices[0].message),
        {"role": "user", "content": "Thanks"},
    ]
    client.chat.completions.create(model="tiny", messages=history, max_tokens=4)
    first, _ = sampled_text(proxy.url, untaught_qwen3_model, session)
    assert first == content + "<|im_end|>"


LOOSE_SAMPLES = {
    "auto": ["{}", None, "{}"],
    "function": ["{}", None, "{}"],
    "parameter": ['{"zone": "America/Lima"}', '{"zone": "Asia/Tokyo"}', '{"zone": "America/Lima"}'],
}
"""What the untaught model samples as the arguments of a forced call of a tool that is not
strict, seeds 1, 2, 3, per `--tool-strict-level` (None: `max_tokens` cut the call off inside a
made-up key). Only `parameter` pins them to the schema; the others still make them an object."""


@pytest.mark.parametrize("level", ["auto", "function", "parameter"])
def test_the_tool_strict_level_decides_what_pins_a_loose_tools_calls_on_the_untaught_model(
    untaught_qwen3_model: Path, untaught_qwen3_vllm, start_proxy, level
):
    """Issue 26.11, as `vllm serve --tool-strict-level`: `auto` and `function` leave a tool
    without `strict` free in its arguments (an object, `constraints.py`; vLLM's own grammar
    let it be a string), `parameter` pins them to the schema; `function` and `parameter` also
    constrain a turn that only may call (`tool_choice` auto), so it is recorded constrained."""
    proxy = start_proxy(
        untaught_qwen3_model,
        untaught_qwen3_vllm,
        "--tool-call-parser",
        "hermes",
        "--tool-strict-level",
        level,
    )
    sampled = []
    for seed in (1, 2, 3):
        client = OpenAI(base_url=proxy.base_url(f"{level}-{seed}"), api_key="x")
        forced = client.chat.completions.create(
            model="tiny",
            messages=TIME_QUESTION,
            tools=[time_tool(strict=None)],
            tool_choice=FORCED_TIME,
            max_tokens=300,
            seed=seed,
        )
        [call] = forced.choices[0].message.tool_calls
        cut = forced.choices[0].finish_reason == "length"
        assert forced.choices[0].finish_reason == ("length" if cut else "tool_calls")
        assert not cut or (call.function.arguments.startswith('{"') and forced.usage.completion_tokens == 300)
        sampled.append(None if cut else call.function.arguments)
    assert sampled == LOOSE_SAMPLES[level]
    client = OpenAI(base_url=proxy.base_url(f"{level}-may-call"), api_key="x")
    client.chat.completions.create(
        model="tiny", messages=TIME_QUESTION, tools=[time_tool(strict=None)], max_tokens=8, seed=1
    )
    post(proxy.url, "/v1/rewards", json={"session_id": f"{level}-may-call", "reward": 0.0}).raise_for_status()
    [record] = [t for t in trajectories(proxy.url) if t["session_id"] == f"{level}-may-call"]
    assert record["turns"][0]["constrained"] is (level != "auto")
