"""One settings object: every default and cross-field check of the proxy in one place, and the
source of `serve`'s flags (`flags.py`: each field's flag, and its docstring the help).

A leaf: it imports nothing of the package's serving path, so the command line builds (and
`--help` answers) without loading it. The few checks and parsers a setting needs of its own,
which pins sampling accepts and how a side-request rule or a Ray resource set is read, live
here beside the field they guard; the modules that apply the settings take them as given.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from molt_proxy.flags import flag

DEFAULT_SIDE_REQUESTS = ("a concise, sentence-case title", "^You are a title generator")
"""Claude Code's title request; OpenCode's (1.18: "You are a title generator. You output ONLY a
thread title."), which its rollout adapter avoids anyway (`--title`)."""

PINNABLE: dict[str, type] = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "presence_penalty": float,
    "frequency_penalty": float,
    "repetition_penalty": float,
}
"""The fields `--sampling` may pin, with their types."""


def parse_pins(spec: str) -> dict[str, float | int]:
    """`"temperature=1,top_p=1"` → `{"temperature": 1.0, "top_p": 1.0}`; ValueError on an
    unknown field, a malformed pair or a value out of vLLM's range."""
    pins: dict[str, float | int] = {}
    for pair in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, value = (part.strip() for part in pair.partition("="))
        if not sep or not name or not value:
            raise ValueError(f"sampling pin {pair!r} is not NAME=VALUE")
        kind = PINNABLE.get(name)
        if kind is None:
            raise ValueError(f"cannot pin sampling field {name!r}; known: {', '.join(PINNABLE)}")
        try:
            pins[name] = kind(value)
        except ValueError:
            raise ValueError(
                f"sampling pin {name}={value!r} is not {'an integer' if kind is int else 'a number'}"
            ) from None
    check_pins(pins)
    return pins


def check_pins(pins: Mapping[str, float | int]) -> None:
    """Known fields with values vLLM accepts (`SamplingParams._verify_args`); ValueError if not."""
    for name, value in pins.items():
        if name not in PINNABLE:
            raise ValueError(f"cannot pin sampling field {name!r}; known: {', '.join(PINNABLE)}")
        accepts, allowed = _RANGES.get(name, _PENALTY)
        if not (math.isfinite(value) and accepts(value)):
            raise ValueError(f"sampling pin {name}={value} is out of range: {allowed}")


_PENALTY = (lambda v: -2.0 <= v <= 2.0, "[-2, 2]")
_RANGES = {
    "temperature": (lambda v: 0.0 <= v <= 2.0, "[0, 2]"),
    "top_p": (lambda v: 0.0 < v <= 1.0, "(0, 1]"),
    "top_k": (lambda v: v >= -1, "-1 or 0 (off), or at least 1"),
    "min_p": (lambda v: 0.0 <= v <= 1.0, "[0, 1]"),
    "repetition_penalty": (lambda v: v > 0.0, "above 0"),
}


def check_rules(rules: Sequence[str]) -> None:
    """Side-request rules that are regular expressions; ValueError naming the first that is not."""
    for rule in rules:
        try:
            re.compile(rule)
        except re.error as exc:
            raise ValueError(f"--side-request {rule!r} is not a regular expression: {exc}") from None


def parse_resources(spec: str) -> dict[str, float]:
    """`--replica-resources`: a JSON object of Ray resources per replica, e.g. '{"GPU": 1}'."""
    try:
        resources = json.loads(spec)
    except ValueError:
        raise ValueError(f"{spec!r} is not JSON") from None
    if not isinstance(resources, dict) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 for v in resources.values()
    ):
        raise ValueError(f"{spec!r} is not a JSON object of resource amounts (numbers >= 0)")
    return {str(name): float(amount) for name, amount in resources.items()}


@dataclass(slots=True)
class Settings:
    """The proxy's settings: the model it serves, the vLLM replicas it serves it from, what it
    listens on and records into, and what it holds agents to."""

    model: str
    """The served model, a path or id as in `vllm serve`: its tokenizer and chat template are
    the proxy's, and a vLLM that `serve` launches loads it."""
    served_model_name: list[str] = field(default_factory=list, metadata=flag(metavar="NAME"))
    """The names the model is served under, as in `vllm serve`: replies carry the first as
    `model`, and `GET /v1/models` lists them all. Default: the name vLLM serves it under (a
    vLLM that `serve` launches: `--model`)."""
    upstreams: list[str] = field(
        default_factory=list, metadata=flag("--upstream", repeat=True, metavar="URL")
    )
    """A running vLLM server, one replica; repeat the flag for several. None given: `serve`
    launches `--replicas` vLLM servers itself."""
    replicas: int = field(default=1, metadata=flag(metavar="K"))
    """Without `--upstream`: launch K vLLM servers, each on its own port (with `--ray-address`:
    each in a Ray actor, placed by Ray)."""
    ray_address: str | None = None
    """A Ray cluster to join instead of starting one: without `--upstream`, `serve` runs its
    vLLM replicas there, in Ray actors (`ray_replicas.py`), and `--train`'s trainer joins it
    too."""
    replica_resources: dict[str, float] = field(
        default_factory=dict, metadata=flag(metavar="JSON", parse=parse_resources)
    )
    """With `--ray-address`: the Ray resources each replica's actor asks for, e.g. '{"GPU": 1}',
    or a custom resource that pins replicas to nodes. Default: none."""
    health_interval_s: float = field(default=5.0, metadata=flag(metavar="S"))
    """Seconds between health probes of the replicas."""
    health_timeout_s: float = field(default=10.0, metadata=flag(metavar="S"))
    """A replica whose /health gives no answer within S seconds is taken out; one that `serve`
    launched is also killed and relaunched."""
    max_restarts: int = field(default=5, metadata=flag(metavar="N"))
    """Relaunches of a vLLM that `serve` launched allowed within 10 minutes; past them it stays
    down."""
    upstream_timeout_s: float = field(default=600.0, metadata=flag(metavar="S"))
    """Seconds one call to a replica (a whole reply, streamed or not) may take before it fails."""
    host: str = "127.0.0.1"
    """The address the proxy listens on, as in `vllm serve`. Off loopback, set an admin key
    (docs/security.md)."""
    port: int = 8000
    """The port the proxy listens on, as in `vllm serve`."""
    db_path: Path = field(default=Path("molt-proxy.db"), metadata=flag("--db", metavar="PATH"))
    """The SQLite store of sessions, turns and trajectories; it survives restarts."""
    tool_call_parser: str | None = None
    """vLLM's tool parser name for the model (e.g. `hermes`), as in `vllm serve`: tool calls are
    read out of replies with it."""
    reasoning_parser: str | None = None
    """vLLM's reasoning parser name for the model, as in `vllm serve`: reasoning is read out of
    replies with it, and a vLLM that `serve` launches gets it too."""
    tool_strict_level: Literal["auto", "function", "parameter"] = "auto"
    """As in `vllm serve`: how far tool calls are constrained. `auto`: forced calls (and a
    `strict: true` tool's calls) follow the call markup, only strict tools' arguments their
    schema; `function`: every request with tools gets the markup constraint; `parameter`:
    every tool's arguments follow its schema too (`constraints.py`; docs/sampling.md,
    Constrained decoding)."""
    admin_key: str | None = field(default=None, repr=False)
    """When set, every route that writes or reads training data needs a key (`auth.py`), and
    this one may do everything; unset, the proxy is open. A flag is visible in `ps`: prefer
    `--admin-key-file` or $MOLT_PROXY_ADMIN_KEY. Never in a repr, so never in a log."""
    agent_keys: list[str] = field(
        default_factory=list, repr=False, metadata=flag("--agent-key", repeat=True, metavar="KEY")
    )
    """A key that may create sessions, and chat on and reward its own; repeat the flag for
    several (also `--agent-keys-file`, and $MOLT_PROXY_AGENT_KEYS, comma-separated)."""
    max_request_bytes: int = 16 * 1024 * 1024
    """A request body larger than this is refused with a 413."""
    allowed_origins: list[str] = field(default_factory=list, metadata=flag(nargs="*", metavar="ORIGIN"))
    """Web pages (e.g. https://notebook.example:8888) that may call the proxy from a browser,
    besides its own and loopback ones; `*`: any. A request with any other `Origin` is refused
    (`molt_proxy.browsers`)."""
    allowed_hosts: list[str] = field(default_factory=list, metadata=flag(nargs="*", metavar="NAME"))
    """Names the proxy may be addressed by in `Host`, besides its bound address, IP addresses and
    localhost; `*`: any. A DNS-rebinding page's requests name its own domain. A proxy bound to
    a non-loopback `--host` checks `Host` only when this is given."""
    reward_range: tuple[float, float] = field(default=(-1e6, 1e6), metadata=flag(metavar=("LOW", "HIGH")))
    """Rewards (final and per turn) outside [LOW, HIGH] are refused with a 400: inside it every
    advantage estimator stays finite."""
    verify_prompt_ids: bool = False
    """Have vLLM echo the prompt ids, and fail a turn whose ids differ from those sent."""
    session_ttl_s: float = field(default=3600.0, metadata=flag(metavar="SECONDS"))
    """A session with no turn for this long is closed, unrewarded."""
    lora_name: str | None = field(default=None, metadata=flag(metavar="NAME"))
    """Sample every turn from the trainer's newest LoRA adapter of this name, and take weight
    pushes as adapters (`molt_proxy.lora`; vLLM needs --enable-lora and
    VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, which a vLLM that `serve` launches gets); several
    proxies with names of their own may share one vLLM. Default: with `--train --lora-rank`,
    `lora`; else full weights."""
    side_requests: list[str] = field(
        default_factory=lambda: list(DEFAULT_SIDE_REQUESTS),
        metadata=flag("--side-request", nargs="*", metavar="REGEX"),
    )
    """Regular expressions: a request without tools whose system prompt matches one is a side
    request, served and recorded but kept out of the trainer's stream (`molt_proxy.side`).
    The default matches Claude Code's and OpenCode's title requests; the flag given with no
    value: none."""
    sampling: dict[str, float | int] = field(
        default_factory=dict, metadata=flag(metavar="NAME=VALUE,...", parse=parse_pins)
    )
    """Sampling fields pinned for every turn, whatever agents send (e.g. temperature=1,top_p=1;
    `PINNABLE` lists the fields): on-policy samples for training. Each turn's record names the
    fields pinned. Default: agents choose."""

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError("replicas must be at least 1")
        if self.upstreams and self.replicas != 1:
            # --replicas launches vLLM; with running servers each replica is one URL.
            raise ValueError("give --upstream URLs or --replicas, not both")
        if self.replica_resources and not (self.ray_address and not self.upstreams):
            raise ValueError("--replica-resources places replicas on Ray: give --ray-address, not --upstream")
        for name in (
            "health_interval_s",
            "health_timeout_s",
            "upstream_timeout_s",
            "session_ttl_s",
            "max_request_bytes",
        ):
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
