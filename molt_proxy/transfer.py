"""Weights sent by the trainer straight into vLLM's memory with vLLM's weight-transfer engine
(NCCL between GPUs, CUDA IPC on a GPU they share) instead of through files (DESIGN §5).

The trainer runs vLLM's `TrainerWeightTransferEngine` (`trainer/transfer.py`) with a client
whose four calls come here, `POST /v1/admin/weights/transfer` with a `phase`; the proxy fans
each out to the replicas, keeping the file path's pause-keep ... resume per replica:

    init    every healthy replica: `/init_weight_transfer_engine`, each at its own rank (the
            trainer's `rank_offset` plus its place in the group; the trainer is rank 0):
            together they form the group. `world_size` must count them all, plus one.
    start   every member: `/pause?mode=keep`, `/start_weight_update`. The trainer names the
            version, and the folder it also wrote these weights to, checked before any
            pause as `POST /v1/admin/weights` checks them.
    update  every member: `/update_weights`, answered once the trainer's data has arrived
            (an NCCL broadcast the trainer runs meanwhile).
    finish  every member: `/finish_weight_update` with the version, `/resume`. The store
            records the version and folder: a replica that comes back later, outside the
            group, loads the folder. The time since `start` is the refresh time
            (`molt_proxy_refresh_seconds`, as for a refresh through files).

A group is fixed once formed. `start` is refused (409) unless every member is still up and in
it (a replica taken out leaves the group: a restarted vLLM has no communicator); the trainer
then refreshes through files. A phase that fails on some member takes every member out: a
half-done transfer leaves their weights unknown, and each comes back through the health
check with the last weights on disk.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from fastapi import APIRouter, Request

from molt_proxy import auth
from molt_proxy.errors import BadRequest, Conflict
from molt_proxy.replicas import Replica, Replicas
from molt_proxy.weights import check_version, check_weights_dir
from molt_proxy.wire.control import decode_json_object, request_body

router = APIRouter()
PHASES = ("init", "start", "update", "finish")


class TransferClient(Protocol):
    """The weight-transfer routes of one vLLM (`upstream.Upstream` speaks them)."""

    async def init_weight_transfer(self, init_info: dict[str, Any]) -> None: ...

    async def start_weight_update(self) -> None: ...

    async def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None: ...

    async def finish_weight_update(self, version: int) -> None: ...


class TransferGroup:
    """The replicas in the trainer's weight-transfer group and the phase it is in."""

    def __init__(self, replicas: Replicas):
        self._replicas = replicas
        self._members: list[Replica] = []
        self.phase = "none"
        """The last phase done; "none" before a group is formed, or after one broke."""
        self._pending: tuple[str, int] | None = None
        """The (folder, version) that `start` announced and `finish` labels."""
        self._started = 0.0
        """When `start` began (`time.monotonic()`): `finish` reports the refresh's time."""

    async def init(self, init_info: dict[str, Any]) -> list[Replica]:
        members = self._replicas.healthy_replicas()
        world = init_info.get("world_size")
        if world is not None and world != 1 + len(members):
            raise Conflict(
                f"'world_size' is {world}, but the trainer and {len(members)} healthy replicas make"
                f" {1 + len(members)}",
                param="init_info.world_size",
            )
        offset = init_info.get("rank_offset")
        infos = [
            init_info if offset is None else {**init_info, "rank_offset": offset + i}
            for i in range(len(members))
        ]
        self.phase, self._members = "none", members
        await self._on_members(lambda client, i: client.init_weight_transfer(infos[i]))
        for member in members:
            member.in_transfer_group = True
        self.phase = "init"
        return members

    async def start(self, weights_dir: str, version: int) -> list[Replica]:
        self._expect(("init", "finish"), "start")
        lost = [m.url for m in self._members if not (m.healthy and m.in_transfer_group)]
        if lost:
            raise Conflict(
                f"replicas {', '.join(lost)} left the weight-transfer group: refresh through files"
            )
        self._pending, self._started = (weights_dir, version), time.monotonic()
        return await self._step("start", lambda client, _: client.start_weight_update())

    async def update(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> list[Replica]:
        self._expect(("start",), "update")
        return await self._step("update", lambda client, _: client.update_weights(update_info))

    async def finish(self) -> tuple[list[Replica], tuple[str, int], float]:
        """The members, the (folder, version) they now serve, and the seconds since `start`."""
        self._expect(("update",), "finish")
        assert self._pending is not None
        weights_dir, version = self._pending
        members = await self._step("finish", lambda client, _: client.finish_weight_update(version))
        self._replicas.loaded(members, weights_dir, version)
        return members, self._pending, time.monotonic() - self._started

    def _expect(self, phases: tuple[str, ...], phase: str) -> None:
        if self.phase not in phases:
            raise Conflict(f"'{phase}' must follow {' or '.join(phases)}, not '{self.phase}'", param="phase")

    async def _step(
        self, phase: str, call: Callable[[TransferClient, int], Awaitable[None]]
    ) -> list[Replica]:
        await self._on_members(call)
        self.phase = phase
        return self._members

    async def _on_members(self, call: Callable[[TransferClient, int], Awaitable[None]]) -> None:
        """`call` on every member at once; if any fails, every member is taken out, the group
        is broken, and the first error is raised."""
        results = await asyncio.gather(
            *(call(m.upstream, i) for i, m in enumerate(self._members)),  # type: ignore[arg-type]
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self.phase = "none"
            for member in self._members:
                self._replicas.mark_down(member, f"weight transfer failed: {errors[0]!r}")
            raise errors[0]


TRANSFER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "phase": {"type": "string", "enum": list(PHASES)},
        "init_info": {"type": "object"},
        "path": {"type": "string"},
        "version": {"type": "integer", "minimum": 0},
        "update_info": {"anyOf": [{"type": "object"}, {"type": "array", "items": {"type": "object"}}]},
    },
    "required": ["phase"],
}


@router.post("/v1/admin/weights/transfer", openapi_extra=request_body(TRANSFER_SCHEMA))
async def transfer(request: Request) -> dict[str, Any]:
    """One phase of a weight transfer from the trainer (see the module doc)."""
    proxy = request.app.state.proxy
    proxy.principal(request, auth.ADMIN_ONLY)
    body = decode_json_object(await request.body())
    phase = body.get("phase")
    if phase not in PHASES:
        raise BadRequest(f"'phase' must be one of {', '.join(PHASES)}", param="phase")
    started = time.monotonic()
    group: TransferGroup = proxy.transfer
    async with proxy.refresh_lock:
        if phase == "init":
            members = await group.init(_object(body, "init_info"))
        elif phase == "start":
            members = await _start(proxy, group, body)
        elif phase == "update":
            info = body.get("update_info")
            if not isinstance(info, dict) and not (isinstance(info, list) and info):
                raise BadRequest("'update_info' must be an object or a list of objects", param="update_info")
            members = await group.update(info)
        else:
            members, weights, refresh_s = await group.finish()
            await proxy.store.save_weights(*weights)
            proxy.telemetry.refreshed(refresh_s)
    return {"phase": phase, "replicas": [m.url for m in members], "seconds": time.monotonic() - started}


async def _start(proxy: Any, group: TransferGroup, body: dict[str, Any]) -> list[Replica]:
    """The version and folder are checked before any replica is paused."""
    path = body.get("path")
    if not isinstance(path, str) or not path:
        raise BadRequest("'path' must name the folder these weights were also written to", param="path")
    folder = await asyncio.to_thread(check_weights_dir, path)
    version = check_version(body.get("version"), folder, await proxy.store.last_weights())
    return await group.start(folder, version)


def _object(body: dict[str, Any], key: str) -> dict[str, Any]:
    value = body.get(key)
    if not isinstance(value, dict):
        raise BadRequest(f"'{key}' must be an object", param=key)
    return value
