"""The taught tiny models write their scripted replies, in formats vLLM's parsers read back.

Real tokenizers and chat templates from ../shared/tokenizers (or $MOLT_PROXY_TOKENIZERS); no
hub, no fakes. The two
models are built (and taught) once per module.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from devtools import (
    DEFAULT_SCRIPTS,
    Arch,
    Conversation,
    as_echoed,
    claude_code,
    codex,
    gemini_cli,
    render_reply,
    thinking_episode,
    tokenizer_source,
    weather_episode,
)
from devtools.tokenizers import CHECKOUT_DEFAULT

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _tokenizer(arch: Arch) -> Any:
    source = tokenizer_source(arch)
    if source is None:
        pytest.skip(f"no shared {arch} tokenizer in ../shared/tokenizers")
    return transformers.AutoTokenizer.from_pretrained(str(source))


def _assistant_turns(conv: Conversation) -> list[tuple[int, dict[str, Any]]]:
    return [(i, m) for i, m in enumerate(conv["messages"]) if m["role"] == "assistant"]


def _map_arguments(message: dict[str, Any], convert: Callable[[str], Any]) -> dict[str, Any]:
    calls = [
        {**c, "function": {**c["function"], "arguments": convert(c["function"]["arguments"])}}
        for c in message.get("tool_calls") or []
    ]
    return {**message, "tool_calls": calls} if calls else message


def _with_dict_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """As vLLM hands messages to a template."""
    return _map_arguments(message, json.loads)


def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# --- render_reply against the real templates --------------------------------------------


def test_hermes_reply_is_what_the_qwen3_template_prints_back():
    tokenizer = _tokenizer("qwen3")
    extra = [
        # Content before calls, non-canonical argument spacing, reasoning, unicode.
        {
            "role": "assistant",
            "content": "Let me check.",
            "reasoning_content": "Two cities.",
            "tool_calls": [
                _call("call_0", "get_weather", '{"city":"Zürich"}'),
                _call("call_1", "get_weather", '{ "city" : "Paris", "days": [1, 2] }'),
            ],
        },
    ]
    messages = [m for _, m in _assistant_turns(weather_episode("hermes"))]
    messages += [m for _, m in _assistant_turns(thinking_episode())] + extra
    for message in messages:
        reply = render_reply(message, "hermes")
        # The template prints an `arguments` string verbatim (hand it the canonical
        # spelling) and a dict with `tojson` (as vLLM hands it): both must print the reply.
        canonical = _map_arguments(message, lambda a: json.dumps(json.loads(a), ensure_ascii=False))
        for shown in (canonical, _with_dict_arguments(message)):
            history = [{"role": "user", "content": "u"}, shown, {"role": "tool", "content": "r"}]
            text = tokenizer.apply_chat_template(history, tokenize=False)
            assert "<|im_start|>assistant\n" + reply + "<|im_end|>" in text


def test_hermes_reply_formats():
    two_calls = {
        "role": "assistant",
        "content": None,
        "tool_calls": [_call("a", "f", '{"x":1}'), _call("b", "g", "{}")],
    }
    assert render_reply(two_calls, "hermes") == (
        '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    )
    thought = {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet."}
    assert render_reply(thought, "hermes") == "<think>\nGreet.\n</think>\n\nHello!"


def test_llama3_json_reply_is_what_the_llama_template_prints_back():
    tokenizer = _tokenizer("llama")
    conv = weather_episode("llama3_json")
    for _, message in _assistant_turns(conv):
        reply = render_reply(message, "llama3_json")
        shown = _with_dict_arguments(message)
        history = [{"role": "user", "content": "u"}, shown, {"role": "tool", "content": "r"}]
        text = tokenizer.apply_chat_template(history, tools=conv["tools"], tokenize=False)
        assert "<|start_header_id|>assistant<|end_header_id|>\n\n" + reply + "<|eot_id|>" in text
    call = {"role": "assistant", "content": None, "tool_calls": [_call("a", "f", '{"x":1}')]}
    assert render_reply(call, "llama3_json") == '{"name": "f", "parameters": {"x": 1}}'


def test_llama3_json_rejects_what_its_template_cannot_print():
    two = {"role": "assistant", "content": None, "tool_calls": [_call("a", "f", "{}"), _call("b", "f", "{}")]}
    with pytest.raises(ValueError):
        render_reply(two, "llama3_json")
    with pytest.raises(ValueError):
        render_reply({"role": "assistant", "content": "x", "reasoning_content": "y"}, "llama3_json")


def test_the_tokenizers_folder_comes_from_the_environment_else_the_checkout(tmp_path, monkeypatch):
    monkeypatch.delenv("MOLT_PROXY_TOKENIZERS", raising=False)
    if tokenizer_source("qwen3") is not None:
        assert tokenizer_source("qwen3") == CHECKOUT_DEFAULT / "qwen3"
    (tmp_path / "llama3.2").mkdir()
    (tmp_path / "llama3.2" / "tokenizer.json").write_text("{}")
    monkeypatch.setenv("MOLT_PROXY_TOKENIZERS", str(tmp_path))
    assert tokenizer_source("llama") == tmp_path / "llama3.2"
    assert tokenizer_source("qwen3") is None
    assert tokenizer_source("qwen3", CHECKOUT_DEFAULT) in (None, CHECKOUT_DEFAULT / "qwen3")


# --- The taught models ------------------------------------------------------------------


def _greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
        )
    return out[0, len(prompt) :].tolist()


def _request(conv: Conversation) -> Any:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest(model="tiny", messages=conv["messages"][:1], tools=conv["tools"])


def _parse(text: str, conv: Conversation, tokenizer: Any) -> tuple[Any, Any, list[tuple[str, str]]]:
    """(reasoning, content, [(name, arguments)]) as vLLM's server would extract them.

    The reasoning parser runs only on the thinking script: vLLM's `qwen3` parser reads a
    reply without `</think>` as all reasoning (see the test below), so a server that serves
    the think-less weather script must run without `--reasoning-parser`.
    """
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    request = _request(conv)
    reasoning, content = None, text
    if any("reasoning_content" in m for m in conv["messages"]):
        parser = ReasoningParserManager.get_reasoning_parser("qwen3")(tokenizer)
        reasoning, content = parser.extract_reasoning(text, request)
    tool_parser = ToolParserManager.get_tool_parser(conv["family"])(tokenizer)
    info = tool_parser.extract_tool_calls(content or "", request)
    calls = [(c.function.name, c.function.arguments) for c in info.tool_calls]
    return reasoning, info.content if info.tools_called else content, calls


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_taught_model_greedily_writes_each_scripted_reply_and_vllm_parses_it(request, arch: Arch):
    folder = request.getfixturevalue(f"{arch}_model")  # the models every real-vLLM test uses
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    for conv in DEFAULT_SCRIPTS[arch]:
        for i, message in _assistant_turns(conv):
            history = [_with_dict_arguments(as_echoed(m, conv["family"])) for m in conv["messages"][:i]]
            prompt = tokenizer.apply_chat_template(
                history, tools=conv["tools"], add_generation_prompt=True, tokenize=False
            )
            reply = render_reply(message, conv["family"])
            target = tokenizer.encode(reply + tokenizer.eos_token, add_special_tokens=False)
            generated = _greedy(model, tokenizer.encode(prompt, add_special_tokens=False), len(target) + 4)
            assert generated == target, (arch, i)

            text = tokenizer.decode(generated[:-1], skip_special_tokens=False)
            assert text == reply
            reasoning, content, calls = _parse(text, conv, tokenizer)
            if message.get("reasoning_content"):
                # vLLM keeps the newlines around `</think>`; the template strips them again.
                expected = (f"\n{message['reasoning_content']}\n", "\n\n" + message["content"])
                assert (reasoning, content) == expected
            else:
                assert (reasoning, content) == (None, message["content"])
            scripted = message.get("tool_calls") or []
            assert calls == [(c["function"]["name"], c["function"]["arguments"]) for c in scripted]


@pytest.mark.skipif(
    not (claude_code.installed() or codex.installed() or gemini_cli.installed()), reason="no CLI is installed"
)
def test_the_taught_qwen3_model_writes_the_clis_replies_after_run_dependent_text_it_never_saw(qwen3_model):
    """What differs between two runs of a CLI (its folders, the date, ids in a tool's output) is
    taught as `variants.COUNT` stand-ins; a CLI test sees values of its own. Drawn from other
    generators (`variants.drawn(held_out=True)`), 12 of each: greedy decoding writes every reply,
    by more than a logit (vLLM's kernels round otherwise than `transformers`). A short process
    group id, never taught, once made Gemini CLI's answer go wrong in one test run."""
    from devtools.teaching import greedy_margins

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(qwen3_model))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(qwen3_model), dtype=torch.float32)
    captured = [
        *claude_code.claude_code_episodes(held_out=True),
        *codex.codex_episode(held_out=True),
        *gemini_cli.gemini_cli_episode(held_out=True),
    ]
    varied = [conv for conv in captured if conv.get("vary")]
    margins = greedy_margins(model, tokenizer, varied, days=12)
    replies = sum(1 for conv in varied for m in conv["messages"] if m["role"] == "assistant")
    assert len(margins) == 12 * replies
    assert min(margins) > 1.0, [round(m, 2) for m in margins]


def test_vllm_qwen3_reasoning_parser_reads_a_thinkless_reply_as_reasoning():
    """Pins a vLLM behaviour the scripts depend on: in thinking mode (the default) the
    `qwen3` parser starts inside reasoning, so text without `</think>` is all reasoning."""
    from vllm.reasoning import ReasoningParserManager

    parser = ReasoningParserManager.get_reasoning_parser("qwen3")(_tokenizer("qwen3"))
    request = _request(thinking_episode())
    assert parser.extract_reasoning("You're welcome!", request) == ("You're welcome!", None)
    assert parser.extract_reasoning("<think>\nA.\n</think>\n\nB.", request) == ("\nA.\n", "\n\nB.")
