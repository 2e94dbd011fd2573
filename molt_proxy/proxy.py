"""The proxy's wiring and lifecycle: every long-lived part built once at startup, the TTL
sweep that closes idle sessions, session close with its notification to trajectory
streams, and who a request's key says it is. No HTTP routes here (`routes.py`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Request

from molt_proxy import auth
from molt_proxy.completions import Completions
from molt_proxy.config import Settings
from molt_proxy.errors import BadRequest, Conflict, NotFound
from molt_proxy.lora import check_adapter_dir
from molt_proxy.parsing import ReplyParser
from molt_proxy.replicas import Replicas, Supervision, UpstreamClient
from molt_proxy.sessions import Sessions
from molt_proxy.store import Store
from molt_proxy.telemetry import Telemetry
from molt_proxy.tokenizer import Tokenizer
from molt_proxy.transfer import TransferGroup
from molt_proxy.types import SessionStatus, Trajectory
from molt_proxy.upstream import Upstream
from molt_proxy.weights import check_weights_dir

log = logging.getLogger(__name__)


class Proxy:
    """Everything a handler needs, built once at startup."""

    def __init__(
        self,
        settings: Settings,
        supervisors: Mapping[str, Supervision] | None = None,
        upstreams: Sequence[UpstreamClient] = (),
        tokenizer: Tokenizer | None = None,
    ):
        """`upstreams`: replicas the caller built (Ray actors, `ray_replicas.py`); without them,
        one `Upstream` per URL of `settings.upstreams`. `tokenizer`: `settings.model`'s, loaded
        already (it takes seconds: tests that start hundreds of proxies load it once)."""
        self.settings = settings
        self.keys = auth.Keys(settings.admin_key, settings.agent_keys)
        self.store = Store(settings.db_path)
        self.tokenizer = tokenizer or Tokenizer.load(settings.model)
        # Read once now: it walks the vocabulary holding the GIL (~0.1 s), which the first
        # large request would otherwise do in its worker thread, stalling every other client.
        self.tokenizer.max_token_bytes  # noqa: B018
        self.replicas = Replicas(
            upstreams
            or [
                Upstream(url, timeout_s=settings.upstream_timeout_s, lora_name=settings.lora_name)
                for url in settings.upstreams
            ],
            health_interval_s=settings.health_interval_s,
            health_timeout_s=settings.health_timeout_s,
            supervisors=supervisors,  # the vLLM servers `serve` launched: the watcher relaunches them
        )
        self.finalized = asyncio.Condition()
        """Notified whenever a session closes: trajectory streams wait on it for new rows."""
        self.refresh_lock = asyncio.Lock()
        self.transfer = TransferGroup(self.replicas)
        """The trainer's weight-transfer group (`transfer.py`), once it forms one."""
        self.telemetry = Telemetry(lambda: len(self.sessions.open_sessions()), self.replicas.describe)
        self.sessions: Sessions
        self.completions: Completions

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """The proxy started, with its TTL sweep, until the block ends (the app's lifespan)."""
        await self.start()
        expiry = asyncio.create_task(self.expire_idle_sessions())
        try:
            yield
        finally:
            expiry.cancel()
            await self.stop()

    async def start(self) -> None:
        await self.store.open()
        await self.replicas.start(await self._loadable_weights())
        self.sessions = Sessions(self.store, self.tokenizer, self.settings.model)
        await self.sessions.recover()
        self.completions = Completions(
            self.sessions,
            self.tokenizer,
            ReplyParser(
                self.tokenizer,
                self.settings.tool_call_parser,
                self.settings.reasoning_parser,
                self.settings.tool_strict_level,
            ),
            self.replicas,
            verify_prompt_ids=self.settings.verify_prompt_ids,
            sampling_pins=self.settings.sampling,
            served_model_name=next(iter(self.settings.served_model_name), None),
            side_rules=self.settings.side_requests,
            close=self.close_session,
        )

    async def _loadable_weights(self) -> tuple[str, int] | None:
        """The last weights loaded, if their folder is still whole (the trainer prunes old ones,
        and a replica must not be held back waiting for weights that are gone)."""
        weights = await self.store.last_weights()
        if weights is None:
            return None
        try:
            self.check_weights(weights[0])
        except BadRequest:
            log.warning("the last weights loaded (%s, version %d) are gone; not reloading them", *weights)
            return None
        return weights

    def check_weights(self, path: str) -> str:
        """The pushed folder, checked as what this proxy loads: an adapter or a whole model."""
        return check_adapter_dir(path) if self.settings.lora_name else check_weights_dir(path)

    async def models(self) -> list[dict[str, Any]]:
        """`GET /v1/models`: vLLM's list, or the model under each `--served-model-name`, as
        `vllm serve --served-model-name` lists it."""
        models = await self.replicas.models()
        return [{**models[0], "id": name} for name in self.settings.served_model_name] or models

    async def close_session(
        self, session_id: str, reward: float | None, info: dict[str, Any], status: SessionStatus
    ) -> list[Trajectory]:
        trajectories = await self.sessions.close(session_id, reward, info, status)
        self.replicas.release(session_id)
        self.telemetry.closed(trajectories)
        async with self.finalized:
            self.finalized.notify_all()
        return trajectories

    async def expire_idle_sessions(self) -> None:
        """Close sessions without a turn for `session_ttl_s` as unrewarded: kept, marked, and
        skipped by the trainer, so an agent that crashed does not hold its group forever."""
        ttl = self.settings.session_ttl_s
        while True:
            await asyncio.sleep(min(ttl / 4, 60.0))
            for session_id in self.sessions.idle_since(time.time() - ttl):
                info = {"closed_by": "ttl", "ttl_s": ttl}
                try:
                    await self.close_session(session_id, None, info, SessionStatus.UNREWARDED)
                except (NotFound, Conflict):
                    pass  # rewarded meanwhile
                except Exception:  # the sweep must outlive one failed close; it retries next time
                    log.exception("closing idle session %s failed", session_id)

    async def stop(self) -> None:
        await self.replicas.stop()
        await self.store.close()

    def principal(self, request: Request, allowed: frozenset[auth.Role]) -> auth.Principal:
        """Who the caller's key says it is, if it may use a route of kind `allowed`; the first
        thing a guarded handler does."""

        def session_of(key_hash: str) -> str | None:
            session = self.sessions.by_key_id(key_hash)
            return session.id if session is not None else None

        return self.keys.principal(request.headers, allowed, session_of)
