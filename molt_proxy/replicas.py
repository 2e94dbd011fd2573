"""Several vLLM replicas behind one proxy (DESIGN §4): placement, health, failover, weights.

- A session sticks to the replica that served its first turn, because that replica's prefix
  cache holds the session's KV; its next turn only prefills the new suffix there.
- A new session goes to the least loaded healthy replica: fewest requests in flight, then
  fewest sticky sessions (in flight is what costs latency now; sessions are what will come).
- A replica that cannot be reached (`UpstreamUnavailable`) is taken out, its sessions lose
  their stickiness, and the request is retried on another replica. This loses nothing: the
  proxy sends every turn's full exact prompt ids and records a turn only after vLLM
  answered, so the other replica re-prefills the same tokens and samples the same way.
  Any other error (a 4xx, a 5xx vLLM answered) is the request's, not the replica's, and is
  raised as it is.
- A background task probes `/health` on every replica: down ones come back, dead ones are
  noticed without waiting for a request. A replica that comes back is first given the last
  weights the trainer loaded (a restarted vLLM boots with its original weights, labelled
  version 0), so it never serves stale weights under a wrong label.
- A probe that gets no answer within the health timeout takes the replica out (a hung vLLM
  accepts connections and never answers). The probe result also goes to the replica's
  `Supervision`, if the proxy launched it (`launcher.Supervisor`): that one kills and
  relaunches the process, which also fails the requests in flight on a hung server, so they
  fail over. A request in flight on a hung server the proxy did not launch waits for the
  upstream timeout.

A replica in a Ray actor (`serve --ray-address`, `ray_replicas.RayReplica`) is both: an
`UpstreamClient` whose URL may change when Ray restarts the actor, and its own `Supervision`.

`upstream.py` stays the only module that speaks HTTP to vLLM; this one only decides where,
and depends on it only through `UpstreamClient`, the methods it calls (tests route between
in-process fakes that speak it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from contextlib import AsyncExitStack, aclosing, suppress
from dataclasses import dataclass
from typing import Any, Protocol, Self, TypeVar

from molt_proxy.errors import MoltError, UpstreamUnavailable
from molt_proxy.telemetry import upstream_called
from molt_proxy.types import Generation
from molt_proxy.upstream import ModelInfo, TokenDelta

log = logging.getLogger(__name__)

T = TypeVar("T")


class UpstreamClient(Protocol):
    """One vLLM server as the router uses it: exactly what `upstream.Upstream` offers and
    `Replicas` calls. Open between `__aenter__` and `__aexit__`; every method raises
    `UpstreamUnavailable` when the server cannot be reached (the one error that fails over)."""

    @property
    def base_url(self) -> str:
        """Names the replica (in `/health`, in logs, and for its `Supervision`)."""
        ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(self, *exc: object) -> None: ...

    async def generate(
        self, prompt_ids: Sequence[int], sampling: dict[str, Any], *, return_prompt_ids: bool = False
    ) -> Generation: ...

    def stream(
        self, prompt_ids: Sequence[int], sampling: dict[str, Any], *, return_prompt_ids: bool = False
    ) -> AsyncGenerator[TokenDelta | Generation, None]:
        """Each `TokenDelta` as it is sampled, then the whole `Generation`. A generator, so that
        closing it early (`aclose`) ends the request on the server. `return_prompt_ids`: the
        first delta and the `Generation` carry the prompt ids the server read."""
        ...

    async def models(self) -> list[dict[str, Any]]: ...

    async def model(self) -> ModelInfo: ...

    async def refresh_weights(self, weights_dir: str, version: int) -> None: ...

    async def healthy(self) -> bool: ...


class Supervision(Protocol):
    """The keeper of a replica's process, for replicas the proxy launched (`launcher.Supervisor`)."""

    async def observe(self, healthy: bool) -> None:
        """Told every health probe's result: reap, kill or relaunch the process as needed."""
        ...

    def describe(self) -> dict[str, Any]:
        """Its state for `/health` (`state`, `pid`, `restarts`, ...)."""
        ...


@dataclass(eq=False, slots=True)
class Replica:
    """One vLLM server and what the router knows about it."""

    upstream: UpstreamClient
    healthy: bool = False
    in_flight: int = 0
    """Requests sent through this proxy and not answered yet."""
    sessions: int = 0
    """Sessions that stick to it."""
    requests: int = 0
    """Requests it answered, or began to stream an answer to (for `/health`)."""
    weight_version: int | None = None
    """The version this proxy last loaded into it; None: the weights it booted with."""
    supervisor: Supervision | None = None
    """Set when the proxy launched this vLLM and relaunches it when it dies."""
    in_transfer_group: bool = False
    """In the trainer's weight-transfer group (`transfer.py`); lost when taken out."""

    @property
    def url(self) -> str:
        return self.upstream.base_url

    def describe(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "healthy": self.healthy,
            "in_flight": self.in_flight,
            "sessions": self.sessions,
            "requests": self.requests,
            "weight_version": self.weight_version,
            "process": self.supervisor.describe() if self.supervisor else None,
        }


class Replicas:
    """Routes each session's requests to one of several upstreams (see the module doc)."""

    def __init__(
        self,
        upstreams: Sequence[UpstreamClient],
        *,
        health_interval_s: float = 5.0,
        health_timeout_s: float = 10.0,
        supervisors: Mapping[str, Supervision] | None = None,
    ):
        """`supervisors`: by base URL, for the upstreams the proxy launched itself."""
        if not upstreams:
            raise ValueError("at least one upstream vLLM is needed")
        supervisors = supervisors or {}
        self._replicas = [Replica(u, supervisor=supervisors.get(u.base_url)) for u in upstreams]
        self._affinity: dict[str, Replica] = {}
        self._weights: tuple[str, int] | None = None
        """The last weights loaded (dir, version): what a returning replica is given first."""
        self._weights_lock = asyncio.Lock()
        self._health_interval_s = health_interval_s
        self._health_timeout_s = health_timeout_s
        self._watcher: asyncio.Task[None] | None = None
        self._clients = AsyncExitStack()

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self, weights: tuple[str, int] | None = None) -> None:
        """Open the clients and probe every replica once, so routing starts from the truth;
        replicas that are not up yet are brought in by the health check when they are.

        `weights` are the last ones loaded before a proxy restart: every replica is given them
        before traffic, since any of them may have restarted meanwhile with its boot weights.
        """
        self._weights = weights
        for replica in self._replicas:
            await self._clients.enter_async_context(replica.upstream)
        await self.check_health()
        self._watcher = asyncio.create_task(self._watch(), name="molt-proxy replica health")

    async def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with suppress(asyncio.CancelledError):
                await self._watcher
        await self._clients.aclose()

    # -- routing -----------------------------------------------------------------------------

    def _place(self, affinity: str, tried: set[Replica]) -> Replica:
        """The affinity's replica if it is healthy, else the least loaded healthy one."""
        current = self._affinity.get(affinity)
        if current is not None and current.healthy and current not in tried:
            return current
        candidates = [r for r in self._replicas if r.healthy and r not in tried]
        if not candidates:
            raise UpstreamUnavailable("no healthy vLLM replica")
        chosen = min(candidates, key=lambda r: (r.in_flight, r.sessions))  # first wins ties
        if current is not None:
            current.sessions -= 1
        self._affinity[affinity] = chosen
        chosen.sessions += 1
        return chosen

    def mark_down(self, replica: Replica, why: object) -> None:
        """Take a replica out and free its sessions: their next turn is placed afresh."""
        if replica.healthy:
            log.warning("vLLM replica %s is down: %s", replica.url, why)
        replica.healthy = False
        replica.weight_version = None  # unknown until it is given weights again
        replica.in_transfer_group = False  # a restarted vLLM has left the group
        if replica.sessions:  # a scan of all sessions, only when some stick to it
            for affinity in [a for a, r in self._affinity.items() if r is replica]:
                del self._affinity[affinity]
            replica.sessions = 0

    async def generate(
        self,
        affinity: str,
        prompt_ids: Sequence[int],
        sampling: dict[str, Any],
        *,
        return_prompt_ids: bool = False,
    ) -> Generation:
        """Generate on the affinity's replica, failing over as `_route` does."""

        async def one(upstream: UpstreamClient) -> AsyncGenerator[Generation, None]:
            yield await upstream.generate(prompt_ids, sampling, return_prompt_ids=return_prompt_ids)

        [generation] = [item async for item in self._route(affinity, one)]
        return generation

    def stream(
        self,
        affinity: str,
        prompt_ids: Sequence[int],
        sampling: dict[str, Any],
        *,
        return_prompt_ids: bool = False,
    ) -> AsyncGenerator[TokenDelta | Generation, None]:
        """`UpstreamClient.stream` on the affinity's replica, failing over as `_route` does."""
        return self._route(
            affinity,
            lambda upstream: upstream.stream(prompt_ids, sampling, return_prompt_ids=return_prompt_ids),
        )

    async def _route(
        self, affinity: str, call: Callable[[UpstreamClient], AsyncGenerator[T, None]]
    ) -> AsyncGenerator[T, None]:
        """The one failover loop: pass through what `call` yields from the affinity's replica;
        on `UpstreamUnavailable` take that replica out and try another (each at most once per
        request), but only before the first item. After it, the agent has already seen tokens
        from this replica, so a retry could contradict them. A whole generation is one item."""
        tried: set[Replica] = set()
        while True:
            replica = self._place(affinity, tried)
            tried.add(replica)
            replica.in_flight += 1
            started, called = False, time.monotonic()
            try:
                async with aclosing(call(replica.upstream)) as items:
                    async for item in items:
                        if not started:  # counted here: a caller may stop reading at the end
                            started = True
                            replica.requests += 1
                        yield item
            except UpstreamUnavailable as exc:
                self.mark_down(replica, exc)
                if started:
                    raise
                continue
            finally:
                replica.in_flight -= 1
                upstream_called(replica.url, time.monotonic() - called)
            return

    def release(self, affinity: str) -> None:
        """Forget a closed session's stickiness."""
        replica = self._affinity.pop(affinity, None)
        if replica is not None:
            replica.sessions -= 1

    # -- model facts -------------------------------------------------------------------------

    async def models(self) -> list[dict[str, Any]]:
        for replica in [r for r in self._replicas if r.healthy]:
            try:
                return await replica.upstream.models()
            except UpstreamUnavailable as exc:
                self.mark_down(replica, exc)
        raise UpstreamUnavailable("no healthy vLLM replica")

    async def model(self) -> ModelInfo:
        for replica in [r for r in self._replicas if r.healthy]:
            try:
                return await replica.upstream.model()
            except UpstreamUnavailable as exc:
                self.mark_down(replica, exc)
        raise UpstreamUnavailable("no healthy vLLM replica")

    # -- weights -----------------------------------------------------------------------------

    async def refresh_weights(self, weights_dir: str, version: int) -> list[str]:
        """Load new weights into every healthy replica at once; returns the URLs loaded.

        A replica that fails is taken out (a failed reload leaves a vLLM engine dead, DESIGN
        §5) and gets these weights when it passes the health check again. The weights are
        remembered only if some replica took them; if none did, the error is raised.
        """
        async with self._weights_lock:
            targets = [r for r in self._replicas if r.healthy]
            if not targets:
                raise UpstreamUnavailable("no healthy vLLM replica to load weights into")
            results = await asyncio.gather(
                *(r.upstream.refresh_weights(weights_dir, version) for r in targets), return_exceptions=True
            )
            loaded: list[str] = []
            errors: list[BaseException] = []
            for replica, result in zip(targets, results, strict=True):
                if isinstance(result, BaseException):
                    self.mark_down(replica, f"loading weights {version} failed: {result!r}")
                    errors.append(result)
                else:
                    replica.weight_version = version
                    loaded.append(replica.url)
            if not loaded:
                raise errors[0]
            self._weights = (weights_dir, version)
            return loaded

    def loaded(self, replicas: Sequence[Replica], weights_dir: str, version: int) -> None:
        """`replicas` now serve `version`, also found in `weights_dir` (loaded by another path
        than `refresh_weights`: `transfer.py`): what a returning replica is given."""
        for replica in replicas:
            replica.weight_version = version
        self._weights = (weights_dir, version)

    # -- health ------------------------------------------------------------------------------

    def healthy_replicas(self) -> list[Replica]:
        return [r for r in self._replicas if r.healthy]

    def describe(self) -> list[dict[str, Any]]:
        return [r.describe() for r in self._replicas]

    async def check_health(self) -> None:
        """Probe every replica once (concurrently)."""
        await asyncio.gather(*(self._check(r) for r in self._replicas))

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self._health_interval_s)
            try:
                await self.check_health()
            except Exception:  # the watcher must outlive any one bad probe
                log.exception("replica health check failed")

    async def _check(self, replica: Replica) -> None:
        why: object
        try:
            ok = await asyncio.wait_for(replica.upstream.healthy(), self._health_timeout_s)
        except TimeoutError:  # hung: it accepts connections and never answers
            ok, why = False, f"no answer to /health within {self._health_timeout_s:g} s"
        except Exception as exc:  # a probe that cannot finish is a failed probe
            ok, why = False, exc
        else:
            why = "/health failed"
        if not ok:
            self.mark_down(replica, why)  # first: no request goes there while it is killed
        if replica.supervisor is not None:
            await replica.supervisor.observe(ok)
        if not ok or replica.healthy:
            return
        # Back (or up for the first time): give it the current weights before any traffic.
        async with self._weights_lock:
            if self._weights is not None:
                weights_dir, version = self._weights
                try:
                    await replica.upstream.refresh_weights(weights_dir, version)
                except MoltError as exc:
                    log.warning("vLLM replica %s did not take weights %s: %s", replica.url, version, exc)
                    return
                replica.weight_version = version
            replica.healthy = True
        log.info("vLLM replica %s is up (weights version %s)", replica.url, replica.weight_version)
