"""One settings object: every default and cross-field check of the proxy in one place."""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from molt_proxy.sampling import check_pins
from molt_proxy.side import DEFAULT_SIDE_REQUESTS, check_rules

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


@dataclass(slots=True)
class Settings:
    model: str
    """Path (or id) of the served model: its tokenizer and chat template are the proxy's."""
    served_model_name: list[str] = field(default_factory=list)
    """The names the model is served under, as in `vllm serve` (`--served-model-name`): replies
    carry the first as `model`, and `GET /v1/models` lists them all. Empty: the name vLLM
    serves it under (a vLLM that `serve` launches serves it as `model`)."""
    upstreams: list[str] = field(default_factory=list)
    """Base URLs of running vLLM servers (`--upstream`, repeatable): the replicas. Empty:
    `serve` launches `replicas` vLLM servers itself and fills this in."""
    replicas: int = 1
    """How many vLLM servers `serve` launches when no upstream is given (`--replicas`)."""
    ray_address: str | None = None
    """A Ray cluster (`--ray-address`): without `upstreams`, the `replicas` vLLM servers run in
    Ray actors placed by Ray (`ray_replicas.py`); `--train`'s trainer joins it too."""
    replica_resources: dict[str, float] = field(default_factory=dict)
    """Ray resources each replica actor asks for (`--replica-resources '{"GPU": 1}'`)."""
    health_interval_s: float = 5.0
    """Seconds between health probes of the replicas (`--health-interval`)."""
    health_timeout_s: float = 10.0
    """A replica whose /health gives no answer within this many seconds is taken out; one that
    `serve` launched is also killed and relaunched (`--health-timeout`)."""
    max_restarts: int = 5
    """Relaunches of a vLLM that `serve` launched allowed within 10 minutes; past them it stays
    down (`--max-restarts`)."""
    host: str = "127.0.0.1"
    port: int = 8000
    db_path: Path = Path("molt-proxy.db")
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    tool_strict_level: str = "auto"
    """`vllm serve --tool-strict-level`: how far tool calls are constrained. `auto`: forced calls
    (and a `strict: true` tool's calls) follow the call markup, only strict tools' arguments
    their schema; `function`: every request with tools gets the markup constraint; `parameter`:
    every tool's arguments follow its schema too (`constraints.py`; docs/sampling.md, Constrained
    decoding)."""
    admin_key: str | None = field(default=None, repr=False)
    """When set, every route that writes or reads training data needs a key (`auth.py`);
    unset, the proxy is open. Never in a repr, so never in a log."""
    agent_keys: list[str] = field(default_factory=list, repr=False)
    """Keys that may create sessions and chat on and reward their own (`--agent-key`)."""
    max_request_bytes: int = 16 * 1024 * 1024
    allowed_origins: list[str] = field(default_factory=list)
    """Web origins whose pages may call the proxy from a browser, besides its own and loopback
    ones (`--allowed-origins`; `*`: any). A request with any other `Origin` is refused
    (`molt_proxy.browsers`)."""
    allowed_hosts: list[str] = field(default_factory=list)
    """Names the proxy may be addressed by in `Host`, besides its bound address, IP addresses and
    localhost (`--allowed-hosts`; `*`: any): a DNS-rebinding page's requests name its own
    domain. A proxy bound to a non-loopback `host` checks `Host` only when this is given."""
    reward_range: tuple[float, float] = (-1e6, 1e6)
    """Rewards (final and per turn) outside [low, high] are refused with a 400 (`--reward-range`):
    inside it every advantage estimator stays finite."""
    verify_prompt_ids: bool = False
    """Ask vLLM to echo the prompt ids and fail the turn if they differ from what was sent."""
    upstream_timeout_s: float = 600.0
    session_ttl_s: float = 3600.0
    """A session with no turn for this long is closed unrewarded."""
    lora_name: str | None = None
    """Sample every turn from the trainer's newest LoRA adapter of this name, and take weight
    pushes as adapters (`molt_proxy.lora`; `--lora-name`). None: full weights."""
    side_requests: list[str] = field(default_factory=lambda: list(DEFAULT_SIDE_REQUESTS))
    """Regular expressions: a request without tools whose system prompt matches one is a side
    request, served but kept out of training (`molt_proxy.side`; `--side-request`, repeatable;
    given with no value: none). Default: Claude Code's title request."""
    sampling: dict[str, float | int] = field(default_factory=dict)
    """Sampling fields pinned for every turn, whatever agents send (`--sampling
    temperature=1,top_p=1`; `molt_proxy.sampling.PINNABLE` lists the fields). Each turn's
    record names the fields pinned. Empty: agents choose."""

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError("replicas must be at least 1")
        if self.upstreams and self.replicas != 1:
            # --replicas launches vLLM; with running servers each replica is one URL.
            raise ValueError("give --upstream URLs or --replicas, not both")
        if self.replica_resources and not (self.ray_address and not self.upstreams):
            raise ValueError("--replica-resources places replicas on Ray: give --ray-address, not --upstream")
        for name in ("health_interval_s", "health_timeout_s", "session_ttl_s", "max_request_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.max_restarts < 0:
            raise ValueError("max_restarts must not be negative")
        if "" in self.served_model_name:
            raise ValueError("a served model name must not be empty")
        if self.admin_key == "" or "" in self.agent_keys:
            raise ValueError("an API key must not be empty")
        if self.agent_keys and self.admin_key is None:
            raise ValueError("agent keys need an admin key: without one every route is open")
        if self.lora_name == "":
            raise ValueError("a LoRA name must not be empty")
        self._check_turn_rules()
        check_pins(self.sampling)
        check_rules(self.side_requests)
        self.db_path = Path(self.db_path)

    def _check_turn_rules(self) -> None:
        """What turns and rewards are held to: the reward range and vLLM's tool strict level."""
        low, high = self.reward_range
        if not (math.isfinite(low) and math.isfinite(high) and low < high):
            raise ValueError("--reward-range takes two finite numbers LOW < HIGH")
        if self.tool_strict_level not in ("auto", "function", "parameter"):
            raise ValueError(
                f"tool_strict_level must be auto, function or parameter, got {self.tool_strict_level!r}"
            )


def default(cls: type[DataclassInstance], name: str) -> Any:
    """The default of field `name` of dataclass `cls`: the CLI's flags take their defaults
    from here, so that each default is written once, on its field."""
    f = cls.__dataclass_fields__[name]
    return f.default_factory() if f.default_factory is not MISSING else f.default
