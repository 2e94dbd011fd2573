"""The OpenAI Agents SDK on molt-proxy: its Chat Completions model on one session.

The SDK's default model speaks the Responses API, which the proxy does not serve; its
`OpenAIChatCompletionsModel` speaks Chat Completions through any `AsyncOpenAI` client. Its
tracing uploads spans to OpenAI with the client's key, which here is a session key, so a run
through `run_config(session)` has tracing off.
"""

from __future__ import annotations

from typing import Any

from agents import OpenAIChatCompletionsModel, RunConfig

from integrations.session import MoltSession


def chat_completions_model(session: MoltSession, model: str = "default") -> OpenAIChatCompletionsModel:
    """The SDK's Chat Completions model on `session.async_client`; `model` is only a label."""
    return OpenAIChatCompletionsModel(model=model, openai_client=session.async_client)


def run_config(session: MoltSession, model: str = "default", **kwargs: Any) -> RunConfig:
    """`Runner.run(agent, input, run_config=run_config(s))`: every agent of the run (handoffs
    included) uses the session's model, and nothing is traced."""
    return RunConfig(model=chat_completions_model(session, model), tracing_disabled=True, **kwargs)
