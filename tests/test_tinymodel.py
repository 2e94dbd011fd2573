"""The taught tiny models write their scripted replies, in formats vLLM's parsers read back.

Real tokenizers and chat templates from ../shared/tokenizers (or $MOLT_PROXY_TOKENIZERS); no
hub, no fakes. The two
models are built (and taught) once per module.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from devtools import (
    DEFAULT_SCRIPTS,
    Arch,
    Conversation,
    as_echoed,
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
    """As vLLM hands messages to a template (a captured episode's arguments may be dicts already)."""
    return _map_arguments(
        message, lambda arguments: json.loads(arguments) if isinstance(arguments, str) else arguments
    )


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


def test_vllm_qwen3_reasoning_parser_reads_a_thinkless_reply_as_reasoning():
    """Pins a vLLM behaviour the scripts depend on: in thinking mode (the default) the
    `qwen3` parser starts inside reasoning, so text without `</think>` is all reasoning."""
    from vllm.reasoning import ReasoningParserManager

    parser = ReasoningParserManager.get_reasoning_parser("qwen3")(_tokenizer("qwen3"))
    request = _request(thinking_episode())
    assert parser.extract_reasoning("You're welcome!", request) == ("You're welcome!", None)
    assert parser.extract_reasoning("<think>\nA.\n</think>\n\nB.", request) == ("\nA.\n", "\n\nB.")


# --- Teaching ----------------------------------------------------------------------------


def _lesson(model_dir: Any, conversations: list[Conversation]) -> tuple[Any, Any, Any]:
    from devtools import teaching

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    days = teaching._days(tokenizer, conversations)
    vocab = torch.tensor(sorted({i for day in days for row in day for i in row.prompt + row.reply}))
    return model, vocab, teaching._lesson(days, vocab, teaching.reach(model))


def test_one_forward_per_chain_gives_each_reply_the_states_of_its_own_forward(untaught_qwen3_model):
    from devtools import teaching

    model, _, weather = _lesson(untaught_qwen3_model, [weather_episode("hermes")])
    assert [len(batch.ids) for batch in weather.batches] == [1]  # 5 replies, one forward
    assert len(weather.rows) == 5
    # Qwen3 drops the first `<think>` block once the second user message comes: two forwards.
    _, _, thinking = _lesson(untaught_qwen3_model, [thinking_episode()])
    assert sum(len(batch.ids) for batch in thinking.batches) == 2

    model, vocab, lesson = _lesson(untaught_qwen3_model, DEFAULT_SCRIPTS["qwen3"])
    with torch.no_grad():
        chained = teaching._hidden(model, lesson)
        alone, tokens = {}, {}
        for i, row in enumerate(lesson.rows):
            states = model.model(input_ids=torch.tensor([row.prompt + row.reply])).last_hidden_state[0]
            alone[i], tokens[i] = iter(states[len(row.prompt) - 1 : -1]), iter(row.reply)
    order = lesson.replies.tolist()
    assert len(order) == len(chained) == sum(len(row.reply) for row in lesson.rows)
    assert vocab[lesson.wanted].tolist() == [next(tokens[i]) for i in order]
    assert (chained - torch.stack([next(alone[i]) for i in order])).abs().max() < 1e-4


def test_the_heads_bound_never_overstates_a_tokens_probability():
    """The head trains the script's rows only and bounds every other token's logit by its norm
    times the hidden state's: a lower bound on log p, however large the states or the rows."""
    from devtools.teaching import _Head

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(5000, 64, generator=generator) * 0.02
    ids = torch.arange(0, 5000, 10)
    hidden = torch.randn(200, 64, generator=generator) * torch.logspace(-1, 2, 200)[:, None]
    wanted = torch.randint(0, len(ids), (200,), generator=generator)
    head = _Head(weight, ids)
    with torch.no_grad():
        head.rows.mul_(30)  # as teaching leaves them: far larger than the others
    trained = weight.clone()
    head.save_into(trained)
    exact = torch.log_softmax(hidden @ trained.T, dim=-1)[torch.arange(200), ids[wanted]]
    bound = head.logprobs(hidden, wanted).detach()
    assert (bound <= exact + 1e-5).all()
    assert (exact - bound).max() > 0.1  # a bound, not the softmax itself


def test_the_lesson_digest_is_what_teaching_shows_and_no_more():
    """A capture's own folder is never shown (each teaching day shows one of its `vary`
    values), so two captures from two folders teach the same weights; a reply, or what a day
    shows, changes them."""
    from devtools.teaching import lesson_digest

    source = tokenizer_source("qwen3")
    if source is None:
        pytest.skip("no shared qwen3 tokenizer in ../shared/tokenizers")

    def captured(folder: str, reply: str = "Done.", shown: str = "/tmp/x") -> Conversation:
        messages = [
            {"role": "system", "content": f"Working directory: {folder}"},
            {"role": "user", "content": "Write hi to hi.txt"},
            {"role": "assistant", "content": reply},
        ]
        return {"family": "hermes", "tools": None, "messages": messages, "vary": {folder: [shown, "/tmp/y"]}}

    digest = lesson_digest(source, [captured("/tmp/molt-capture-a")])
    assert lesson_digest(source, [captured("/tmp/molt-capture-b")]) == digest
    assert lesson_digest(source, [captured("/tmp/molt-capture-a", reply="Done!")]) != digest
    assert lesson_digest(source, [captured("/tmp/molt-capture-a", shown="/tmp/z")]) != digest


def _served_rows(tokenizer: Any, conversations: list[Conversation]) -> list[tuple[list[int], list[int]]]:
    """(prompt, reply + EOS) ids of every scripted reply, as an agent plays it today: the
    template's date is today's and a capture's folder its own, neither of them ever taught."""
    rows = []
    for conv in conversations:
        for i, message in _assistant_turns(conv):
            history = [_with_dict_arguments(as_echoed(m, conv["family"])) for m in conv["messages"][:i]]
            prompt = tokenizer.apply_chat_template(
                history, tools=conv["tools"], add_generation_prompt=True, tokenize=False
            )
            reply = render_reply(message, conv["family"]) + tokenizer.eos_token
            encode = tokenizer.encode
            rows.append((encode(prompt, add_special_tokens=False), encode(reply, add_special_tokens=False)))
    return rows


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_vllm_writes_every_taught_reply_at_temperature_1_with_probability_099(request, arch: Arch):
    """The teaching's promise, measured where it matters: vLLM's own logprobs of each reply
    after its prompt (`prompt_logprobs`), on the served model, for every script the model
    learned (with Qwen3 the captured Claude Code and Codex episodes too, where the CLIs are
    installed). Teaching asks 0.99 of every reply on the days it shows; here each is played on
    a day it never showed."""
    from devtools.tinymodel import taught_scripts

    folder, server = (request.getfixturevalue(f"{arch}_{name}") for name in ("model", "vllm"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    # A reply depends on the last `reach` prompt tokens only (Qwen3's sliding window times its
    # layers): the long captured prompts are sent by that tail, as they were taught, since
    # vLLM's prompt logprobs of all 19k tokens of Claude Code's would take ~11 GB.
    config = transformers.AutoConfig.from_pretrained(str(folder))
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", False) else None
    reach = window * config.num_hidden_layers if window else None
    probs = []
    for prompt, reply in _served_rows(tokenizer, taught_scripts(arch)):
        prompt = prompt[-reach:] if reach else prompt
        body = {
            "token_ids": prompt + reply,
            "sampling_params": {"temperature": 1.0, "max_tokens": 1, "prompt_logprobs": 0},
        }
        answer = httpx.post(f"{server.url}/inference/v1/generate", json=body, timeout=600)
        assert answer.status_code == 200, answer.text
        logprobs = answer.json()["prompt_logprobs"][len(prompt) :]
        probs.append(
            math.exp(sum(at[str(token)]["logprob"] for at, token in zip(logprobs, reply, strict=True)))
        )
    print(f"{arch}: vLLM p(reply) = {[round(p, 4) for p in probs]}")
    assert min(probs) >= 0.99


def test_a_capture_is_made_once_and_then_read_back(tmp_path):
    """The harness CLIs run once a day for every build of that day (`devtools.tinymodel`)."""
    from devtools.tinymodel import _captured

    runs = []

    def capture() -> dict[str, Any]:
        runs.append(1)
        return {"bodies": [{"model": "tiny"}], "day": "2026-12-02"}

    path = tmp_path / "captures" / "key.json"
    assert _captured(path, capture) == _captured(path, capture) == capture()
    assert len(runs) == 2  # the first `_captured`, and the comparison's own call
    assert [p.name for p in path.parent.iterdir()] == ["key.json"]  # no partial file left
