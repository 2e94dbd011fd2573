"""smolagents on molt-proxy: its OpenAI model on one session.

`OpenAIModel` (alias `OpenAIServerModel`) speaks Chat Completions to any `api_base`. A
`ToolCallingAgent` sends every step with `tool_choice: "required"`, which the proxy enforces
by constrained decoding (each such turn is recorded `constrained`), and folds its tool calls
and observations into text, so each step renders a new history: a new chain (segment) of the
one session this model is bound to.
"""

from __future__ import annotations

from typing import Any

from smolagents import OpenAIModel

from integrations.session import MoltSession


def openai_model(session: MoltSession, model: str = "default", **kwargs: Any) -> OpenAIModel:
    """`OpenAIModel(model, api_base=..., api_key=...)` for `session`; `kwargs` (seed,
    max_tokens, ...) go into every request, as smolagents passes them. `model` is only a label."""
    return OpenAIModel(model, api_base=session.base_url, api_key=session.api_key, **kwargs)
