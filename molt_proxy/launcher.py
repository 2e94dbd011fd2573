"""Start and stop servers as child processes: the vLLM servers the proxy launches itself
(`serve` without `--upstream`; `python -m vllm.entrypoints.openai.api_server`, as the `vllm`
script fails for the CPU build, DESIGN §9) and `molt-proxy serve` for examples, tests and
benchmarks (`ProxyServer`). Each is a `ServerProcess`: its own process group (shutdown takes
vLLM's workers too), a health route to wait for, SIGTERM then SIGKILL of the whole group.

`Supervisor` keeps a launched server alive: told the result of every `/health` probe (by
`replicas.Replicas`, which decides routing and knows nothing of processes), it reaps a server
that exited, kills one that stopped answering, and relaunches it on the same port (so the
replica's URL stays) with bounded restarts and exponential back-off.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Any, Self

import httpx

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(
    url: str, process: subprocess.Popen, timeout_s: float, *, what: str, path: str = "/health"
) -> None:
    """Poll `url` + `path` until it answers 200; fail early if `process` exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with code {process.returncode}")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{what} did not become healthy within {timeout_s:.0f} s")


def on_cpu() -> bool:
    try:
        import torch

        return not torch.cuda.is_available()
    except ImportError:
        return True


CPU_SEED_WORKAROUND = ["--no-enable-chunked-prefill"]
"""On CPU, vLLM 0.32 kills its engine when a request with `seed` is prefilled in chunks
(a prompt with more new, uncached tokens than `--max-num-batched-tokens`, 2,048 by default,
or one that shares a step's token budget with other requests):

    vllm/v1/worker/gpu_model_runner.py:4477 sample_tokens -> self._bookkeeping_sync(...)
    vllm/v1/worker/gpu_model_runner.py:3502 _bookkeeping_sync
        gen.set_offset(gen.get_offset() - 4)
    RuntimeError: CPU Generator does not use offset

(it rewinds the seeded generator after sampling a token it throws away for a partial
prefill; a CPU `torch.Generator` has no offset). Without chunked prefill, vLLM sets
`--max-num-batched-tokens` to at least `--max-model-len` and schedules every prefill whole,
so no sample is discarded and `seed` keeps its promise. A later `--vllm-arg` overrides it."""


def vllm_command(
    model: str, port: int, *, max_model_len: int | None, extra: list[str], host: str = "127.0.0.1"
) -> list[str]:
    """The server flags the proxy relies on: the token-in/token-out route, processed logprobs
    (for correct importance ratios) and the dev routes used for weight refresh; on `host`."""
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model,
        "--host", host,
        "--port", str(port),
        "--enable-scale-out",
        "--logprobs-mode", "processed_logprobs",
        "--max-logprobs", "21",  # an agent's top_logprobs 20, plus one (`upstream.top_asked`)
    ]  # fmt: skip
    if max_model_len:
        command += ["--max-model-len", str(max_model_len)]
    if on_cpu():
        command += ["--dtype", "float32", "--enforce-eager", *CPU_SEED_WORKAROUND]
    return command + extra


class ServerProcess:
    """A server as a child process in its own session, so that stopping it stops whatever it
    started as well (vLLM's engine workers, a benchmark's LiteLLM workers). Its output goes
    to `log_path` (appended: a relaunch keeps the earlier run's lines), or with None to this
    process's own stdout and stderr."""

    name = "server"
    boot_timeout_s = 120.0
    stop_timeout_s = 20.0
    """After SIGTERM, how long to wait before SIGKILL."""
    die_with_parent = False  # SIGKILL it when the thread that spawned it dies: for Ray actors

    def __init__(
        self,
        command: list[str],
        url: str,
        *,
        log_path: Path | None = None,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        health: str = "/health",
    ):
        self.command, self.url, self.log_path = command, url, log_path
        self.env, self.cwd, self.health = env or {}, cwd, health
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float | None = None) -> Self:
        return self.spawn().wait(timeout_s)

    def spawn(self) -> Self:
        """Start the process without waiting, so several servers can boot at once."""
        env = {**os.environ, **self.env}
        # The child has its own copy of the log's descriptor: close ours at once, so that a
        # relaunch does not leak one per restart.
        with open(self.log_path, "ab") if self.log_path else contextlib.nullcontext(None) as log:
            self.process = subprocess.Popen(
                self.command,
                env=env,
                cwd=self.cwd,
                stdout=log,
                stderr=subprocess.STDOUT if log else None,
                start_new_session=True,
                preexec_fn=_die_with_parent if self.die_with_parent else None,
            )
        return self

    def wait(self, timeout_s: float | None = None) -> Self:
        """Wait until the spawned server answers its health route; stop it if it never does."""
        if self.process is None:
            raise RuntimeError("spawn() first")
        what = f"{self.name} (log: {self.log_path or 'stdout'})"
        try:
            wait_healthy(
                self.url, self.process, timeout_s or self.boot_timeout_s, what=what, path=self.health
            )
        except (RuntimeError, TimeoutError):
            self.stop()  # an exited server's workers may outlive it
            raise
        return self

    @property
    def returncode(self) -> int | None:
        """The exit code once the process has exited (and is reaped: no `<defunct>` left)."""
        return None if self.process is None else self.process.poll()

    def stop(self) -> None:
        """SIGTERM the process group, wait `stop_timeout_s` for the server, then `kill`."""
        if self.process is None:
            return
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)  # its own session: the group id is its pid
            try:
                self.process.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        """SIGKILL the whole process group and reap the server. Also after the server itself
        exited: its workers may outlive it, holding gigabytes, or a stopped (SIGSTOP) server
        would never act on a gentler signal."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # the whole group is gone already
        self.process.wait()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _die_with_parent() -> None:
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG


class VLLMServer(ServerProcess):
    """One vLLM server child process (output discarded without a `log_path`)."""

    name = "vLLM"
    boot_timeout_s = 300.0

    def __init__(
        self,
        model: str,
        *,
        port: int | None = None,
        max_model_len: int | None = None,
        extra_args: list[str] | None = None,
        log_path: Path | None = None,
        host: str = "127.0.0.1",
    ):
        self.port = port or free_port()
        env = {
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        }
        if "--enable-lora" in (extra_args or []):
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"  # the adapter routes (`molt_proxy/lora.py`)
        if on_cpu():
            # The model runs in the engine process instead of a worker process of its own:
            # one interpreter fewer to boot (about 12 s on 2 cores), and no worker that vLLM's
            # OpenMP binding pins to core 0 (every launched server's worker, all on one core).
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        super().__init__(
            vllm_command(model, self.port, max_model_len=max_model_len, extra=extra_args or [], host=host),
            f"http://{host}:{self.port}",
            log_path=log_path or Path(os.devnull),
            env=env,
        )


class ProxyServer(ServerProcess):
    """`molt-proxy serve` as a child process, for examples, tests and benchmarks. Without
    `upstreams` it launches vLLM itself (give `start` the minutes that takes). SIGTERM makes
    `serve` stop the vLLM servers it launched before it exits; `kill` (a kill -9) does not."""

    name = "molt-proxy"
    stop_timeout_s = 60.0

    def __init__(
        self,
        model: str | Path,
        *,
        upstreams: Sequence[str] = (),
        port: int | None = None,
        db: Path | None = None,
        args: Sequence[str] = (),
        log_path: Path | None = None,
        cwd: Path | None = None,
    ):
        self.port = port or free_port()
        command = [sys.executable, "-m", "molt_proxy", "serve", "--model", str(model)]
        command += [flag for url in upstreams for flag in ("--upstream", url)]
        command += ["--port", str(self.port), *(["--db", str(db)] if db else []), *args]
        super().__init__(command, f"http://127.0.0.1:{self.port}", log_path=log_path, cwd=cwd)

    def base_url(self, session: str | None = None) -> str:
        """The OpenAI base URL for agents: the session's own, or the shared one."""
        return f"{self.url}/s/{session}/v1" if session else f"{self.url}/v1"


class RayNode(ServerProcess):
    """`ray start --block ARGS`: one Ray node (`--head`, or `--address` of a head) in its own
    process group, which `stop` ends (`ray stop` would end every Ray node of this machine).
    For tests and benchmarks; `env` adds to this process's environment (HOME, RAY_AUTH_MODE)."""

    name = "Ray node"
    boot_timeout_s = 180.0

    def __init__(self, args: Sequence[str], log_path: Path, env: dict[str, str] | None = None):
        command = [str(Path(sys.executable).with_name("ray")), "start", "--block", *args]
        super().__init__(command, "", log_path=log_path, env=env)
        self.stop_timeout_s = 5.0

    def wait(self, timeout_s: float | None = None) -> Self:
        """Until the node's log says it started (a Ray node has no health route to ask)."""
        assert self.log_path is not None
        deadline = time.monotonic() + (timeout_s or self.boot_timeout_s)
        while "Ray runtime started" not in self.log_path.read_text():
            if self.returncode is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the Ray node did not start: {self.log_path.read_text()[-2000:]}")
            time.sleep(0.3)
        return self

    @property
    def address(self) -> str:
        """A head's address, as its log tells the nodes that join it."""
        assert self.log_path is not None
        return self.log_path.read_text().split("ray start --address='")[1].split("'")[0]


class ProcessState(StrEnum):
    BOOTING = "booting"
    """Launched, not healthy yet."""
    RUNNING = "running"
    """Has answered /health since it was launched."""
    BACKING_OFF = "backing_off"
    """Dead and reaped; waits out its back-off before the relaunch."""
    GAVE_UP = "gave_up"
    """Restarted too often: stays down until the proxy restarts."""


class Supervisor:
    """Keeps one launched `VLLMServer` alive; `observe` is told every health probe's result.

    A server that exited is reaped; one that answered /health before and now does not (hung,
    e.g. SIGSTOP, or a dead engine behind a live API server) is SIGKILLed with its group, and
    so is one that is not healthy `boot_timeout_s` after its launch. Then it is relaunched on
    its port after a back-off of `backoff_s`, doubled for each restart in the last `window_s`,
    at most `max_backoff_s`. After `max_restarts` restarts within `window_s` it stays down and
    says so (log and `describe`): a server that keeps dying needs a person, not a loop that
    burns the machine. The back-off is checked at each probe, so it is rounded up to the
    probe interval.

    Killing and relaunching is all it does: the probe that next passes brings the replica back
    through `Replicas`, which gives it the current weights before any traffic.

    `clock` (monotonic seconds) is what every window, back-off and boot timeout is measured
    on: a test steps a clock of its own through minutes of restarts instead of waiting them.
    """

    def __init__(
        self,
        server: VLLMServer,
        *,
        max_restarts: int = 5,
        window_s: float = 600.0,
        backoff_s: float = 1.0,
        max_backoff_s: float = 60.0,
        boot_timeout_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.server = server
        self.restarts = 0
        """Relaunches so far (for `/health`)."""
        self._max_restarts, self._window_s = max_restarts, window_s
        self._backoff_s, self._max_backoff_s = backoff_s, max_backoff_s
        self._boot_timeout_s = boot_timeout_s
        self._clock = clock
        self._recent: deque[float] = deque()
        """When the restarts within the last `window_s` happened (monotonic seconds)."""
        self._state = ProcessState.BOOTING
        self._since = clock()
        self._relaunch_at = 0.0
        self._exit_code: int | None = None

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def state(self) -> ProcessState:
        return self._state

    def describe(self) -> dict[str, Any]:
        process = self.server.process
        return {
            "state": self._state.value,
            "pid": process.pid if process is not None and process.returncode is None else None,
            "restarts": self.restarts,
            "last_exit_code": self._exit_code,
        }

    async def observe(self, healthy: bool) -> None:
        """Act on one health probe of this server; never raises (the watcher calls it)."""
        now = self._clock()
        if self._state is ProcessState.GAVE_UP:
            return
        if self._state is ProcessState.BACKING_OFF:
            if now >= self._relaunch_at:
                self._relaunch(now)
            return
        if healthy:
            if self._state is ProcessState.BOOTING:
                if self.restarts:
                    log.info("relaunched vLLM at %s is healthy after %.0f s", self.url, now - self._since)
                self._enter(ProcessState.RUNNING, now)
            return
        code = self.server.returncode
        if code is not None:
            why = f"exited with code {code}"
        elif self._state is ProcessState.RUNNING:
            why = "stopped answering /health"
        elif now - self._since > self._boot_timeout_s:
            why = f"was not healthy {self._boot_timeout_s:.0f} s after its launch"
        else:
            return  # still booting
        try:
            await asyncio.to_thread(self.server.kill)
        except OSError as exc:
            log.error("could not kill vLLM at %s: %r", self.url, exc)
        self._exit_code = self.server.returncode
        self._failed(why, self._clock())  # the back-off runs from the kill, however long it took

    def _failed(self, why: str, now: float) -> None:
        while self._recent and now - self._recent[0] > self._window_s:
            self._recent.popleft()
        where = f"vLLM at {self.url} (log: {self.server.log_path})"
        if len(self._recent) >= self._max_restarts:
            log.error(
                "%s %s; it was restarted %d times in the last %.0f s, so it stays down",
                where, why, len(self._recent), self._window_s,
            )  # fmt: skip
            self._enter(ProcessState.GAVE_UP, now)
            return
        delay = min(self._backoff_s * 2 ** len(self._recent), self._max_backoff_s)
        log.warning(
            "%s %s; relaunching it in %.1f s (restart %d; at most %d per %.0f s)",
            where, why, delay, self.restarts + 1, self._max_restarts, self._window_s,
        )  # fmt: skip
        self._relaunch_at = now + delay
        self._enter(ProcessState.BACKING_OFF, now)

    def _relaunch(self, now: float) -> None:
        self._recent.append(now)
        self.restarts += 1
        try:
            self.server.spawn()
        except OSError as exc:
            self._failed(f"could not be relaunched: {exc!r}", now)
            return
        self._enter(ProcessState.BOOTING, now)

    def _enter(self, state: ProcessState, now: float) -> None:
        self._state, self._since = state, now
