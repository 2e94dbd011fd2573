"""One episode on molt-proxy for any `openai`-SDK agent: `with molt_session(url) as s:`.

The session is created with `POST /v1/sessions`, so its id, group and key are known before
the agent's first call; the clients it hands out point at the session's own base URL
(`/s/<id>/v1`) and use the session key, so every request lands in this episode whatever the
agent sends. The final reward goes to `POST /v1/rewards`.

A block that raises posts no reward: the session stays open until the proxy's
`--session-ttl` closes it as unrewarded, which the trainer skips (a crashed episode is not
evidence about the policy, and reward 0 would teach it as if it were), or until `s.close(info)`
closes it so at once, with the reason. A block that ends without `s.reward(...)` likewise
leaves the session open.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import httpx
from openai import AsyncOpenAI, OpenAI


@dataclass
class MoltSession:
    """A created session: where to send the agent, and how to reward it."""

    proxy_url: str
    session_id: str
    group_id: str
    api_key: str
    base_url: str
    timeout_s: float = 60.0
    rewarded: bool = field(default=False, init=False)

    @cached_property
    def client(self) -> OpenAI:
        """An `openai.OpenAI` bound to this session (path and key both name it)."""
        return OpenAI(base_url=self.base_url, api_key=self.api_key)

    @cached_property
    def async_client(self) -> AsyncOpenAI:
        """The same as `client`, for async agents (the OpenAI Agents SDK needs one)."""
        return AsyncOpenAI(base_url=self.base_url, api_key=self.api_key)

    def reward(self, value: float, info: dict[str, Any] | None = None) -> dict[str, Any]:
        """Post the final reward: it closes the session and returns the proxy's answer
        (`{session_id, status, trajectories: [{seq, trajectory_id}]}`)."""
        response = httpx.post(f"{self.proxy_url}/v1/rewards", **self._reward_request(value, info))
        return self._rewarded(response)

    async def areward(self, value: float, info: dict[str, Any] | None = None) -> dict[str, Any]:
        """`reward` for async agents."""
        async with httpx.AsyncClient() as http:
            response = await http.post(f"{self.proxy_url}/v1/rewards", **self._reward_request(value, info))
        return self._rewarded(response)

    def close(self, info: dict[str, Any] | None = None) -> dict[str, Any]:
        """Close the session without a reward, saying why in `info` (the agent crashed, timed
        out, or was interrupted): kept, marked unrewarded, and not trained on, at once rather
        than at the proxy's `--session-ttl`. Returns the proxy's answer, as `reward` does."""
        response = httpx.post(
            f"{self.proxy_url}/v1/sessions/{self.session_id}/close",
            json={"info": info or {}},
            headers=self._headers,
            timeout=self.timeout_s,
        )
        response.raise_for_status()
        return response.json()

    def describe(self) -> dict[str, Any]:
        """`GET /v1/sessions/{id}` while it is open: its group and each segment's `num_tokens`,
        `num_sampled` and turns."""
        response = httpx.get(
            f"{self.proxy_url}/v1/sessions/{self.session_id}", headers=self._headers, timeout=self.timeout_s
        )
        response.raise_for_status()
        return response.json()

    @property
    def _headers(self) -> dict[str, str]:
        # The session key may reward or close its own session even where an admin key is set.
        return {"Authorization": f"Bearer {self.api_key}"}

    def _reward_request(self, value: float, info: dict[str, Any] | None) -> dict[str, Any]:
        return {
            "json": {"session_id": self.session_id, "reward": value, "info": info or {}},
            "headers": self._headers,
            "timeout": self.timeout_s,
        }

    def _rewarded(self, response: httpx.Response) -> dict[str, Any]:
        response.raise_for_status()
        self.rewarded = True
        return response.json()


def _create_request(
    proxy_url: str, group_id: str | None, session_id: str | None, admin_key: str | None, timeout_s: float
) -> dict[str, Any]:
    body = {k: v for k, v in {"group_id": group_id, "session_id": session_id}.items() if v is not None}
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    return {"url": f"{proxy_url}/v1/sessions", "json": body, "headers": headers, "timeout": timeout_s}


def _session(proxy_url: str, response: httpx.Response, timeout_s: float) -> MoltSession:
    response.raise_for_status()
    data = response.json()
    return MoltSession(
        proxy_url=proxy_url,
        session_id=data["session_id"],
        group_id=data["group_id"],
        api_key=data["api_key"],
        base_url=data["base_url"],
        timeout_s=timeout_s,
    )


def create_session(
    proxy_url: str,
    *,
    group_id: str | None = None,
    session_id: str | None = None,
    admin_key: str | None = None,
    timeout_s: float = 60.0,
) -> MoltSession:
    """`POST /v1/sessions`. `group_id` groups attempts at one task for GRPO/RLOO baselines
    (left out, the proxy groups by the first prompt); `admin_key` where the proxy has keys: the
    admin key or an agent key (which then owns the session)."""
    proxy_url = proxy_url.rstrip("/")
    request = _create_request(proxy_url, group_id, session_id, admin_key, timeout_s)
    return _session(proxy_url, httpx.post(**request), timeout_s)


@contextmanager
def molt_session(
    proxy_url: str,
    *,
    group_id: str | None = None,
    session_id: str | None = None,
    admin_key: str | None = None,
    timeout_s: float = 60.0,
) -> Iterator[MoltSession]:
    """One episode: `with molt_session(url, group_id="task-3") as s: agent(s.client); s.reward(1.0)`.

    No reward is posted for you, not even when the block raises (see the module docstring)."""
    session = create_session(
        proxy_url, group_id=group_id, session_id=session_id, admin_key=admin_key, timeout_s=timeout_s
    )
    try:
        yield session
    finally:
        if "client" in session.__dict__:
            session.client.close()


@asynccontextmanager
async def amolt_session(
    proxy_url: str,
    *,
    group_id: str | None = None,
    session_id: str | None = None,
    admin_key: str | None = None,
    timeout_s: float = 60.0,
) -> AsyncIterator[MoltSession]:
    """`molt_session` for async agents: `async with amolt_session(url) as s:` then
    `s.async_client` and `await s.areward(...)`."""
    proxy_url = proxy_url.rstrip("/")
    async with httpx.AsyncClient() as http:
        response = await http.post(**_create_request(proxy_url, group_id, session_id, admin_key, timeout_s))
    session = _session(proxy_url, response, timeout_s)
    try:
        yield session
    finally:
        if "async_client" in session.__dict__:
            await session.async_client.close()
