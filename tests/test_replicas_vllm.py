"""Several real vLLM servers on CPU behind one proxy, for what needs real sampling: a replica
killed mid-episode, a restarted one given the current weights, and exact trajectories either
way. Where a request went is read from each server's own `/metrics` request counter, not from
the proxy. The routing rules themselves are tested in process in `test_replicas.py`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from devtools import weather_episode
from molt_proxy.launcher import VLLMServer
from tests.conftest import MAX_MODEL_LEN
from tests.helpers import assert_exact, play, trajectories


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
        self.server.kill()  # SIGKILL to its whole process group, reaped


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
