"""One-line setups that point unchanged agents at molt-proxy.

`integrations.session` needs only `openai` and `httpx`; the other modules (`langchain_chat`,
`agents_sdk`, `pydantic_ai_model`, `smolagents_model`, `dspy_lm`) import their framework, so
import them only where it is installed (`litellm_params` imports nothing but the session).
"""

from integrations.session import MoltSession, amolt_session, create_session, molt_session

__all__ = ["MoltSession", "amolt_session", "create_session", "molt_session"]
