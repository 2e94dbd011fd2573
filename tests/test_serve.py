"""`molt-proxy serve --replicas K` launching vLLM itself: K replicas, and it stops what it started."""

from __future__ import annotations

import signal
import time

import httpx

from molt_proxy.launcher import ProxyServer


def test_replicas_it_launches_serve_and_stop_with_it(digits_model, tmp_path):
    args = ["--max-model-len", "256", "--replicas", "2"]
    serve = ProxyServer(digits_model, db=tmp_path / "p.db", args=args, log_path=tmp_path / "serve.log")
    url = serve.url
    try:
        serve.start(timeout_s=600)
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
        serve.process.send_signal(signal.SIGTERM)
        assert serve.process.wait(timeout=60) != 0
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
        serve.kill()
