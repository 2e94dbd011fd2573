"""Rendering on the real templates: what agents really send must render, and tool-call
arguments must reach each template in the form it re-prints verbatim."""

from __future__ import annotations

from pathlib import Path

import pytest

from devtools import tokenizer_source
from molt_proxy.errors import BadRequest
from molt_proxy.tokenizer import Tokenizer
from tests.inprocess import loaded_tokenizer


def load(arch: str) -> Tokenizer:
    """The real `arch` tokenizer, loaded once per test process (a second of CPU each time) and
    shared: a test that changes it (its template) takes `fresh(arch)` instead."""
    return loaded_tokenizer(str(_source(arch)))


def fresh(arch: str) -> Tokenizer:
    """A tokenizer of its own, for a test to change."""
    return Tokenizer.load(str(_source(arch)))


def _source(arch: str) -> Path:
    source = tokenizer_source(arch)
    if source is None:
        pytest.skip(f"the real {arch} tokenizer is not in ../shared/tokenizers")
    return source


def history(arguments: str, tool_calls_key: bool = True) -> list[dict]:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ]


def test_qwen3_gets_the_sampled_arguments_text_verbatim():
    text = load("qwen3").render(history('{"x":1,  "y": [1,2]}'), None, {})
    assert '"arguments": {"x":1,  "y": [1,2]}}' in text


def test_llama_gets_arguments_as_an_object():
    text = load("llama").render(history('{"x":1}'), None, {})
    assert '"parameters": {"x": 1}}' in text


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_tool_calls_null_renders_like_no_tool_calls(arch):
    tokenizer = load(arch)
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", "tool_calls": None},
    ]
    without = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert tokenizer.render(messages, None, {}) == tokenizer.render(without, None, {})


def test_invalid_arguments_json_is_a_bad_request_where_the_template_needs_an_object():
    with pytest.raises(BadRequest):
        load("llama").render(history("{not json"), None, {})
