"""The vLLM servers `molt-proxy serve` launches are supervised: one that dies or hangs is reaped
(or killed) and relaunched on its port, with bounded restarts and back-off, and comes back with
the trainer's current weights; meanwhile requests fail over, or get 503 with `Retry-After`.
Also: a seeded prompt long enough for chunked prefill no longer kills CPU vLLM, and SIGTERM
stops every vLLM server `serve` launched.

The restart policy is checked first on a cheap real process (no vLLM: the policy is about
processes and time); then on two real vLLM servers on CPU, launched by `serve --replicas 2` (what vLLM itself
does: the seed workaround, its orphaned engine, the weights and exact ids after a relaunch);
then the proxy's failover around a hung replica, on stand-in vLLM processes it supervises.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from devtools import weather_episode
from molt_proxy.config import Settings
from molt_proxy.launcher import ProcessState, Supervisor, VLLMServer, free_port
from tests.conftest import ProxyProcess
from tests.helpers import assert_exact, play, trajectories
from tests.inprocess import chat_body, mock_vllm_process, qwen3_tokenizer_dir, serve_app

# -- the restart policy, on a process that is not vLLM ------------------------------------------


def sleeper(tmp_path: Path) -> VLLMServer:
    """A `VLLMServer` whose command is a plain sleeping Python: spawned, killed and reaped
    like vLLM, in its own process group, in milliseconds."""
    server = VLLMServer("unused", log_path=tmp_path / "sleeper.log")
    server.command = [sys.executable, "-c", "import time; time.sleep(600)"]
    return server.spawn()


def zombie_or_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # also succeeds for a zombie: its pid is held until it is reaped
    except ProcessLookupError:
        return False
    return True


def exited(pid: int) -> None:
    """Return once the child `pid` has exited, leaving it unreaped (`WNOWAIT`): reaping it is
    the supervisor's job, which the test checks."""
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)


class Clock:
    """The supervisor's monotonic seconds, which pass only when the test moves them on."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_dead_or_hung_server_is_reaped_relaunched_with_back_off_then_given_up(tmp_path):
    async def scenario() -> None:
        server, clock = sleeper(tmp_path), Clock()
        supervisor = Supervisor(server, max_restarts=2, backoff_s=0.5, window_s=600, clock=clock)
        await supervisor.observe(True)
        assert supervisor.state is ProcessState.RUNNING

        first = server.process.pid
        os.kill(first, signal.SIGKILL)  # it dies
        exited(first)
        await supervisor.observe(False)
        assert supervisor.state is ProcessState.BACKING_OFF
        assert not zombie_or_alive(first), "the dead server must be reaped, not left <defunct>"
        assert supervisor.describe() == {
            "state": "backing_off", "pid": None, "restarts": 0, "last_exit_code": -signal.SIGKILL,
        }  # fmt: skip
        clock.now += 0.4
        await supervisor.observe(False)  # the back-off (0.5 s) has not passed
        assert supervisor.state is ProcessState.BACKING_OFF
        clock.now += 0.1
        await supervisor.observe(False)
        assert supervisor.state is ProcessState.BOOTING and supervisor.restarts == 1
        second = server.process.pid
        assert second != first and server.url.endswith(f":{server.port}")  # same port, same URL
        await supervisor.observe(False)  # booting: not healthy yet is no reason to kill it
        assert zombie_or_alive(second)
        await supervisor.observe(True)
        assert supervisor.state is ProcessState.RUNNING

        os.kill(second, signal.SIGSTOP)  # it hangs: alive, but its probes fail
        await supervisor.observe(False)
        assert supervisor.state is ProcessState.BACKING_OFF and not zombie_or_alive(second)
        clock.now += 0.9
        await supervisor.observe(False)
        assert supervisor.state is ProcessState.BACKING_OFF, "the second back-off is doubled (1 s)"
        clock.now += 0.1
        await supervisor.observe(False)
        assert supervisor.state is ProcessState.BOOTING and supervisor.restarts == 2

        third = server.process.pid
        os.kill(third, signal.SIGKILL)  # a third death within the window: it stays down
        exited(third)
        await supervisor.observe(False)
        assert supervisor.state is ProcessState.GAVE_UP and supervisor.restarts == 2
        assert not zombie_or_alive(third)
        clock.now += 3600  # long past the window: still down, until the proxy restarts
        await supervisor.observe(False)
        assert supervisor.state is ProcessState.GAVE_UP and supervisor.restarts == 2
        server.stop()

    asyncio.run(scenario())


def test_a_server_that_never_becomes_healthy_is_killed_after_the_boot_timeout(tmp_path):
    async def scenario() -> None:
        server, clock = sleeper(tmp_path), Clock()
        supervisor = Supervisor(server, backoff_s=0.0, boot_timeout_s=300, clock=clock)
        pid = server.process.pid
        await supervisor.observe(False)
        assert supervisor.state is ProcessState.BOOTING
        clock.now += 300
        await supervisor.observe(False)  # not yet past the timeout
        assert supervisor.state is ProcessState.BOOTING and zombie_or_alive(pid)
        clock.now += 0.1
        await supervisor.observe(False)
        assert supervisor.state is ProcessState.BACKING_OFF and not zombie_or_alive(pid)
        await supervisor.observe(False)
        assert supervisor.state is ProcessState.BOOTING and supervisor.restarts == 1
        server.stop()
        assert supervisor.describe()["pid"] is None

    asyncio.run(scenario())


def test_with_no_replica_up_requests_get_503_with_retry_after(tmp_path):
    nowhere = f"http://127.0.0.1:{free_port()}"  # no vLLM listens there
    settings = Settings(
        model=str(qwen3_tokenizer_dir()), upstreams=[nowhere], db_path=tmp_path / "p.db", health_interval_s=2
    )
    with serve_app(settings) as url:
        answer = httpx.post(f"{url}/v1/chat/completions", json=chat_body(), timeout=30)
        assert answer.status_code == 503, answer.text
        assert answer.headers["retry-after"] == "3"  # the next probe, a second after the interval
        assert answer.json()["error"]["type"] == "service_unavailable"
        health = httpx.get(f"{url}/health", timeout=10).json()
        assert health["status"] == "down" and health["replicas"][0]["process"] is None


# -- real vLLM servers launched by `serve` ------------------------------------------------------


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.2)


def group_members(pgid: int) -> list[str]:
    """`pid stat` of every process in the group (a launched vLLM's group id is its pid)."""
    rows = subprocess.run(["ps", "-eo", "pid=,pgid=,stat="], capture_output=True, text=True).stdout
    return [
        f"{pid} {stat}" for pid, group, stat in (r.split() for r in rows.splitlines()) if int(group) == pgid
    ]


class Launcher:
    """`launcher(model, *flags)`: `molt-proxy serve` that launches vLLM itself. `close` stops the
    proxies (they stop their vLLM servers) and SIGKILLs every vLLM group they ever reported in
    `/health`, so a failing test leaves no 3 GB server or orphaned engine behind."""

    def __init__(self, tmp_path: Path):
        self.tmp_path = tmp_path
        self.proxies: list[ProxyProcess] = []
        self.groups: set[int] = set()

    def __call__(self, model: Path, *args: str) -> ProxyProcess:
        proxy = ProxyProcess(model, [], self.tmp_path / f"serve{len(self.proxies)}.db", list(args))
        self.proxies.append(proxy)
        proxy.start(timeout_s=600)
        self.health(proxy)
        return proxy

    def health(self, proxy: ProxyProcess) -> dict[str, Any]:
        """The proxy's `/health`, noting the vLLM process groups it names."""
        answer = httpx.get(f"{proxy.url}/health", timeout=10).json()
        self.groups.update(r["process"]["pid"] for r in answer["replicas"] if r["process"]["pid"])
        return answer

    def close(self) -> None:
        for proxy in self.proxies:
            try:
                self.health(proxy)
            except httpx.HTTPError:
                pass
            try:
                proxy.stop()
            except subprocess.TimeoutExpired:
                proxy.kill9()
        for group in self.groups:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Launcher]:
    launcher = Launcher(tmp_path)
    yield launcher
    launcher.close()


def chat(proxy: ProxyProcess, session: str, content: str, **fields: Any) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 2, **fields}
    return httpx.post(f"{proxy.base_url(session)}/chat/completions", json=body, timeout=120)


@pytest.mark.timeout(900)
def test_serve_launches_replicas_supervises_them_exactly_and_stops_them_with_it(qwen3_model, launch):
    proxy = launch(
        qwen3_model, "--replicas", "2", "--max-model-len", "4096", "--tool-call-parser", "hermes",
        "--health-interval", "0.5", "--health-timeout", "5",
    )  # fmt: skip
    launched = launch.health(proxy)["replicas"]
    assert len({r["url"] for r in launched}) == 2

    # A seeded prompt of more than 2,048 new tokens: before the CPU workaround its chunked
    # prefill killed the engine (see `launcher.CPU_SEED_WORKAROUND`).
    long = chat(proxy, "long", " world" * 2300, seed=7)
    assert long.status_code == 200, long.text
    assert long.json()["usage"]["prompt_tokens"] > 2300

    refreshed = httpx.post(
        f"{proxy.url}/v1/admin/weights", json={"path": str(qwen3_model), "version": 3}, timeout=300
    )  # the base weights again, labelled 3: the episode still follows its script
    assert refreshed.status_code == 200, refreshed.text
    conversation = weather_episode("hermes")
    client = OpenAI(base_url=proxy.base_url("episode"), api_key="unused", max_retries=0)
    run = play(client, conversation, replies=2)
    replicas = launch.health(proxy)["replicas"]
    assert [r["sessions"] for r in replicas] == [1, 1]  # "long" on the first, "episode" on the other
    before = replicas[1]
    assert before["healthy"] and before["process"]["restarts"] == 0 and before["weight_version"] == 3
    os.kill(before["process"]["pid"], signal.SIGKILL)  # the API server only: its engine is left orphaned

    # Meanwhile the other replica answers.
    assert chat(proxy, "meanwhile", "hello").status_code == 200

    def relaunched() -> dict[str, Any]:
        return next(r for r in launch.health(proxy)["replicas"] if r["url"] == before["url"])

    wait_until(
        lambda: relaunched()["process"]["restarts"] == 1 and relaunched()["healthy"],
        300,
        "the relaunched vLLM is up",
    )
    after = relaunched()
    assert after["process"]["pid"] != before["process"]["pid"]
    assert after["weight_version"] == 3  # given the trainer's weights before traffic
    assert httpx.get(f"{after['url']}/weight_info", timeout=10).json()["weight_version"] == "3"
    assert group_members(before["process"]["pid"]) == [], "the dead server and its engine are reaped and gone"

    run = play(client, conversation, run=run)
    assert len(run.replies) == 5
    httpx.post(f"{proxy.url}/v1/rewards", json={"session_id": "episode", "reward": 1.0}).raise_for_status()
    [trajectory] = [t for t in trajectories(proxy.url) if t["session_id"] == "episode"]
    assert trajectory["segment"] == 0  # one segment: the relaunch re-prefilled the same ids
    assert [t["completion_id"] for t in trajectory["turns"]] == [r.id for r in run.replies]
    sampled = [v for v, m in zip(trajectory["weight_versions"], trajectory["loss_mask"], strict=True) if m]
    assert set(sampled) == {3}
    assert_exact(trajectory, qwen3_model)

    # SIGTERM: the proxy stops every vLLM it launched, engines included.
    groups = [r["process"]["pid"] for r in launch.health(proxy)["replicas"]]
    proxy.process.send_signal(signal.SIGTERM)
    assert proxy.process.wait(timeout=60) != 0
    for group in groups:
        wait_until(lambda group=group: group_members(group) == [], 60, f"vLLM group {group} is gone")


# -- supervised stand-in vLLM processes, behind the in-process proxy ---------------------------


class Supervised:
    """Two stand-in vLLM processes (`tests/inprocess.py`) that the in-process app supervises as
    `serve` supervises the vLLM servers it launched: the watcher's kill, failover and relaunch
    are the proxy's, and a stand-in boots in a second where a CPU vLLM takes minutes."""

    def __init__(self, tmp_path: Path):
        model = qwen3_tokenizer_dir()
        self.servers = [mock_vllm_process(model, tmp_path / f"mock{i}.log") for i in range(2)]
        for server in self.servers:
            server.wait(timeout_s=60)
        self.supervisors = {server.url: Supervisor(server) for server in self.servers}
        self.settings = Settings(
            model=str(model),
            upstreams=[server.url for server in self.servers],
            db_path=tmp_path / "p.db",
            health_interval_s=0.5,
            health_timeout_s=3,
        )

    def close(self) -> None:
        for server in self.servers:  # a relaunched one is the same object, with its new process
            server.kill()


@pytest.fixture
def supervised(tmp_path: Path) -> Iterator[Supervised]:
    processes = Supervised(tmp_path)
    yield processes
    processes.close()


def test_a_hung_replica_is_taken_out_traffic_continues_on_the_other_and_it_is_relaunched(supervised):
    with serve_app(supervised.settings, supervised.supervisors) as url:

        def chat(session: str, content: str) -> httpx.Response:
            body = chat_body(content, max_tokens=2)
            return httpx.post(f"{url}/s/{session}/v1/chat/completions", json=body, timeout=120)

        def health() -> dict[str, Any]:
            return httpx.get(f"{url}/health", timeout=10).json()

        assert chat("a", "1+1").status_code == 200  # sticks to the first replica (a tie)
        hung, other = health()["replicas"]
        assert hung["sessions"] == 1 and other["sessions"] == 0

        os.killpg(
            hung["process"]["pid"], signal.SIGSTOP
        )  # the whole server freezes: connections accepted, no answers
        # Session "a"'s next turn goes to the hung replica unless the watcher was faster; either
        # way it is answered: a hung launched server is killed, and what was in flight on it fails over.
        assert chat("a", "2+2").status_code == 200
        wait_until(lambda: not health()["replicas"][0]["healthy"], 30, "the hung replica is out")
        assert chat("b", "3+3").status_code == 200
        now = health()
        assert now["status"] == "degraded"
        assert [r["sessions"] for r in now["replicas"]] == [0, 2]  # "a" moved, "b" placed on the other

        wait_until(lambda: health()["replicas"][0]["healthy"], 300, "the killed replica is relaunched")
        back, other = health()["replicas"]
        assert (
            back["url"] == hung["url"]
            and back["process"]["restarts"] == 1
            and back["process"]["pid"] != hung["process"]["pid"]
        )
        assert other["process"]["restarts"] == 0 and other["healthy"]
        assert group_members(hung["process"]["pid"]) == [], "the hung server was killed with its whole group"
        assert chat("c", "4+4").status_code == 200
