"""The OpenAI Agents SDK on molt-proxy: its default Responses model, or its Chat Completions
model, on one session.

The SDK's default model (`OpenAIResponsesModel`) speaks the Responses API and its
`OpenAIChatCompletionsModel` speaks Chat Completions; the proxy serves both, through any
`AsyncOpenAI` client. Its tracing uploads spans to OpenAI with the client's key, which here is
a session key, so a run through `run_config(session)` has tracing off.
"""

from __future__ import annotations

from typing import Any, Literal

from agents import Model, OpenAIChatCompletionsModel, OpenAIResponsesModel, RunConfig

from integrations.session import MoltSession

Api = Literal["responses", "chat_completions"]


def chat_completions_model(session: MoltSession, model: str = "default") -> OpenAIChatCompletionsModel:
    """The SDK's Chat Completions model on `session.async_client`; `model` is only a label."""
    return OpenAIChatCompletionsModel(model=model, openai_client=session.async_client)


def responses_model(session: MoltSession, model: str = "default") -> OpenAIResponsesModel:
    """The SDK's default model, the Responses API's, on `session.async_client`."""
    return OpenAIResponsesModel(model=model, openai_client=session.async_client)


def run_config(
    session: MoltSession, model: str = "default", api: Api = "responses", **kwargs: Any
) -> RunConfig:
    """`Runner.run(agent, input, run_config=run_config(s))`: every agent of the run (handoffs
    included) uses the session's model (the SDK's default, Responses; or `api=
    "chat_completions"`), and nothing is traced."""
    chosen: Model = (
        responses_model(session, model) if api == "responses" else chat_completions_model(session, model)
    )
    return RunConfig(model=chosen, tracing_disabled=True, **kwargs)
