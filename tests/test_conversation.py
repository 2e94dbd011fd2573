"""A chat request decodes into a format-neutral `Conversation` plus what stays OpenAI's: pure,
no server, no tokenizer."""

from __future__ import annotations

import json

import pytest

from molt_proxy.errors import BadRequest
from molt_proxy.wire.openai import decode_chat_request

HISTORY = [
    {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "ask the tool",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def _decode(**fields: object):
    return decode_chat_request(json.dumps({"model": "m", "messages": HISTORY, **fields}).encode())


def test_a_chat_request_becomes_a_conversation_with_its_sampling_and_session_hints():
    call = _decode(
        tools=TOOLS,
        temperature=0.5,
        max_completion_tokens=7,
        stop="END",
        chat_template_kwargs={"enable_thinking": False},
        metadata={"session_id": "s1"},
    )
    conversation = call.conversation
    assert conversation.messages[0]["content"] == "weather?"
    assert conversation.tools == TOOLS
    assert conversation.template_kwargs == {"enable_thinking": False}
    assert conversation.max_tokens == 7
    assert "max_tokens" not in conversation.sampling  # the turn decides it from the prompt
    assert conversation.sampling["temperature"] == 0.5 and conversation.sampling["top_k"] == 0
    assert conversation.sampling["stop"] == "END" and conversation.sampling["detokenize"] is True
    assert (conversation.session_id, conversation.call_ids) == ("s1", frozenset({"call_1"}))
    assert conversation.parser_request.tools[0].function.name == "f"
    assert (call.stream, call.include_usage) == (False, False)


def test_streaming_and_its_usage_chunk_stay_with_the_openai_call():
    call = _decode(stream=True, stream_options={"include_usage": True})
    assert (call.stream, call.include_usage) == (True, True)
    assert call.conversation.session_id is None and call.conversation.max_tokens is None


@pytest.mark.parametrize("value", [7, ""])
def test_a_malformed_metadata_session_id_is_refused_at_decode(value):
    with pytest.raises(BadRequest) as refused:
        _decode(metadata={"session_id": value})
    assert refused.value.param == "metadata.session_id"


def test_echoed_reasoning_reaches_the_template_as_sent():
    """vLLM's validator renames `reasoning_content` in the dicts it validates; the chat
    template reads `reasoning_content`, so the conversation keeps the agent's own dicts."""
    assistant = _decode(tools=TOOLS).conversation.messages[1]
    assert assistant["reasoning_content"] == "ask the tool" and "reasoning" not in assistant
