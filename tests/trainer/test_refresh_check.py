"""The trainer notices a weights refresh that a replica missed: the proxy answers 200 with the
replicas it loaded, takes the failed one out of routing, and `/health` shows it behind."""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path

import httpx

from molt_proxy.config import Settings
from tests.helpers import write_checkpoint
from tests.inprocess import mock_vllm, qwen3_tokenizer_dir, serve_app
from trainer.loop import replicas_behind


def test_a_replica_that_missed_a_refresh_is_detected(tmp_path: Path) -> None:
    model = qwen3_tokenizer_dir()
    weights = write_checkpoint(tmp_path / "weights")
    with ExitStack() as failing, mock_vllm(model) as kept:
        lost = failing.enter_context(mock_vllm(model))
        settings = Settings(
            model=str(model), upstreams=[lost, kept], db_path=tmp_path / "p.db", health_interval_s=3600
        )
        with serve_app(settings) as proxy:
            deadline = time.monotonic() + 30
            while not all(r["healthy"] for r in httpx.get(f"{proxy}/health").json()["replicas"]):
                assert time.monotonic() < deadline, "the replicas never came up"
                time.sleep(0.05)
            assert replicas_behind(proxy, 0, {}) == [lost, kept]  # boot weights: no version yet
            failing.close()  # the first replica goes away before the push reaches it
            pushed = httpx.post(f"{proxy}/v1/admin/weights", json={"path": str(weights), "version": 1})
            assert pushed.status_code == 200 and pushed.json()["replicas"] == [kept]
            assert replicas_behind(proxy, 1, {}) == [lost]
