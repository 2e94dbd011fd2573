"""pydantic-ai on molt-proxy: its OpenAI Chat Completions model on one session.

`OpenAIChatModel` speaks Chat Completions to any `base_url` through its `OpenAIProvider`;
pointing the provider at the session's URL with the session key is all it takes, and every
agent on the model (`Agent(chat_model(s), tools=..., output_type=...)`) is recorded unchanged.
pydantic-ai sends a tool call's arguments back compacted (`{"city":"Paris"}` for a sampled
`{"city": "Paris"}`); the proxy restores the sampled bytes, so an episode stays one segment.
"""

from __future__ import annotations

from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from integrations.session import MoltSession


def chat_model(session: MoltSession, model: str = "default") -> OpenAIChatModel:
    """`OpenAIChatModel` on `session` (its URL and key); `model` is only a label. Sampling
    settings go where pydantic-ai takes them (`model_settings={"seed": 7, ...}`)."""
    return OpenAIChatModel(model, provider=OpenAIProvider(base_url=session.base_url, api_key=session.api_key))
