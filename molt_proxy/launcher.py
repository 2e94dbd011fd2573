"""Start and stop the vLLM servers the proxy launches itself (`serve --model`).

vLLM runs as `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script
fails for the CPU distribution, DESIGN §9), in its own process group so that shutdown
takes its engine workers with it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float, *, what: str) -> None:
    """Poll `url`/health until it answers 200; fail early if `process` exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with code {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
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


def vllm_command(model: str, port: int, *, max_model_len: int | None, extra: list[str]) -> list[str]:
    """The server flags the proxy relies on: the token-in/token-out route, processed logprobs
    (for correct importance ratios) and the dev routes used for weight refresh."""
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--enable-scale-out",
        "--logprobs-mode", "processed_logprobs",
    ]  # fmt: skip
    if max_model_len:
        command += ["--max-model-len", str(max_model_len)]
    if on_cpu():
        command += ["--dtype", "float32", "--enforce-eager"]
    return command + extra


class VLLMServer:
    """One vLLM server child process."""

    def __init__(
        self,
        model: str,
        *,
        port: int | None = None,
        max_model_len: int | None = None,
        extra_args: list[str] | None = None,
        log_path: Path | None = None,
    ):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = vllm_command(model, self.port, max_model_len=max_model_len, extra=extra_args or [])
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 300.0) -> VLLMServer:
        return self.spawn().wait(timeout_s)

    def spawn(self) -> VLLMServer:
        """Start the process without waiting, so several replicas can boot at once."""
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.process = subprocess.Popen(
            self.command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        return self

    def wait(self, timeout_s: float = 300.0) -> VLLMServer:
        """Wait until the spawned server answers /health (stop it if it never does)."""
        assert self.process is not None, "spawn() first"
        try:
            wait_healthy(self.url, self.process, timeout_s, what=f"vLLM (log: {self.log_path})")
        except TimeoutError:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        pgid = os.getpgid(self.process.pid)
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.process.wait()

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
