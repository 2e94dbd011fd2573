"""What the proxy tells operators: its Prometheus metrics (`GET /metrics`) and one log line per
request (`logs.py` formats it, text or JSON).

Each app has its own `Telemetry` with its own registry (not prometheus_client's global one), so
several apps in one process (the in-process tests) count apart. Counters start from zero with
the process, as Prometheus expects.

The request path reports through small hooks. `Instrument`, the outermost middleware, counts
and times every request and opens a `RequestFacts` in a context variable; code deep in the
path (`sessions.py` when it records a turn, `replicas.py` around each call to vLLM) fills it in
with `turn_recorded` and `upstream_called`, which find the request's `Telemetry` there, so no
part of the path holds a reference to it. Outside a request the hooks do nothing. What is read
off the proxy's state (open sessions, replica health, weight version) is read at scrape time.

The log line names the session, segment, turn, token counts, latency, replica and status of a
request; never its messages or its key.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from molt_proxy import auth
from molt_proxy.stitching import PromptPlan
from molt_proxy.types import Segment, Trajectory

log = logging.getLogger("molt_proxy.requests")

CHAIN_REASONS = ("new_conversation", "rewrite")
"""Why a session opens a chain beyond its first, its request's render extending none of its
chains (`stitching.py`): `opened_reason` tells them apart."""
TRAJECTORY_STATUSES = ("rewarded", "unrewarded", "side")
TOKEN_KINDS = ("prompt", "sampled")
UNMATCHED = "unmatched"
"""The route label of requests that matched no route (keeps the label set bounded)."""


@dataclass(slots=True)
class RequestFacts:
    """What the request path learned about one request, for its log line."""

    telemetry: Telemetry
    session: str | None = None
    segment: int | None = None
    turn: int | None = None
    """The turn's index in its segment (0: the chain's first)."""
    prompt_tokens: int = 0
    """Prompt ids sent to vLLM (the whole prompt, as `usage.prompt_tokens`)."""
    sampled_tokens: int = 0
    replica: str | None = None
    """The vLLM replica that served it (the last one tried)."""
    upstream_s: float = 0.0
    """Seconds spent waiting on vLLM, every try included."""


CURRENT: ContextVar[RequestFacts | None] = ContextVar("molt_proxy_request", default=None)


class Telemetry:
    """One app's metrics. `open_sessions` and `replicas` are read at each scrape."""

    def __init__(self, open_sessions: Callable[[], int], replicas: Callable[[], list[dict[str, Any]]]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "molt_proxy_requests",
            "HTTP requests answered, by route and status",
            ["route", "status"],
            registry=r,
        )
        self.turns = Counter(
            "molt_proxy_turns", "Turns recorded (completions sampled and stored)", registry=r
        )
        self.chains = Counter(
            "molt_proxy_chains_opened",
            "Chains (segments) a session opened beyond its first, by why",
            ["reason"],
            registry=r,
        )
        self.trajectories = Counter(
            "molt_proxy_trajectories",
            "Trajectories finalized, by how the session closed",
            ["status"],
            registry=r,
        )
        self.tokens = Counter(
            "molt_proxy_tokens", "Tokens: prompt ids sent to vLLM, ids it sampled", ["kind"], registry=r
        )
        self.in_flight = Gauge("molt_proxy_in_flight_requests", "HTTP requests being answered", registry=r)
        self.request_seconds = Histogram(
            "molt_proxy_request_seconds", "Time to answer a request, to its last byte", ["route"], registry=r
        )
        self.upstream_seconds = Histogram(
            "molt_proxy_upstream_seconds", "Time waiting on vLLM per call, to its last token", registry=r
        )
        self.refresh_seconds = Histogram(
            "molt_proxy_refresh_seconds", "Time to load new weights into every replica", registry=r
        )
        for reason in CHAIN_REASONS:
            self.chains.labels(reason)
        for status in TRAJECTORY_STATUSES:
            self.trajectories.labels(status)
        self.prompt_tokens, self.sampled_tokens = (self.tokens.labels(kind) for kind in TOKEN_KINDS)
        """The token counter's two series, looked up once (`_series` says why)."""
        r.register(_Live(open_sessions, replicas))

    def scrape(self) -> bytes:
        return generate_latest(self.registry)

    def closed(self, trajectories: list[Trajectory]) -> None:
        """A session closed into these trajectories."""
        for trajectory in trajectories:
            self.trajectories.labels(trajectory.status.value).inc()

    def refreshed(self, seconds: float) -> None:
        self.refresh_seconds.observe(seconds)


class _Live(Collector):
    """Gauges read off the proxy at scrape time."""

    def __init__(self, open_sessions: Callable[[], int], replicas: Callable[[], list[dict[str, Any]]]):
        self.open_sessions, self.replicas = open_sessions, replicas

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("molt_proxy_open_sessions", "Sessions open now", value=self.open_sessions())
        replicas = self.replicas()
        healthy = GaugeMetricFamily(
            "molt_proxy_replica_healthy", "1 if the vLLM replica takes requests", labels=["replica"]
        )
        for replica in replicas:
            healthy.add_metric([replica["url"]], 1.0 if replica["healthy"] else 0.0)
        yield healthy
        version = max((r["weight_version"] or 0 for r in replicas), default=0)
        yield GaugeMetricFamily(
            "molt_proxy_weight_version",
            "Newest weights a replica serves (0: boot weights)",
            value=version,
        )


def opened_reason(segments: Sequence[Segment], plan: PromptPlan) -> str | None:
    """Why the planned turn opens a chain beyond the session's first; None: it does not.

    `rewrite`: its prompt starts with the whole first prompt of one of `segments` (the
    messages that chain began with: system prompt, tools, first user message) and diverges
    later (or stops there): an edited history, a reply echoed back different in meaning
    (`echo.py`), a first turn asked again.
    `new_conversation`: it diverges from each within that first prompt: a sub-agent, a fresh
    prompt, a history compacted into a new first message.

    Read off the ids the plan already holds (the whole render, tokenized), compared as int
    arrays in C: no second render, no decoding. Equal ids mean equal bytes; the converse
    fails only where the tokenizer merges across the end of that first prompt (the template's
    generation prompt), which would count a rewrite as a new conversation.
    """
    if plan.segment is not None or not segments:
        return None
    ids = array("i", plan.ids)
    for segment in segments:
        head = segment.turns[0].completion_start if segment.turns else 0
        if head and segment.token_ids[:head] == ids[:head]:
            return "rewrite"
    return "new_conversation"


# -- hooks for the request path ---------------------------------------------------------------


def turn_recorded(
    session: str, segment: int, turn: int, prompt_tokens: int, sampled_tokens: int, opened: str | None
) -> None:
    """A turn was recorded: `turn` is its index in chain `segment` (0 opened the chain);
    `opened`: why it opened a chain beyond the session's first (`opened_reason`), if it did."""
    facts = CURRENT.get()
    if facts is None:
        return
    facts.session, facts.segment, facts.turn = session, segment, turn
    facts.prompt_tokens, facts.sampled_tokens = prompt_tokens, sampled_tokens
    metrics = facts.telemetry
    metrics.turns.inc()
    metrics.prompt_tokens.inc(prompt_tokens)
    metrics.sampled_tokens.inc(sampled_tokens)
    if opened is not None:
        metrics.chains.labels(opened).inc()


def upstream_called(replica: str, seconds: float) -> None:
    """One call to a vLLM replica ended (answered, failed or closed) after `seconds`."""
    facts = CURRENT.get()
    if facts is None:
        return
    facts.replica = replica
    facts.upstream_s += seconds
    facts.telemetry.upstream_seconds.observe(seconds)


# -- the middleware and the route ------------------------------------------------------------


class Instrument:
    """Counts, times and logs every request but the scrape itself (as vLLM's `/metrics`)."""

    def __init__(self, app: ASGIApp, telemetry: Telemetry):
        self.app, self.telemetry = app, telemetry
        self._by_route: dict[tuple[str, int], tuple[Counter, Histogram]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == "/metrics":
            return await self.app(scope, receive, send)
        status = 500  # what the client sees if the app fails before it answers
        started = time.monotonic()
        facts = RequestFacts(self.telemetry)
        token = CURRENT.set(facts)

        async def sent(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.telemetry.in_flight.inc()
        try:
            await self.app(scope, receive, sent)
        finally:
            self.telemetry.in_flight.dec()
            CURRENT.reset(token)
            self._done(scope, facts, status, time.monotonic() - started)

    def _done(self, scope: Scope, facts: RequestFacts, status: int, seconds: float) -> None:
        route = scope.get("route")
        path = getattr(route, "path", UNMATCHED)
        counted, timed = self._series(path, status)
        counted.inc()
        timed.observe(seconds)
        session = facts.session or scope.get("path_params", {}).get("session_id")
        fields = {
            "method": scope["method"],
            "route": path,
            "status": status,
            "latency_s": round(seconds, 6),
            "session": session,
            "segment": facts.segment,
            "turn": facts.turn,
            "prompt_tokens": facts.prompt_tokens,
            "sampled_tokens": facts.sampled_tokens,
            "replica": facts.replica,
            "upstream_s": round(facts.upstream_s, 6),
        }
        text = (
            f"latency_s={fields['latency_s']} session={session} segment={facts.segment} turn={facts.turn}"
            f" prompt_tokens={facts.prompt_tokens} sampled_tokens={facts.sampled_tokens}"
            f" replica={facts.replica} upstream_s={fields['upstream_s']}"
        )
        log.info("%s %s %d %s", scope["method"], path, status, text, extra={"fields": fields})

    def _series(self, path: str, status: int) -> tuple[Counter, Histogram]:
        """The request counter's and the latency histogram's series of a route and status,
        looked up once each: prometheus_client's `labels()` checks and locks on every call.
        Routes and statuses are few (`UNMATCHED` stands for every path no route serves)."""
        key = (path, status)
        found = self._by_route.get(key)
        if found is None:
            telemetry = self.telemetry
            found = (telemetry.requests.labels(path, str(status)), telemetry.request_seconds.labels(path))
            self._by_route[key] = found
        return found


router = APIRouter()


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    """Prometheus text format; with keys on, the admin key's, as for `/v1/trajectories`."""
    proxy = request.app.state.proxy
    proxy.principal(request, auth.ADMIN_ONLY)
    return Response(proxy.telemetry.scrape(), media_type=CONTENT_TYPE_LATEST)
