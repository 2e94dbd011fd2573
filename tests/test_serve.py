"""`molt-proxy serve` launching vLLM itself: it stops what it started."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx

from molt_proxy.launcher import free_port, wait_healthy


def test_sigterm_stops_the_vllm_it_launched(digits_model, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [
        sys.executable, "-m", "molt_proxy", "serve", "--model", str(digits_model),
        "--max-model-len", "256", "--port", str(port), "--db", str(tmp_path / "p.db"),
    ]  # fmt: skip
    with open(tmp_path / "serve.log", "wb") as log:
        serve = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, serve, 600, what="molt-proxy serve")
        [replica] = httpx.get(f"{url}/health").json()["replicas"]
        assert httpx.get(f"{replica['url']}/health").status_code == 200
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=60) != 0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                httpx.get(f"{replica['url']}/health", timeout=1)
            except httpx.TransportError:
                break  # gone
            time.sleep(0.5)
        else:
            raise AssertionError(f"vLLM at {replica['url']} outlived the proxy that launched it")
    finally:
        if serve.poll() is None:
            serve.kill()
