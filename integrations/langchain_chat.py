"""LangChain / LangGraph on molt-proxy: a `ChatOpenAI` bound to one session.

`ChatOpenAI` speaks Chat Completions to any `base_url`; pointing it at the session's URL with
the session key is all it takes, and every LangChain or LangGraph agent built on the model
(`create_react_agent(chat_model(s), tools)`) is recorded unchanged, streamed or not (LangGraph's
`stream_mode="messages"` streams). The Responses API is off: the proxy serves Chat Completions.
"""

from __future__ import annotations

from typing import Any

from langchain_openai import ChatOpenAI

from integrations.session import MoltSession


def chat_model(session: MoltSession, model: str = "default", **kwargs: Any) -> ChatOpenAI:
    """`ChatOpenAI(base_url=..., api_key=..., model=...)` for `session`; `kwargs` (seed,
    temperature, max_tokens, ...) pass through. The proxy serves whatever model vLLM runs,
    so `model` is only a label."""
    return ChatOpenAI(
        base_url=session.base_url,
        api_key=session.api_key,
        model=model,
        use_responses_api=False,
        **kwargs,
    )
