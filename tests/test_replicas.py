"""Several vLLM replicas behind one proxy: stickiness, least-loaded placement, failover with
an exact trajectory, and a restarted replica coming back with the current weights.

The routing rules are first checked on fake upstreams (cheap, exact about in-flight counts);
then against two real vLLM servers on CPU, where where a request went is read from each
server's own `/metrics` request counter, not from the proxy.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from molt_proxy.errors import BadRequest, UpstreamUnavailable
from molt_proxy.launcher import VLLMServer
from molt_proxy.replicas import Replicas
from molt_proxy.store import Store
from molt_proxy.tinymodel import weather_episode
from molt_proxy.types import Generation
from tests.conftest import MAX_MODEL_LEN
from tests.helpers import assert_exact, play, trajectories

# -- routing rules on fake upstreams ----------------------------------------------------------


class FakeUpstream:
    """Stands in for `Upstream`: answers at once unless `gate` holds it, fails when down."""

    def __init__(self, name: str):
        self.base_url = f"http://{name}"
        self.up = True
        self.error: Exception | None = None
        self.gate: asyncio.Event | None = None
        self.die_after_first = False
        self.prompts: list[list[int]] = []
        self.loaded: list[tuple[str, int]] = []

    async def __aenter__(self) -> FakeUpstream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass

    def _check(self) -> None:
        if not self.up:
            raise UpstreamUnavailable(f"{self.base_url} is down")
        if self.error is not None:
            raise self.error

    async def generate(self, prompt_ids: list[int], sampling: dict[str, Any], **_: Any) -> Generation:
        self._check()
        if self.gate is not None:
            await self.gate.wait()
        self.prompts.append(list(prompt_ids))
        return Generation([1], [0.0], [0], "stop")

    async def stream(self, prompt_ids: list[int], sampling: dict[str, Any]) -> AsyncIterator[str]:
        self._check()
        self.prompts.append(list(prompt_ids))
        for item in ("a", "b"):
            yield item
            if self.die_after_first:
                raise UpstreamUnavailable(f"{self.base_url} died mid-stream")

    async def healthy(self) -> bool:
        return self.up

    async def refresh_weights(self, weights_dir: str, version: int) -> None:
        self._check()
        self.loaded.append((weights_dir, version))

    async def models(self) -> list[dict[str, Any]]:
        self._check()
        return [{"id": self.base_url}]


def _fakes(n: int = 2, **kwargs: Any) -> tuple[Replicas, list[FakeUpstream]]:
    fakes = [FakeUpstream(f"r{i}") for i in range(n)]
    return Replicas(fakes, **kwargs), fakes  # type: ignore[arg-type]


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
        assert not await replicas.healthy()
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
        assert [item async for item in replicas.stream("s1", [1], {})] == ["a", "b"]
        assert len(fakes[1].prompts) == 1
        fakes[0].up = True
        await replicas.check_health()
        fakes[1].die_after_first = True
        seen = []
        with pytest.raises(UpstreamUnavailable):
            async for item in replicas.stream("s1", [1], {}):
                seen.append(item)
        assert seen == ["a"] and fakes[0].prompts == []  # no retry after tokens went out
        assert [r["in_flight"] for r in replicas.describe()] == [0, 0]
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
        await asyncio.sleep(0.1)  # the background check brings it back
        assert fakes[0].loaded == [("/w/3", 3)]
        assert [r["weight_version"] for r in replicas.describe()] == [3, 3]
        # A replica that fails a reload is taken out; the others keep the new weights.
        fakes[1].error = UpstreamUnavailable("reload failed")
        assert await replicas.refresh_weights("/w/4", 4) == ["http://r0"]
        assert [r["healthy"] for r in replicas.describe()] == [True, False]
        await replicas.stop()

    asyncio.run(scenario())


# -- two real vLLM servers ------------------------------------------------------------------


class SpareServer:
    """A second vLLM for the tiny Qwen3 model that tests may kill -9 and restart on its port."""

    def __init__(self, model: Path, log_dir: Path):
        self.model, self.log_dir = model, log_dir
        self.server = self._server(None)

    def _server(self, port: int | None) -> VLLMServer:
        return VLLMServer(
            str(self.model), port=port, max_model_len=MAX_MODEL_LEN, log_path=self.log_dir / "vllm.log"
        )

    @property
    def url(self) -> str:
        return self.server.url

    def ensure_running(self) -> None:
        process = self.server.process
        if process is None or process.poll() is not None:
            self.server = self._server(self.server.port).start()

    def kill9(self) -> None:
        process = self.server.process
        assert process is not None
        os.killpg(process.pid, signal.SIGKILL)  # its own session: the group id is its pid
        process.wait()


@pytest.fixture(scope="module")
def spare_vllm(qwen3_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SpareServer]:
    spare = SpareServer(qwen3_model, tmp_path_factory.mktemp("vllm-spare"))
    spare.ensure_running()
    yield spare
    spare.server.stop()


def served(url: str) -> float:
    """Requests this vLLM server finished, by its own Prometheus counter."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total")
    )


class Where:
    """Which server(s) answered since the last call, read from their counters."""

    def __init__(self, urls: list[str]):
        self.urls = urls
        self.last = [served(u) for u in urls]

    def __call__(self) -> list[int]:
        now = [served(u) for u in self.urls]
        delta = [round(b - a) for a, b in zip(self.last, now, strict=True)]
        self.last = now
        return delta


def health(proxy) -> dict[str, Any]:
    return httpx.get(f"{proxy.url}/health", timeout=10).json()


def wait_until(condition: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def reward(proxy, session: str) -> None:
    httpx.post(f"{proxy.url}/v1/rewards", json={"session_id": session, "reward": 1.0}).raise_for_status()


def test_real_replicas_keep_sessions_and_place_new_ones_on_the_least_loaded(
    qwen3_model, qwen3_vllm, spare_vllm, start_proxy
):
    spare_vllm.ensure_running()
    urls = [spare_vllm.url, qwen3_vllm.url]
    proxy = start_proxy(qwen3_model, urls, "--tool-call-parser", "hermes")
    conversation = weather_episode("hermes")
    where = Where(urls)

    def client(session: str) -> OpenAI:
        return OpenAI(base_url=proxy.base_url(session), api_key="unused", max_retries=0)

    first = play(client("first"), conversation, replies=2)
    assert where() == [2, 0]
    second = play(client("second"), conversation, replies=2)  # r0 holds a session, r1 none
    assert where() == [0, 2]
    play(client("first"), conversation, run=first)
    play(client("second"), conversation, run=second)
    assert where() == [3, 3]  # every turn on its session's replica
    assert [r["sessions"] for r in health(proxy)["replicas"]] == [1, 1]
    reward(proxy, "first")  # r0 is now the less loaded one
    play(client("third"), conversation, replies=1)
    assert where() == [1, 0]
    play(client("fourth"), conversation, replies=1)  # a tie goes to the first listed
    assert where() == [1, 0]
    assert [r["sessions"] for r in health(proxy)["replicas"]] == [2, 1]


def test_dead_replica_is_noticed_and_a_restarted_one_comes_back_with_the_current_weights(
    qwen3_model, qwen3_vllm, spare_vllm, start_proxy
):
    spare_vllm.ensure_running()
    urls = [spare_vllm.url, qwen3_vllm.url]
    proxy = start_proxy(qwen3_model, urls, "--tool-call-parser", "hermes", "--health-interval", "0.5")
    conversation = weather_episode("hermes")
    try:
        spare_vllm.kill9()
        wait_until(lambda: not health(proxy)["replicas"][0]["healthy"], 30)  # no request needed
        assert health(proxy)["status"] == "degraded"
        # New weights while it is down (the base weights, labelled 5: the shared server's
        # sampling stays the taught model's, so the episode below still follows its script).
        refreshed = httpx.post(
            f"{proxy.url}/v1/admin/weights", json={"path": str(qwen3_model), "version": 5}, timeout=300
        )
        assert refreshed.status_code == 200, refreshed.text
        assert refreshed.json()["replicas"] == [qwen3_vllm.url]
        play(OpenAI(base_url=proxy.base_url("meanwhile"), api_key="x"), conversation, replies=1)

        spare_vllm.ensure_running()  # boots with its original weights, labelled "default"
        wait_until(lambda: health(proxy)["replicas"][0]["healthy"], 120)
        assert httpx.get(f"{spare_vllm.url}/weight_info").json()["weight_version"] == "5"
        assert [r["weight_version"] for r in health(proxy)["replicas"]] == [5, 5]

        where = Where(urls)
        replies = play(OpenAI(base_url=proxy.base_url("back"), api_key="x"), conversation).replies
        assert where() == [5, 0]  # the least loaded again: "meanwhile" holds r1
        reward(proxy, "back")
        [trajectory] = [t for t in trajectories(proxy.url) if t["session_id"] == "back"]
        assert [t["completion_id"] for t in trajectory["turns"]] == [r.id for r in replies]
        sampled = [
            v for v, m in zip(trajectory["weight_versions"], trajectory["loss_mask"], strict=True) if m
        ]
        assert set(sampled) == {5}
        assert_exact(trajectory, qwen3_model)
    finally:
        # The shared server serves other tests: put its label back to 0, through a proxy of
        # its own (this one refuses a version that goes back).
        fresh = start_proxy(qwen3_model, qwen3_vllm)
        httpx.post(
            f"{fresh.url}/v1/admin/weights", json={"path": str(qwen3_model), "version": 0}, timeout=300
        )


def test_killing_the_sessions_replica_mid_episode_finishes_it_exactly_on_the_other(
    qwen3_model, qwen3_vllm, spare_vllm, start_proxy
):
    spare_vllm.ensure_running()
    urls = [spare_vllm.url, qwen3_vllm.url]
    # A long health interval: the request itself finds the dead replica and fails over.
    proxy = start_proxy(qwen3_model, urls, "--tool-call-parser", "hermes", "--health-interval", "600")
    conversation = weather_episode("hermes")
    client = OpenAI(base_url=proxy.base_url("survivor"), api_key="unused", max_retries=0)
    where = Where(urls)
    run = play(client, conversation, replies=2)
    assert where() == [2, 0]
    spare_vllm.kill9()
    run = play(client, conversation, run=run)
    assert len(run.replies) == 5
    assert served(qwen3_vllm.url) - where.last[1] == 3
    assert [r["healthy"] for r in health(proxy)["replicas"]] == [False, True]
    description = httpx.get(f"{proxy.url}/v1/sessions/survivor").json()
    assert len(description["segments"]) == 1, description
    reward(proxy, "survivor")
    [trajectory] = trajectories(proxy.url)
    assert trajectory["segment"] == 0
    assert [t["completion_id"] for t in trajectory["turns"]] == [r.id for r in run.replies]
    assert_exact(trajectory, qwen3_model)
