"""`molt-proxy serve --replicas K` launching vLLM itself: K replicas, and it stops what it started."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx

from molt_proxy.launcher import free_port, wait_healthy


def test_replicas_it_launches_serve_and_stop_with_it(digits_model, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [
        sys.executable, "-m", "molt_proxy", "serve", "--model", str(digits_model),
        "--max-model-len", "256", "--port", str(port), "--db", str(tmp_path / "p.db"), "--replicas", "2",
    ]  # fmt: skip
    with open(tmp_path / "serve.log", "wb") as log:
        serve = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, serve, 600, what="molt-proxy serve")
        replicas = [r["url"] for r in httpx.get(f"{url}/health").json()["replicas"]]
        assert len(set(replicas)) == 2
        # Two sessions go to the two replicas (the least loaded takes the next new session).
        for session in ("a", "b"):
            httpx.post(
                f"{url}/s/{session}/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "1+1"}], "max_tokens": 2},
                timeout=60,
            ).raise_for_status()
        assert sorted(r["sessions"] for r in httpx.get(f"{url}/health").json()["replicas"]) == [1, 1]
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=60) != 0
        for replica in replicas:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    httpx.get(f"{replica}/health", timeout=1)
                except httpx.TransportError:
                    break  # gone
                time.sleep(0.5)
            else:
                raise AssertionError(f"vLLM at {replica} outlived the proxy that launched it")
    finally:
        if serve.poll() is None:
            serve.kill()
