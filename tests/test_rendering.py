"""Incremental rendering (`rendering.py`): what a window renders is the whole render, byte for
byte, on the real templates and the project's real agent scripts; a template that a window
would get wrong, or a history it would, is rendered whole."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import pytest
from transformers.utils import chat_template_utils

from devtools.scripts import DEFAULT_SCRIPTS, as_echoed, thinking_episode, weather_episode
from molt_proxy.errors import BadRequest
from molt_proxy.render_probe import Windows, probe, window
from molt_proxy.rendering import LEAVE_OUT, Renders
from molt_proxy.tokenizer import Tokenizer
from tests.test_chains import PARENT, Agent, proxy, upstream
from tests.test_tokenizer import fresh, load

Messages = list[dict[str, Any]]


def long_history(script: dict[str, Any], copies: int) -> Messages:
    """The script's conversation `copies` times over in one history, as agents echo it: each
    copy after the first continues the history (every other one after a system message of its
    own, mid-conversation), with its tool-call ids renamed."""
    messages: Messages = []
    for k in range(copies):
        copy = script["messages"] if k == 0 else [m for m in script["messages"] if m["role"] != "system"]
        copy = json.loads(json.dumps(copy).replace('"call_', f'"k{k}_call_'))
        if k % 2:
            messages.append({"role": "system", "content": f"Copy {k}: keep it short."})
        messages += [as_echoed(m, script["family"]) if m["role"] == "assistant" else m for m in copy]
    return messages


def outcome(render, *args: Any, **kwargs: Any) -> str | tuple[str, str]:
    try:
        return render(*args, **kwargs)
    except BadRequest as exc:
        return ("refused", exc.message)


def play(renders: Renders, messages: Messages, tools: Any, kwargs: dict[str, Any]) -> None:
    """Every request of the conversation (its history up to each reply), in order, as the proxy
    renders them: each render equals the whole render, and so does what the echo view's history
    (the reply, then a tool result or user message) adds to it."""
    whole = renders.tokenizer.render
    for i, reply in enumerate(messages):
        if reply["role"] != "assistant":
            continue
        request = messages[:i]
        text = outcome(renders.render, request, tools, kwargs)
        assert text == outcome(whole, request, tools, kwargs), f"request of {i} messages"
        if not isinstance(text, str):
            continue
        follow = [
            {"role": "tool", "tool_call_id": c["id"], "content": "F"} for c in reply.get("tool_calls") or []
        ]
        more = [reply, *(follow or [{"role": "user", "content": "F"}])]
        history = outcome(whole, request + more, tools, kwargs, add_generation_prompt=False)
        expected = history[len(text) :] if isinstance(history, str) and history.startswith(text) else None
        if isinstance(history, str):
            assert renders.after(request, tools, kwargs, text, more) == expected, f"echo after {i} messages"


def scripts(arch: str) -> list[dict[str, Any]]:
    return [s for s in DEFAULT_SCRIPTS[arch] if s is not DEFAULT_SCRIPTS[arch][0]] + (
        [weather_episode("hermes"), weather_episode("llama3_json"), thinking_episode()]
    )


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("leave_out", [1, LEAVE_OUT])
def test_windows_render_every_request_of_the_real_scripts_as_the_whole_history_does(arch, leave_out):
    tokenizer = load(arch)
    renders = Renders(tokenizer, leave_out)
    for script in scripts(arch):
        play(renders, long_history(script, 8), script["tools"], {})
    assert renders.windowed > (80 if leave_out == 1 else 30)  # windows served, not only whole renders


def test_qwen3_without_thinking_extends_no_render_so_renders_whole():
    """With `enable_thinking: false` the generation prompt writes an empty `<think>` block that
    the reply does not render with: no request extends the one before (a new segment each
    turn), and no window applies."""
    renders = Renders(load("qwen3"), 1)
    script = weather_episode("hermes")
    play(renders, long_history(script, 8), script["tools"], {"enable_thinking": False})
    assert renders.windowed == 0


def test_qwen3_gets_windows_for_new_reasoning_but_not_for_reasoning_echoed_in_the_history():
    """Qwen3 drops the `<think>` of earlier turns when a user message follows them: a history
    that echoes reasoning is rendered whole; Llama-3.2's template ignores reasoning."""
    assert probe(load("qwen3"), None, {}) == Windows(plain=True, new_featured=True, featured=False)
    assert probe(load("llama"), None, {}) == Windows(plain=True, new_featured=True, featured=True)
    renders = Renders(load("qwen3"), 1)
    thinking = long_history(thinking_episode(), 12)
    play(renders, thinking, None, {})
    assert renders.windowed == 0
    without = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in thinking]
    play(renders, without, None, {})  # an agent that does not echo reasoning: the reply's view
    assert renders.windowed > 0


NUMBERING = (
    "{% for m in messages %}<|im_start|>{{ m.role }} {{ loop.index }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A template that numbers its messages: a message renders by where it stands."""
HIDING = (
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m.role == 'user' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and loop.index0 < ns.last %}(earlier){% else %}{{ m.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A template that hides every assistant turn before the last user message (as gpt-oss's drops
the analysis of earlier turns), plain ones included."""


@pytest.mark.parametrize("template", [NUMBERING, HIDING], ids=["numbering", "hiding"])
def test_a_template_that_renders_by_position_gets_no_windows_and_renders_whole(template):
    qwen3 = fresh("qwen3")
    qwen3.hf.chat_template = template
    tokenizer = Tokenizer(qwen3.hf)
    assert probe(tokenizer, None, {}) == Windows(False, False, False)
    renders = Renders(tokenizer, 1)
    script = long_history(weather_episode("hermes"), 6)
    play(renders, [{**m, "content": m.get("content") or "call"} for m in script], None, {})
    assert renders.windowed == 0


def test_the_window_checks_alone_refuse_a_position_dependent_template():
    """Were the probe wrong, the checks on each window would still refuse it: a numbered
    context does not end the earlier render."""
    qwen3 = fresh("qwen3")
    qwen3.hf.chat_template = NUMBERING
    render = Tokenizer(qwen3.hf).render
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(12)]
    earlier = render(messages[:9], None, {})
    assert window(render, earlier, 9, messages[:11], None, {}, True, 1) is None


def test_a_date_that_changed_renders_the_whole_history_with_the_new_date(monkeypatch):
    """Llama-3.2 writes today's date into its head: a request after midnight renders with the
    new date, as a whole render does, not the cached one."""
    renders = Renders(load("llama"), 1)
    script = weather_episode("llama3_json")
    messages = long_history(script, 6)
    play(renders, messages[:-4], script["tools"], {})
    today = chat_template_utils.datetime

    class Tomorrow:
        @staticmethod
        def now() -> datetime:
            return datetime(2099, 1, 2)

    monkeypatch.setattr(chat_template_utils, "datetime", Tomorrow)
    windowed = renders.windowed
    request = messages[:-1]
    text = renders.render(request, script["tools"], {})
    assert "02 Jan 2099" in text and text == renders.tokenizer.render(request, script["tools"], {})
    assert renders.windowed == windowed
    monkeypatch.setattr(chat_template_utils, "datetime", today)


def test_an_earlier_message_that_is_equal_in_python_but_not_in_json_renders_whole():
    """`1 == 1.0 == True` and dicts compare without key order, yet a template prints them
    apart (`tojson`): an earlier tool call echoed so is not the cached render's."""
    renders = Renders(load("qwen3"), 1)
    script = weather_episode("hermes")
    messages = long_history(script, 6)
    call = next(m for m in messages if m.get("tool_calls"))["tool_calls"][0]
    call["function"]["arguments"] = {"city": "Paris", "days": 1}
    play(renders, json.loads(json.dumps(messages[:-6])), script["tools"], {})  # copies, as requests are
    for arguments in (
        {"city": "Paris", "days": 1.0},
        {"days": 1, "city": "Paris"},
        {"city": "Paris", "days": True},
    ):
        call["function"]["arguments"] = arguments
        request = [json.loads(json.dumps(m)) for m in messages[:-5]]
        text = renders.render(request, script["tools"], {})
        assert text == renders.tokenizer.render(request, script["tools"], {})
        assert json.dumps(arguments) in text


ITEMS = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% for k, v in m.items() %}{{ k }}={{ v }};{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A template that prints each message's items in their order."""


def test_an_earlier_message_with_its_keys_in_another_order_renders_whole():
    """`==` compares dicts without key order, yet a template may print a message's items in it:
    an earlier message echoed with its keys reordered is not the cached render's."""
    qwen3 = fresh("qwen3")
    qwen3.hf.chat_template = ITEMS
    renders = Renders(Tokenizer(qwen3.hf), 1)
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(12)]
    renders.render(messages[:9], None, {})
    assert renders.render(messages[:11], None, {}) == renders.tokenizer.render(messages[:11], None, {})
    assert renders.windowed == 1  # the template renders by windows: the check below is the parent's
    request = [*messages[:11]]
    request[4] = {"content": "m4", "role": "user"}
    text = renders.render(request, None, {})
    assert text == renders.tokenizer.render(request, None, {}) and "content=m4;role=user" in text


def test_a_long_conversation_through_the_proxy_records_the_ids_of_the_whole_renders(tmp_path):
    """In process, before the stand-in vLLM: 30 turns, rendered by windows from about the
    tenth; the record is one segment, and each turn's prompt ids are the tokenization of the
    whole render of its request."""
    with upstream() as stand_in, proxy(*stand_in, tmp_path / "long.db") as served:
        agent = Agent(PARENT)
        for turn in range(30):
            served.turn(agent, f"Step {turn}: what next?", f"Do step {turn + 1}, then report.", "long")
        [trajectory] = served.close("long", 1.0)
    tokenizer = served.tokenizer
    for k, turn in enumerate(trajectory["turns"]):
        request = agent.history[: 2 + 2 * k]
        prompt = tokenizer.encode(tokenizer.render(request, None, {}))
        assert trajectory["token_ids"][: turn["completion_start"]] == prompt, f"turn {k}"
