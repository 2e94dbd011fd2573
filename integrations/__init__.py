"""One-line setups that point unchanged agents at molt-proxy.

`integrations.session` needs only `openai` and `httpx`; `integrations.langchain_chat` and
`integrations.agents_sdk` import their framework, so import them only where it is installed.
"""

from integrations.session import MoltSession, amolt_session, create_session, molt_session

__all__ = ["MoltSession", "amolt_session", "create_session", "molt_session"]
