"""What the proxy serves, as an OpenAI-compatible harness must name it.

mini-swe-agent, OpenCode and Qwen Code send a model name with every request and size their
context by it, and the proxy answers only to the names it serves (`--served-model-name`, or
the name vLLM serves the model under). Each adapter asks the attempt's own session for them,
so the same adapter works in front of any proxy without a flag of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from integrations.session import MoltSession


@dataclass(frozen=True)
class ServedModel:
    name: str
    """The first name of `GET /v1/models`: the one replies carry."""
    max_model_len: int | None
    """The context length in tokens, where vLLM reports it."""


def served_model(session: MoltSession) -> ServedModel:
    """`GET {session.base_url}/models` with the session key."""
    response = httpx.get(
        f"{session.base_url}/models",
        headers={"Authorization": f"Bearer {session.api_key}"},
        timeout=session.timeout_s,
    )
    response.raise_for_status()
    models = response.json()["data"]
    if not models:
        raise RuntimeError(f"{session.base_url}/models lists no model")
    return ServedModel(models[0]["id"], models[0].get("max_model_len"))
