"""Two real vLLM servers on CPU behind one proxy, for what needs real sampling: a replica killed
mid-episode, its session finished exactly on the other. Where a request went is read from each
server's own `/metrics` request counter, not from the proxy. The routing rules, and a killed
replica given the current weights when it is back, are tested on stand-ins in
`test_replicas.py`; a real vLLM relaunched with the trainer's weights in `test_supervision.py`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from devtools import weather_episode
from molt_proxy.launcher import VLLMServer
from tests.conftest import MAX_MODEL_LEN
from tests.helpers import assert_exact, play, trajectories


@pytest.fixture
def spare_vllm(qwen3_model: Path, tmp_path: Path) -> Iterator[VLLMServer]:
    """A second vLLM for the tiny Qwen3 model, which the test kills -9."""
    server = VLLMServer(str(qwen3_model), max_model_len=MAX_MODEL_LEN, log_path=tmp_path / "vllm.log")
    with server:
        yield server


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


def test_killing_the_sessions_replica_mid_episode_finishes_it_exactly_on_the_other(
    qwen3_model, qwen3_vllm, spare_vllm, start_proxy
):
    urls = [spare_vllm.url, qwen3_vllm.url]
    # A long health interval: the request itself finds the dead replica and fails over.
    proxy = start_proxy(qwen3_model, urls, "--tool-call-parser", "hermes", "--health-interval", "600")
    conversation = weather_episode("hermes")
    client = OpenAI(base_url=proxy.base_url("survivor"), api_key="unused", max_retries=0)
    where = Where(urls)
    run = play(client, conversation, replies=2)
    assert where() == [2, 0]
    spare_vllm.kill()  # SIGKILL to its whole process group, reaped
    run = play(client, conversation, run=run)
    assert len(run.replies) == 5
    assert served(qwen3_vllm.url) - where.last[1] == 3
    health = httpx.get(f"{proxy.url}/health", timeout=10).json()
    assert [r["healthy"] for r in health["replicas"]] == [False, True]
    description = httpx.get(f"{proxy.url}/v1/sessions/survivor").json()
    assert len(description["segments"]) == 1, description
    httpx.post(f"{proxy.url}/v1/rewards", json={"session_id": "survivor", "reward": 1.0}).raise_for_status()
    [trajectory] = trajectories(proxy.url)
    assert trajectory["segment"] == 0
    assert [t["completion_id"] for t in trajectory["turns"]] == [r.id for r in run.replies]
    assert_exact(trajectory, qwen3_model)
