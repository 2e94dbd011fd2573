"""Several vLLM replicas behind one proxy: stickiness, least-loaded placement, failover, and a
restarted replica coming back with the current weights, all in process.

The routing rules are checked on fakes that speak `replicas.UpstreamClient` (cheap, exact about
in-flight counts), then through the real app on two stand-in vLLMs (in process, or as processes
a test kills and restarts). What needs real sampling (a kill -9 mid-episode finished exactly on
the other replica) is in `test_replicas_vllm.py`.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import Any

import httpx
import pytest

from molt_proxy.config import Settings
from molt_proxy.errors import BadRequest, UpstreamUnavailable
from molt_proxy.replicas import Replicas, UpstreamClient
from molt_proxy.store import Store
from molt_proxy.types import Generation
from molt_proxy.upstream import ModelInfo, TokenDelta, Upstream
from tests.helpers import trajectories, write_checkpoint
from tests.inprocess import chat_body, mock_vllm, mock_vllm_process, qwen3_tokenizer_dir, serve_app

# -- routing rules on fake upstreams ----------------------------------------------------------


# What every fake replica samples: two ids, streamed one at a time.
DELTAS = [TokenDelta([7], [-0.5]), TokenDelta([8], [-0.25])]
GENERATION = Generation([7, 8], [-0.5, -0.25], [0, 0], "stop")


class FakeUpstream:
    """Speaks `UpstreamClient` in process: answers `GENERATION` at once unless `gate` holds
    it, fails when down."""

    def __init__(self, name: str):
        self.base_url = f"http://{name}"
        self.up = True
        self.error: Exception | None = None
        self.gate: asyncio.Event | None = None
        self.die_after_first = False
        self.prompts: list[list[int]] = []
        self.loaded: list[tuple[str, int]] = []
        self.opened = False
        self.streams_closed = 0

    async def __aenter__(self) -> FakeUpstream:
        self.opened = True
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.opened = False

    def _check(self) -> None:
        if not self.up:
            raise UpstreamUnavailable(f"{self.base_url} is down")
        if self.error is not None:
            raise self.error

    async def generate(
        self, prompt_ids: list[int], sampling: dict[str, Any], *, return_prompt_ids: bool = False
    ) -> Generation:
        self._check()
        if self.gate is not None:
            await self.gate.wait()
        self.prompts.append(list(prompt_ids))
        return GENERATION

    async def stream(
        self, prompt_ids: list[int], sampling: dict[str, Any], *, return_prompt_ids: bool = False
    ) -> AsyncGenerator[TokenDelta | Generation, None]:
        self._check()
        self.prompts.append(list(prompt_ids))
        try:
            for delta in DELTAS:
                yield delta
                if self.die_after_first:
                    raise UpstreamUnavailable(f"{self.base_url} died mid-stream")
            yield GENERATION
        finally:
            self.streams_closed += 1

    async def healthy(self) -> bool:
        return self.up

    async def refresh_weights(self, weights_dir: str, version: int) -> None:
        self._check()
        self.loaded.append((weights_dir, version))

    async def models(self) -> list[dict[str, Any]]:
        self._check()
        return [{"id": self.base_url, "max_model_len": 2048}]

    async def model(self) -> ModelInfo:
        first = (await self.models())[0]
        return ModelInfo(first["id"], first["max_model_len"])


async def until(condition: Callable[[], bool]) -> None:
    """Return once `condition` holds (polled; the caller bounds the wait)."""
    while not condition():
        await asyncio.sleep(0.005)


def _fakes(n: int = 2, **kwargs: Any) -> tuple[Replicas, list[FakeUpstream]]:
    fakes = [FakeUpstream(f"r{i}") for i in range(n)]
    return Replicas(fakes, **kwargs), fakes


def _protocol_methods() -> list[str]:
    return [
        name
        for name, member in vars(UpstreamClient).items()
        if inspect.isfunction(member) and member.__qualname__.startswith("UpstreamClient.")
    ]


@pytest.mark.parametrize("speaker", [Upstream, FakeUpstream])
def test_the_real_upstream_and_the_fake_speak_the_protocol_replicas_uses(speaker):
    """Without a type checker in CI, the fake's honesty is checked here: same methods, same
    parameters, same kind (coroutine or async generator) as the protocol declares."""
    assert len(_protocol_methods()) == 8
    for name in _protocol_methods():
        declared, spoken = getattr(UpstreamClient, name), getattr(speaker, name)
        assert inspect.signature(spoken).parameters.keys() == inspect.signature(declared).parameters.keys()
        kinds = [(p.kind, p.default) for p in inspect.signature(declared).parameters.values()]
        assert [(p.kind, p.default) for p in inspect.signature(spoken).parameters.values()] == kinds
        if name == "stream":  # declared as a plain def returning the generator
            assert inspect.isasyncgenfunction(spoken), name
        else:
            assert inspect.iscoroutinefunction(spoken), name
    assert isinstance(speaker("http://r0").base_url, str)


async def _on(replicas: Replicas, fakes: list[FakeUpstream], affinity: str) -> int:
    """Generate for `affinity`; return the index of the fake that answered."""
    before = [len(f.prompts) for f in fakes]
    await replicas.generate(affinity, [1, 2, 3], {})
    return next(i for i, f in enumerate(fakes) if len(f.prompts) > before[i])


def test_sessions_stick_and_new_ones_go_to_the_least_loaded():
    async def scenario() -> None:
        replicas, fakes = _fakes()
        await replicas.start()
        assert [await _on(replicas, fakes, s) for s in ("s1", "s2", "s3", "s1", "s2", "s3")] == [0, 1, 0] * 2
        # In flight outranks sessions: r1 has one session fewer but a request in flight.
        fakes[1].gate = asyncio.Event()
        held = asyncio.create_task(replicas.generate("s2", [1], {}))
        await asyncio.sleep(0)
        assert await _on(replicas, fakes, "s4") == 0
        fakes[1].gate.set()
        await held
        # A released session frees its place: r0 now has fewer sessions.
        for session in ("s1", "s3", "s4"):
            replicas.release(session)
        assert await _on(replicas, fakes, "s5") == 0
        assert [r["sessions"] for r in replicas.describe()] == [1, 1]
        await replicas.stop()
        assert not any(f.opened for f in fakes)

    asyncio.run(scenario())


def test_weights_stored_before_a_proxy_restart_are_loaded_before_traffic(tmp_path):
    async def scenario() -> None:
        store = Store(tmp_path / "s.db")
        await store.open()
        await store.save_weights("/w/v2", 2)
        await store.save_weights("/w/v3", 3)
        weights = await store.last_weights()
        await store.close()
        assert weights == ("/w/v3", 3)
        replicas, fakes = _fakes()
        await replicas.start(weights)
        assert [f.loaded for f in fakes] == [[("/w/v3", 3)]] * 2
        assert [r["weight_version"] for r in replicas.describe()] == [3, 3]
        await replicas.stop()

    asyncio.run(scenario())


def test_an_unreachable_replica_is_taken_out_and_its_session_moves():
    async def scenario() -> None:
        replicas, fakes = _fakes()
        await replicas.start()
        assert await _on(replicas, fakes, "s1") == 0
        fakes[0].up = False
        assert await _on(replicas, fakes, "s1") == 1  # retried there, same prompt
        assert fakes[1].prompts[-1] == [1, 2, 3]
        assert [r["healthy"] for r in replicas.describe()] == [False, True]
        fakes[0].up = True
        await replicas.check_health()
        assert await _on(replicas, fakes, "s1") == 1  # it stays where its cache now is
        fakes[0].up = fakes[1].up = False
        with pytest.raises(UpstreamUnavailable):
            await replicas.generate("s1", [1], {})
        with pytest.raises(UpstreamUnavailable):
            await replicas.models()
        with pytest.raises(UpstreamUnavailable):
            await replicas.model()
        assert [r["healthy"] for r in replicas.describe()] == [False, False]
        await replicas.stop()

    asyncio.run(scenario())


def test_a_rejected_request_does_not_fail_over():
    async def scenario() -> None:
        replicas, fakes = _fakes()
        await replicas.start()
        fakes[0].error = BadRequest("no such sampling field")
        with pytest.raises(BadRequest):
            await replicas.generate("s1", [1], {})
        assert fakes[1].prompts == [] and [r["healthy"] for r in replicas.describe()] == [True, True]
        await replicas.stop()

    asyncio.run(scenario())


def test_a_stream_fails_over_only_before_its_first_item():
    async def scenario() -> None:
        replicas, fakes = _fakes()
        await replicas.start()
        fakes[0].up = False
        assert [item async for item in replicas.stream("s1", [1], {})] == [*DELTAS, GENERATION]
        assert len(fakes[1].prompts) == 1
        fakes[0].up = True
        await replicas.check_health()
        fakes[1].die_after_first = True
        seen = []
        with pytest.raises(UpstreamUnavailable):
            async for item in replicas.stream("s1", [1], {}):
                seen.append(item)
        assert seen == DELTAS[:1] and fakes[0].prompts == []  # no retry after tokens went out
        assert [r["in_flight"] for r in replicas.describe()] == [0, 0]
        await replicas.stop()

    asyncio.run(scenario())


def test_a_stream_left_early_is_closed_on_its_replica_and_frees_it():
    async def scenario() -> None:
        replicas, fakes = _fakes()
        await replicas.start()
        async with aclosing(replicas.stream("s1", [1], {})) as items:
            async for item in items:
                assert item == DELTAS[0]
                break
        assert fakes[0].streams_closed == 1  # the upstream's request ends with it
        assert [(r["in_flight"], r["requests"]) for r in replicas.describe()] == [(0, 1), (0, 0)]
        await replicas.stop()

    asyncio.run(scenario())


def test_a_returning_replica_gets_the_current_weights_before_traffic():
    async def scenario() -> None:
        replicas, fakes = _fakes(health_interval_s=0.01)
        fakes[0].up = False
        await replicas.start()
        assert await replicas.refresh_weights("/w/3", 3) == ["http://r1"]
        assert fakes[0].loaded == [] and fakes[1].loaded == [("/w/3", 3)]
        fakes[0].up = True
        # the background check (every 0.01 s) brings it back: waited for, never timed
        await asyncio.wait_for(until(lambda: bool(fakes[0].loaded)), timeout=60)
        assert fakes[0].loaded == [("/w/3", 3)]
        assert [r["weight_version"] for r in replicas.describe()] == [3, 3]
        # A replica that fails a reload is taken out; the others keep the new weights.
        fakes[1].error = UpstreamUnavailable("reload failed")
        assert await replicas.refresh_weights("/w/4", 4) == ["http://r0"]
        assert [r["healthy"] for r in replicas.describe()] == [True, False]
        await replicas.stop()

    asyncio.run(scenario())


# -- through the app, on two stand-in vLLMs -------------------------------------------------


class Agent:
    """One session's conversation with an in-process proxy, a turn at a time."""

    def __init__(self, proxy_url: str, session: str):
        self.url = f"{proxy_url}/s/{session}/v1/chat/completions"
        self.messages: list[dict[str, Any]] = []

    def turns(self, n: int) -> None:
        for _ in range(n):
            self.messages.append({"role": "user", "content": f"turn {len(self.messages)}"})
            reply = httpx.post(self.url, json=chat_body(messages=self.messages), timeout=60)
            assert reply.status_code == 200, reply.text
            self.messages.append(reply.json()["choices"][0]["message"])


class Served:
    """Which stand-in vLLM(s) answered since the last call, read from their request logs."""

    def __init__(self, urls: list[str]):
        self.urls = urls
        self.last = [0] * len(urls)

    def __call__(self) -> list[int]:
        now = [len(httpx.get(f"{url}/_generated").json()) for url in self.urls]
        delta = [b - a for a, b in zip(self.last, now, strict=True)]
        self.last = now
        return delta


def test_through_the_proxy_sessions_stick_and_new_ones_go_to_the_least_loaded(tmp_path):
    """Placement end to end through the app, on two in-process stand-in vLLMs: placement
    needs no real sampling."""
    model = qwen3_tokenizer_dir()
    with mock_vllm(model) as r0, mock_vllm(model) as r1:
        settings = Settings(model=str(model), upstreams=[r0, r1], db_path=tmp_path / "s.db")
        with serve_app(settings) as proxy:

            def sessions() -> list[int]:
                return [r["sessions"] for r in httpx.get(f"{proxy}/health").json()["replicas"]]

            where = Served([r0, r1])
            first, second = Agent(proxy, "first"), Agent(proxy, "second")
            first.turns(2)
            assert where() == [2, 0]
            second.turns(2)  # r0 holds a session, r1 none
            assert where() == [0, 2]
            first.turns(3)
            second.turns(3)
            assert where() == [3, 3]  # every turn on its session's replica
            assert sessions() == [1, 1]
            rewarded = httpx.post(f"{proxy}/v1/rewards", json={"session_id": "first", "reward": 1.0})
            rewarded.raise_for_status()  # r0 is now the less loaded one
            Agent(proxy, "third").turns(1)
            assert where() == [1, 0]
            Agent(proxy, "fourth").turns(1)  # a tie goes to the first listed
            assert where() == [1, 0]
            assert sessions() == [2, 1]


def test_a_killed_replica_is_taken_out_refreshed_around_and_back_with_the_current_weights(tmp_path):
    """Two stand-in vLLM processes behind the app. One is killed -9: the health check takes it
    out with no request sent, a weights push meanwhile reaches only the other, and when it is
    back (a new process on its port, with its boot weights) it is given the current weights
    before any traffic, then takes the next session as the least loaded. (A real vLLM relaunched
    and given the trainer's weights, its trajectory exact, is in `test_supervision.py`.)"""
    model = qwen3_tokenizer_dir()
    servers = [mock_vllm_process(model, tmp_path / f"r{i}.log") for i in range(2)]
    weights = write_checkpoint(tmp_path / "weights")
    try:
        urls = [server.wait(timeout_s=60).url for server in servers]
        settings = Settings(
            model=str(model), upstreams=urls, db_path=tmp_path / "p.db", health_interval_s=0.2
        )
        with serve_app(settings) as proxy:

            def replicas() -> list[dict[str, Any]]:
                return httpx.get(f"{proxy}/health", timeout=10).json()["replicas"]

            servers[0].kill()
            wait_until(lambda: not replicas()[0]["healthy"], 30)
            pushed = httpx.post(
                f"{proxy}/v1/admin/weights", json={"path": str(weights), "version": 5}, timeout=60
            )
            assert pushed.status_code == 200, pushed.text
            assert pushed.json()["replicas"] == [urls[1]]
            Agent(proxy, "meanwhile").turns(1)  # on the live one

            servers[0].spawn()
            wait_until(lambda: replicas()[0]["healthy"], 60)
            assert [r["weight_version"] for r in replicas()] == [5, 5]
            # The new process's first and only calls: the refresh, and nothing sampled before it.
            assert httpx.get(f"{urls[0]}/_calls").json() == [
                ["/pause?mode=keep", None],
                ["/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(weights)}}],
                ["/update_weight_version", {"new_version": "5"}],
                ["/resume", None],
            ]
            where = Served(urls)
            assert where() == [0, 1]  # nothing sampled on the returned one yet
            Agent(proxy, "back").turns(2)
            assert where() == [2, 0]  # the least loaded again: "meanwhile" holds the other
            rewarded = httpx.post(f"{proxy}/v1/rewards", json={"session_id": "back", "reward": 1.0})
            rewarded.raise_for_status()
            [trajectory] = [t for t in trajectories(proxy) if t["session_id"] == "back"]
            sampled = [
                v for v, m in zip(trajectory["weight_versions"], trajectory["loss_mask"], strict=True) if m
            ]
            assert sampled and set(sampled) == {5}
    finally:
        for server in servers:
            server.kill()


def wait_until(condition: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
