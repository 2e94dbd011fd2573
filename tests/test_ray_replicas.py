"""vLLM replicas as Ray actors (`serve --ray-address ... --replicas 2`) on a real Ray cluster of
two nodes on this machine (`ray start --head` and `ray start --address ...`), each node offering
one unit of a custom resource that each replica asks for, so Ray places one replica per node.

One test, since two CPU vLLM servers are what this machine affords: one replica per node
(distinct node ids in `/health`), an episode through each replica exact, a weights refresh
shipped through Ray's object store, and a replica whose actor is killed -9 restarted by Ray
and given the trainer's weights before traffic, from the object store, after the trainer's
folder is gone (so no replica could have read it from disk).

The cluster runs with `RAY_AUTH_MODE=disabled` (Ray 2.60's `ray start` otherwise writes a token
to `~/.ray`, which every Ray cluster of this user on this machine would share) and without
Ray's memory monitor (`RAY_memory_monitor_refresh_ms=0`), which kills actors when the whole
machine's memory is nearly full, whoever else uses it (CI runs other vLLM servers meanwhile).
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from devtools import weather_episode
from molt_proxy.cli import parser, settings_from_args
from molt_proxy.launcher import ProxyServer, RayNode, free_port
from molt_proxy.ray_replicas import RayReplica, actor_options
from molt_proxy.replicas import UpstreamClient
from tests.helpers import Run, assert_exact, play, trajectories
from tests.test_replicas import _protocol_methods

RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_memory_monitor_refresh_ms": "0"}

# -- without a cluster ------------------------------------------------------------------------


def test_replica_resources_become_ray_options_and_bad_ones_are_refused(capsys):
    args = parser().parse_args(["serve", "--model", "m", "--ray-address", "auto", "--replicas", "2",
                                "--replica-resources", '{"GPU": 1, "CPU": 2, "node_a": 1}'])  # fmt: skip
    settings = settings_from_args(args, None, [])
    assert settings.replica_resources == {"GPU": 1.0, "CPU": 2.0, "node_a": 1.0}
    assert actor_options(settings.replica_resources, settings.max_restarts) == {
        "num_cpus": 2.0, "num_gpus": 1.0, "resources": {"node_a": 1.0},
        "max_restarts": 5, "max_concurrency": 4,
    }  # fmt: skip
    assert actor_options({}, 0)["num_cpus"] == 0  # vLLM does its own threading
    with pytest.raises(SystemExit):
        parser().parse_args(["serve", "--model", "m", "--replica-resources", '{"GPU": -1}'])
    assert "is not a JSON object of resource amounts (numbers >= 0)" in capsys.readouterr().err
    alone = parser().parse_args(["serve", "--model", "m", "--replica-resources", '{"GPU": 1}'])
    with pytest.raises(ValueError, match="--replica-resources places replicas on Ray: give --ray-address"):
        settings_from_args(alone, None, [])


def test_a_ray_replica_speaks_the_protocol_replicas_uses():
    for name in _protocol_methods():
        declared, spoken = getattr(UpstreamClient, name), getattr(RayReplica, name)
        assert inspect.signature(spoken).parameters.keys() == inspect.signature(declared).parameters.keys()
        # `stream` hands on its upstream's generator (a plain def, as declared); the rest are coroutines
        assert inspect.iscoroutinefunction(spoken) == (name != "stream"), name


# -- on a two-node cluster --------------------------------------------------------------------


NODE_ARGS = ["--num-cpus", "1", "--resources", json.dumps({"vllm": 1})]
NODE_ARGS += ["--object-store-memory", str(200 * 2**20), "--disable-usage-stats"]


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """The address of a two-node Ray cluster (a short temp dir: Ray's socket paths are long)."""
    folder = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))
    port = free_port()
    head_args = ["--head", "--port", str(port), "--include-dashboard", "false", "--temp-dir", str(folder)]
    head = RayNode([*head_args, *NODE_ARGS], folder / "head.log", RAY_ENV).start()
    try:
        address = head.address
        with RayNode(["--address", address, *NODE_ARGS], folder / "worker.log", RAY_ENV):
            yield address
    finally:
        head.stop()
        shutil.rmtree(folder, ignore_errors=True)


def wait_until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.0f} s: {what}")
        time.sleep(0.5)


def episode(
    proxy: ProxyServer, session: str, model: Path, replies: int | None = None, run: Run | None = None
) -> Any:
    """The scripted weather episode in `session` (its first `replies`, or the rest of `run`);
    once whole, rewarded and its trajectory checked exact and returned."""
    client = OpenAI(base_url=proxy.base_url(session), api_key="unused", max_retries=0)
    run = play(client, weather_episode("hermes"), run=run, replies=replies)
    if replies is not None:
        return run
    assert len(run.replies) == 5
    httpx.post(f"{proxy.url}/v1/rewards", json={"session_id": session, "reward": 1.0}).raise_for_status()
    [trajectory] = [t for t in trajectories(proxy.url) if t["session_id"] == session]
    assert [t["completion_id"] for t in trajectory["turns"]] == [r.id for r in run.replies]
    assert_exact(trajectory, model)
    return trajectory


def sampled_versions(trajectory: dict[str, Any]) -> set[int]:
    return {v for v, m in zip(trajectory["weight_versions"], trajectory["loss_mask"], strict=True) if m}


def served_version(url: str) -> str:
    return httpx.get(f"{url}/weight_info", timeout=10).json()["weight_version"]


@pytest.mark.timeout(600)
def test_replicas_on_two_ray_nodes_serve_exactly_refresh_through_ray_and_come_back(
    qwen3_model, ray_cluster, tmp_path
):
    proxy = ProxyServer(
        qwen3_model,
        db=tmp_path / "p.db",
        log_path=tmp_path / "proxy.log",
        args=[
            "--ray-address", ray_cluster, "--replicas", "2", "--replica-resources", '{"vllm": 1}',
            "--max-model-len", "2048", "--tool-call-parser", "hermes", "--verify-prompt-ids",
            "--health-interval", "1", "--health-timeout", "5",
        ],
    )  # fmt: skip
    proxy.env.update(RAY_ENV)

    def replicas() -> list[dict[str, Any]]:
        return httpx.get(f"{proxy.url}/health", timeout=30).json()["replicas"]

    proxy.boot_timeout_s = 400  # two CPU vLLMs boot at once
    with proxy:
        placed = replicas()
        assert [r["healthy"] for r in placed] == [True, True]
        assert len({r["process"]["node_id"] for r in placed}) == 2, placed  # one replica per node

        # A session sticks to the replica of its first turn; one opened meanwhile goes to the other.
        started = episode(proxy, "a", qwen3_model, replies=1)
        second = episode(proxy, "b", qwen3_model)
        first = episode(proxy, "a", qwen3_model, run=started)
        assert [r["requests"] for r in replicas()] == [5, 5]
        assert sampled_versions(first) | sampled_versions(second) == {0}

        # Weights through Ray: a copy of the model labelled 1, removed once loaded.
        pushed = tmp_path / "weights" / "v1"
        shutil.copytree(qwen3_model, pushed)
        refreshed = httpx.post(
            f"{proxy.url}/v1/admin/weights", json={"path": str(pushed), "version": 1}, timeout=300
        )
        assert refreshed.status_code == 200, refreshed.text
        assert sorted(refreshed.json()["replicas"]) == sorted(r["url"] for r in placed)
        shutil.rmtree(pushed)
        assert [served_version(r["url"]) for r in placed] == ["1", "1"]

        # The first replica's actor is killed -9: Ray restarts it on its node (the only other
        # unit of "vllm" is taken), and it gets version 1 before traffic, from the object store.
        killed = placed[0]
        os.kill(killed["process"]["pid"], signal.SIGKILL)
        wait_until(lambda: not replicas()[0]["healthy"], 30, "the killed replica is taken out")
        wait_until(
            lambda: replicas()[0]["healthy"] and replicas()[0]["process"]["restarts"] == 1,
            300,
            "Ray restarted the replica's actor and it is back",
        )
        back = replicas()[0]
        assert back["process"]["node_id"] == killed["process"]["node_id"]
        assert back["process"]["pid"] != killed["process"]["pid"]
        assert back["weight_version"] == 1 and served_version(back["url"]) == "1"
        with pytest.raises(httpx.TransportError):  # its old vLLM died with the actor
            httpx.get(f"{killed['url']}/health", timeout=5)

        third = episode(proxy, "c", qwen3_model)  # least loaded, first wins ties: the restarted one
        assert replicas()[0]["requests"] == 5 + 5
        assert sampled_versions(third) == {1}
