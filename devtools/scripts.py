"""The scripts the tiny models learn, and the exact text of a reply as a model writes it.

A random model never emits a tool call or a `<think>` block, yet the proxy's parsing and
stitching paths need real ones, and replies must never be faked. So the tiny models are
taught fixed conversations (`DEFAULT_SCRIPTS`, see `devtools.teaching`); tests then play
those conversations through the proxy and check every reply against the script.
"""

from __future__ import annotations

import json
from typing import Any, Literal, NotRequired, TypedDict

from devtools.library_scripts import library_scripts
from devtools.tokenizers import Arch

Family = Literal["hermes", "llama3_json"]
"""vLLM's `--tool-call-parser` name, which also fixes the reply format the model writes."""


class Conversation(TypedDict):
    """One scripted chat: every assistant message in it is a reply the model must learn."""

    family: Family
    tools: list[dict[str, Any]] | None
    messages: list[dict[str, Any]]
    vary: NotRequired[dict[str, list[str]]]
    """Text in the messages and tools that differs from run to run (a date, a folder), with what
    teaching shows in its place: on teaching day k, its k-th value (cyclically)."""
    weight: NotRequired[float]
    """This conversation's share where conversations part ways (default 1): conversations that
    share a prompt and differ in a reply are taught as a mix, the model writing each reply with
    probability its weight (weights over such a set sum to 1; `devtools.line_count` teaches a
    right and a wrong first call, 0.1 and 0.9). A reply counts as learned once p(reply) reaches
    `stop_prob` times its weight."""


# --- Replies as the model writes them ---------------------------------------------------


def _arguments_text(arguments: str | dict[str, Any]) -> str:
    """`arguments` as the templates print them: `tojson` of the object, default separators.

    vLLM hands templates a dict (and its parsers re-serialise the same way), so this is the
    one spelling that survives a re-render and a parse unchanged.
    """
    value = json.loads(arguments) if isinstance(arguments, str) else arguments
    return json.dumps(value, ensure_ascii=False)


def _call_json(function: dict[str, Any], key: str) -> str:
    """`{"name": NAME, KEY: ARGS}`, spelled as both templates spell it (name printed raw)."""
    return f'{{"name": "{function["name"]}", "{key}": {_arguments_text(function["arguments"])}}}'


def render_reply(message: dict[str, Any], family: Family) -> str:
    """The exact text the model must sample for an OpenAI assistant `message`, EOS excluded.

    It is what the model's own chat template prints for that message in history, so the
    proxy's segment continues, and what vLLM's `family` parser reads back into the message.
    Qwen3 (hermes) prints a `<think>` block only for messages after the last user turn, so a
    reply with `reasoning_content` round-trips until the next user message (by design).
    """
    content = message.get("content") or ""
    calls = [call["function"] for call in message.get("tool_calls") or []]
    if family == "hermes":
        reasoning = message.get("reasoning_content")
        head = f"<think>\n{reasoning}\n</think>\n\n" if reasoning else ""
        blocks = [f"<tool_call>\n{_call_json(f, 'arguments')}\n</tool_call>" for f in calls]
        return head + content + ("\n" if content and blocks else "") + "\n".join(blocks)
    # Llama-3.2's template prints one call and drops content beside it, and trims content.
    if message.get("reasoning_content") or len(calls) > 1 or (calls and content):
        raise ValueError("llama3_json replies are plain content or exactly one tool call")
    return _call_json(calls[0], "parameters") if calls else content.strip()


def as_echoed(message: dict[str, Any], family: Family) -> dict[str, Any]:
    """A scripted message as an agent sends it back in its history: an assistant message as
    vLLM's `family` parsers return `render_reply(message)`. After a Qwen3 `<think>` block the
    content keeps the two newlines that end the block, and the template prints content as given
    when the reasoning comes apart, so the next turn is taught after those very bytes."""
    if family == "hermes" and message.get("reasoning_content") and message.get("content"):
        return {**message, "content": "\n\n" + message["content"]}
    return message


# --- Scripts ----------------------------------------------------------------------------

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city name."}},
            "required": ["city"],
        },
    },
}


def _weather_call(call_id: str, city: str) -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
    }


def weather_episode(family: Family) -> Conversation:
    """Five tool-using turns: parallel calls (one for Llama, whose template allows only
    one per message), answers from tool results, a follow-up call, a closing reply."""
    if family == "hermes":
        question = "What is the weather in Paris and London?"
        calls = [("call_0", "Paris", "Sunny, 22 C."), ("call_1", "London", "Rainy, 14 C.")]
        answer = "It is sunny and 22 C in Paris, and rainy and 14 C in London."
    else:
        question = "What is the weather in Paris?"
        calls = [("call_0", "Paris", "Sunny, 22 C.")]
        answer = "It is sunny and 22 C in Paris."
    tokyo = f"call_{len(calls)}"
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a weather assistant."},
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [_weather_call(i, c) for i, c, _ in calls]},
        *({"role": "tool", "tool_call_id": i, "content": result} for i, _, result in calls),
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And Tokyo?"},
        {"role": "assistant", "content": None, "tool_calls": [_weather_call(tokyo, "Tokyo")]},
        {"role": "tool", "tool_call_id": tokyo, "content": "Cloudy, 18 C."},
        {"role": "assistant", "content": "It is cloudy and 18 C in Tokyo."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You're welcome!"},
    ]
    return {"family": family, "tools": [WEATHER_TOOL], "messages": messages}


def thinking_episode() -> Conversation:
    """Two reasoning turns for Qwen3, whose template drops the first `<think>` block once the
    second user message arrives: the history rewrite that must seal a segment."""
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "reasoning_content": "The user greets me.", "content": "Hello!"},
        {"role": "user", "content": "How are you?"},
        {"role": "assistant", "reasoning_content": "Answer politely.", "content": "Fine, thanks."},
    ]
    return {"family": "hermes", "tools": None, "messages": messages}


# The OpenAI Agents SDK sends every function tool with `"strict": <bool>` beside its
# parameters; Qwen3's template prints the tool as sent (vLLM's own server prints it too), so
# its prompt differs from the script's by those bytes, and a model that knows only its script
# loses it. The tiny Qwen3 model is therefore also taught the script as the SDK sends it; a
# real model needs nothing of the kind.
AGENTS_SDK_WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {**WEATHER_TOOL["function"], "strict": False},
}


DEFAULT_SCRIPTS: dict[Arch, list[Conversation]] = {
    "qwen3": [
        weather_episode("hermes"),
        thinking_episode(),
        {**weather_episode("hermes"), "tools": [AGENTS_SDK_WEATHER_TOOL]},
        # pydantic-ai's structured output, smolagents and DSPy: devtools/library_scripts.py.
        *library_scripts(WEATHER_TOOL),
    ],
    "llama": [weather_episode("llama3_json")],
}
"""What `build_tiny_model(teach=True)` teaches, per architecture: one Qwen3 model serves every
Qwen3 test and example (one build, one vLLM server), so it learns each agent's spelling."""
