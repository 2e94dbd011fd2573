"""LiteLLM on molt-proxy: the parameters that send its calls to one session.

LiteLLM's `openai/` provider speaks Chat Completions to any `api_base`; with the session's URL
and key, `litellm.completion(**litellm_params(s), messages=...)` (or `acompletion`, or a
`Router` entry's `litellm_params`) is recorded in the session like any OpenAI client.
"""

from __future__ import annotations

from integrations.session import MoltSession


def litellm_params(session: MoltSession, model: str = "default") -> dict[str, str]:
    """`{"model": "openai/<model>", "api_base": ..., "api_key": ...}` for `session`; `model`
    is only a label."""
    return {"model": f"openai/{model}", "api_base": session.base_url, "api_key": session.api_key}
