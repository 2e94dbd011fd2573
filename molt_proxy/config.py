"""One settings object: every default and cross-field check of the proxy in one place."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(slots=True)
class Settings:
    model: str
    """Path (or id) of the served model: its tokenizer and chat template are the proxy's."""
    upstreams: list[str] = field(default_factory=list)
    """Base URLs of running vLLM servers (`--upstream`, repeatable): the replicas. Empty:
    `serve` launches `replicas` vLLM servers itself and fills this in."""
    replicas: int = 1
    """How many vLLM servers `serve` launches when no upstream is given (`--replicas`)."""
    health_interval_s: float = 5.0
    """Seconds between health probes of the replicas (`--health-interval`)."""
    host: str = "127.0.0.1"
    port: int = 8000
    db_path: Path = Path("molt-proxy.db")
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    admin_key: str | None = None
    """When set, session, reward and trajectory routes need `Authorization: Bearer <key>`
    (a session-scoped key may act on its own session)."""
    max_request_bytes: int = 16 * 1024 * 1024
    verify_prompt_ids: bool = False
    """Ask vLLM to echo the prompt ids and fail the turn if they differ from what was sent."""
    upstream_timeout_s: float = 600.0
    session_ttl_s: float = 3600.0
    """A session with no turn for this long is closed unrewarded."""

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError("replicas must be at least 1")
        if self.upstreams and self.replicas != 1:
            # --replicas launches vLLM; with running servers each replica is one URL.
            raise ValueError("give --upstream URLs or --replicas, not both")
        if self.health_interval_s <= 0:
            raise ValueError("health_interval_s must be positive")
        if self.session_ttl_s <= 0:
            raise ValueError("session_ttl_s must be positive")
        if self.max_request_bytes <= 0:
            raise ValueError("max_request_bytes must be positive")
        self.db_path = Path(self.db_path)
