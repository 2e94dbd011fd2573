"""vLLM replicas as Ray actors (`serve --ray-address ADDR --replicas K`), seen by the router as
any other replica.

`start_replicas` asks Ray for K actors (`ray_actor.VLLMActor`), each with
`--replica-resources` (e.g. `{"GPU": 1}`, or a custom resource that pins replicas to nodes),
and waits until every one has booted its vLLM. Each becomes a `RayReplica`: an
`replicas.UpstreamClient` over the actor's current vLLM URL, so routing (sticky sessions,
least loaded, failover, weights before traffic on return) is `replicas.Replicas`', unchanged.

Ray restarts an actor that dies (see `ray_actor`), on any node with the resources, so a
replica's URL can change. Its health probe asks the actor where it is: a new incarnation
fails that probe once, which takes the replica out (its sessions are placed afresh, its
weight version unknown); the next probe that passes gives it the current weights before
traffic, as for any returning replica.

Weights travel through Ray, not a shared disk: the proxy reads the trainer's folder once per
version and puts its files in the object store (`Shipment`); each actor fetches them to its
node and writes them to a local folder (`VLLMActor.stage`), then the proxy runs the usual
pause-keep → reload → version → resume on that folder (`Upstream.refresh_weights`). The
object store keeps the last version's files, so a replica that comes back after the trainer
pruned its folder still gets them.

Ray is imported only here and in `ray_actor`, and only with `--ray-address`.

Joining the cluster (`join_cluster`, the trainer's `--ray-address` too): Ray 2.60's `ray start
--head` turns token authentication on when the head has a token (~/.ray/auth_token, which any
earlier local `ray.init()` there writes), and a process that joins by an explicit address
never turns it on by itself (only `address="auto"` does). It is then refused, after ~20 s of
retries, with "Failed to connect to Ray cluster at ADDR" and Ray's own explanation two causes
down; `RayTokenAuthError` says what to do instead.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import Any, Self

from molt_proxy.errors import UpstreamError, UpstreamUnavailable
from molt_proxy.ray_actor import VLLMActor
from molt_proxy.types import Generation
from molt_proxy.upstream import ModelInfo, TokenDelta, Upstream

log = logging.getLogger(__name__)


_AUTH_MODE = "RAY_AUTH_MODE"
_REFUSED = ("InvalidAuthToken", "Authentication token is missing or incorrect", "no authentication token")
"""What Ray's refusals for want of a (right) token say (`ray.exceptions.AuthenticationError`'s
messages as they reach `ray.init`'s ConnectionError, inside a RuntimeError's text)."""


class RayTokenAuthError(ConnectionError):
    """The Ray cluster asked for an auth token that this process did not send, or sent wrong."""


def join_cluster(address: str, **options: Any) -> None:
    """`ray.init` on the existing cluster at `address` (`options` passed on); a refusal for
    want of Ray's auth token raises `RayTokenAuthError` naming the fix (module docstring)."""
    import ray

    try:
        ray.init(address=address, ignore_reinit_error=True, **options)
    except Exception as exc:
        if not refused_for_token(exc):
            raise
        raise RayTokenAuthError(token_auth_hint(address)) from exc


def refused_for_token(exc: BaseException) -> bool:
    """Whether `exc`, or an exception it was raised from, is Ray refusing a missing or wrong
    auth token: an `AuthenticationError`, or its text in the RuntimeError that Ray wraps it in."""
    from ray.exceptions import AuthenticationError

    seen: BaseException | None = exc
    while seen is not None:
        text = str(seen)
        if isinstance(seen, AuthenticationError) or any(marker in text for marker in _REFUSED):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def token_auth_hint(address: str) -> str:
    """What to do when the cluster at `address` wants a token (checked with Ray 2.60)."""
    mode = os.environ.get(_AUTH_MODE)
    here = f"{_AUTH_MODE}={mode}" if mode is not None else f"{_AUTH_MODE} unset"
    return (
        f"the Ray cluster at {address} refused this process: it has token authentication on and "
        f"this process sent no token, or not its token ({here}). `ray start --head` turns it on "
        "when the head has a token (~/.ray/auth_token; any earlier local ray.init() there writes "
        "one), and a process joining by address must turn it on itself. Either run this with "
        "RAY_AUTH_MODE=token and the cluster's token in ~/.ray/auth_token, in RAY_AUTH_TOKEN or in "
        "the file RAY_AUTH_TOKEN_PATH names (`ray get-auth-token` on the head prints it), or start "
        "the cluster with RAY_AUTH_MODE=disabled on every node. "
        "See https://docs.ray.io/en/latest/ray-security/token-auth.html"
    )


def actor_options(resources: dict[str, float], max_restarts: int) -> dict[str, Any]:
    """Ray's options for a replica actor. Ray takes CPUs and GPUs as their own options, the
    rest as custom resources; a replica asks for no CPU unless told (vLLM does its own
    threading, and an actor holding a CPU slot would starve a small cluster)."""
    custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
    return {
        "num_cpus": resources.get("CPU", 0),
        "num_gpus": resources.get("GPU", 0),
        "resources": custom,
        "max_restarts": max_restarts,
        "max_concurrency": 4,  # `where` answers while `stage` writes gigabytes
    }


class Shipment:
    """The files of the last weights folder, put once in Ray's object store for every replica."""

    def __init__(self) -> None:
        self._key: tuple[str, int] | None = None
        self._names: list[str] = []
        self._refs: list[Any] = []
        self._lock = asyncio.Lock()

    async def files(self, folder: str, version: int) -> tuple[list[str], list[Any]]:
        """The folder's file names and their object refs (read and put on first use)."""
        async with self._lock:
            if self._key != (folder, version):
                try:
                    self._names, self._refs = await asyncio.to_thread(_put_folder, folder)
                except OSError as exc:  # pruned meanwhile: this replica waits for the next weights
                    raise UpstreamError(f"weights {version} at {folder} cannot be read: {exc}") from exc
                self._key = (folder, version)
            return self._names, self._refs


def _put_folder(folder: str) -> tuple[list[str], list[Any]]:
    import ray

    files = sorted(p for p in Path(folder).iterdir() if p.is_file())
    return [p.name for p in files], [ray.put(p.read_bytes()) for p in files]


class RayReplica:
    """One replica actor: an `UpstreamClient` over its current vLLM, and its `Supervision`
    for `/health` (Ray and the actor do the restarting; this only reports)."""

    def __init__(self, actor: Any, where: dict[str, Any], shipment: Shipment, *, timeout_s: float):
        self._actor, self._where, self._shipment = actor, where, shipment
        self._timeout_s = timeout_s
        self._upstream = Upstream(where["url"], timeout_s=timeout_s)
        self._open = False
        self.restarts = 0
        """New incarnations seen (Ray restarted the actor)."""
        self._state = "running"

    @property
    def base_url(self) -> str:
        return self._upstream.base_url

    async def __aenter__(self) -> Self:
        await self._upstream.__aenter__()
        self._open = True
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._open = False
        await self._upstream.__aexit__(*exc)

    async def generate(
        self, prompt_ids: Sequence[int], sampling: dict[str, Any], *, return_prompt_ids: bool = False
    ) -> Generation:
        return await self._upstream.generate(prompt_ids, sampling, return_prompt_ids=return_prompt_ids)

    def stream(
        self, prompt_ids: Sequence[int], sampling: dict[str, Any], *, return_prompt_ids: bool = False
    ) -> AsyncGenerator[TokenDelta | Generation, None]:
        return self._upstream.stream(prompt_ids, sampling, return_prompt_ids=return_prompt_ids)

    async def models(self) -> list[dict[str, Any]]:
        return await self._upstream.models()

    async def model(self) -> ModelInfo:
        return await self._upstream.model()

    async def refresh_weights(self, weights_dir: str, version: int) -> None:
        """Ship the folder's files to the actor's node, then reload vLLM from its copy."""
        names, refs = await self._shipment.files(weights_dir, version)
        try:
            staged = await self._actor.stage.remote(version, names, *refs)
        except Exception as exc:  # the actor died or is restarting: the replica is down
            raise UpstreamUnavailable(f"Ray replica {self.base_url} did not stage weights: {exc!r}") from exc
        await self._upstream.refresh_weights(staged, version)

    async def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        await self._upstream.init_weight_transfer(init_info)

    async def start_weight_update(self) -> None:
        await self._upstream.start_weight_update()

    async def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        await self._upstream.update_weights(update_info)

    async def finish_weight_update(self, version: int) -> None:
        await self._upstream.finish_weight_update(version)

    async def healthy(self) -> bool:
        """The actor answers, is the incarnation this client speaks to, and its vLLM answers
        `/health`. A new incarnation is a failed probe, once: the replica is taken out and
        comes back through `Replicas`' health check, with the current weights."""
        import ray

        try:
            where = await self._actor.where.remote()
        except ray.exceptions.RayError:  # dead, restarting, or dead for good (past max_restarts)
            self._state = "down"
            return False
        if where != self._where:
            await self._moved(where)
            return False
        return await self._upstream.healthy()

    async def _moved(self, where: dict[str, Any]) -> None:
        log.info("Ray replica %s restarted: now %s on node %s", self.base_url, where["url"], where["node_id"])
        old, self._upstream = self._upstream, Upstream(where["url"], timeout_s=self._timeout_s)
        self._where, self.restarts, self._state = where, self.restarts + 1, "restarting"
        if self._open:
            await old.__aexit__(None, None, None)
            await self._upstream.__aenter__()

    async def observe(self, healthy: bool) -> None:
        if healthy:
            self._state = "running"

    def describe(self) -> dict[str, Any]:
        return {
            "state": self._state,
            "node_id": self._where["node_id"],
            "pid": self._where["pid"],
            "restarts": self.restarts,
        }

    def stop(self) -> None:
        """Stop the actor's vLLM and the actor, for good."""
        import ray

        try:
            ray.get(self._actor.stop.remote(), timeout=60)
        except Exception as exc:  # stopping is best effort: the actor goes either way
            log.warning("Ray replica at %s did not stop cleanly: %r", self.base_url, exc)
        ray.kill(self._actor, no_restart=True)


def start_replicas(
    address: str,
    count: int,
    resources: dict[str, float],
    *,
    model: str,
    max_model_len: int | None,
    extra_args: list[str],
    max_restarts: int,
    timeout_s: float,
) -> list[RayReplica]:
    """Join the Ray cluster at `address`, start `count` replica actors and wait for their vLLMs."""
    import ray

    join_cluster(address)
    remote = ray.remote(VLLMActor)
    options = actor_options(resources, max_restarts)
    actors = [remote.options(**options).remote(model, max_model_len, extra_args) for _ in range(count)]
    wheres = ray.get([actor.where.remote() for actor in actors])
    shipment = Shipment()
    replicas = [RayReplica(a, w, shipment, timeout_s=timeout_s) for a, w in zip(actors, wheres, strict=True)]
    for replica in replicas:
        log.info("Ray replica %s on node %s", replica.base_url, replica.describe()["node_id"])
    return replicas
