"""The trainer notices a weights refresh that a replica missed: the proxy answers 200 with the
replicas it loaded, takes the failed one out of routing, and `/health` shows it behind. The
trainer reports it (a warning, `replicas_behind` in its state and in metrics.jsonl); the
proxy's health check gives the replica the weights again until it takes them."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from bench.mock_upstream import build_app as build_mock_vllm
from devtools import build_tiny_model
from molt_proxy.config import Settings
from molt_proxy.launcher import free_port
from tests.helpers import write_checkpoint
from tests.inprocess import (
    MOCK_MAX_MODEL_LEN,
    REPLY_TEXT,
    mock_reply_ids,
    mock_vllm,
    qwen3_tokenizer_dir,
    serve_app,
)
from tests.trainer.builders import episodes
from trainer import loop
from trainer.buffer import Group
from trainer.config import TrainerConfig
from trainer.loop import replicas_behind
from trainer.metrics import read


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


@contextmanager
def reload_failing_vllm(model_dir: Path, failing: threading.Event, refused: list[str]) -> Iterator[str]:
    """The stand-in vLLM of `tests/inprocess.py` (yields its base URL) whose weight reload
    (`/collective_rpc`) answers 500 while `failing` is set, each refusal noted in `refused`:
    alive and healthy all along, it only misses the weights."""

    @web.middleware
    async def refuse_reload(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path == "/collective_rpc" and failing.is_set():
            refused.append(request.path)
            return web.json_response({"error": "reload_weights failed"}, status=500)
        return await handler(request)

    app = build_mock_vllm("tiny", REPLY_TEXT, list(mock_reply_ids(model_dir)), MOCK_MAX_MODEL_LEN)
    app.middlewares.append(refuse_reload)
    port, loop_ = free_port(), asyncio.new_event_loop()
    runner = web.AppRunner(app, access_log=None)
    loop_.run_until_complete(runner.setup())
    loop_.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop_.run_forever, name="mock-vllm-failing", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop_).result(timeout=10)
        loop_.call_soon_threadsafe(loop_.stop)
        thread.join(timeout=10)
        loop_.close()


def test_the_trainer_reports_a_replica_that_missed_its_weights_and_the_proxy_retries_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = qwen3_tokenizer_dir()
    tiny = build_tiny_model(tmp_path / "tiny", "qwen3", fallback_tokenizer=True, teach=False)
    failing, refused = threading.Event(), []
    with mock_vllm(model) as kept, reload_failing_vllm(model, failing, refused) as flaky:
        settings = Settings(
            model=str(model), upstreams=[kept, flaky], db_path=tmp_path / "p.db", health_interval_s=0.2
        )
        with serve_app(settings) as proxy:

            def replicas() -> list[tuple[bool, int | None]]:
                return [
                    (r["healthy"], r["weight_version"])
                    for r in httpx.get(f"{proxy}/health").json()["replicas"]
                ]

            wait_until(lambda: replicas() == [(True, None), (True, None)])
            out = tmp_path / "train"
            config = TrainerConfig(proxy_url=proxy, model=str(tiny), out_dir=out, group_size=2, lr=1e-3)
            trainer = loop.Trainer(config)
            trainer._refresh()  # as a run begins: version 0 on both
            assert trainer.replicas_behind == 0 and replicas() == [(True, 0), (True, 0)]

            failing.set()
            with caplog.at_level(logging.WARNING, logger="trainer.loop"):
                trainer._step([Group("g", episodes(1, "g", (1.0, 0.0), version=0))], pending=[])

            assert trainer.state.version == 1 and trainer.replicas_behind == 1
            [record] = read(out / "metrics.jsonl")
            assert (record["version"], record["replicas_behind"]) == (1, 1)
            # Warnings only: an earlier test in this worker may have set INFO for every logger.
            warned = [r for r in caplog.records if r.name == "trainer.loop" and r.levelno >= logging.WARNING]
            assert [r.getMessage() for r in warned] == [
                f"weights v1 are not on {flaky}: the proxy keeps them out of routing and reloads them "
                "once they pass a health check"
            ]
            # Out of routing, and given the weights again at every health check while it fails.
            assert replicas() == [(True, 1), (False, None)]
            wait_until(lambda: len(refused) >= 3)  # the push, then two retries
            assert replicas() == [(True, 1), (False, None)]
            failing.clear()
            wait_until(lambda: replicas() == [(True, 1), (True, 1)])
            reload = {
                "method": "reload_weights",
                "kwargs": {"weights_path": str((out / "weights" / "v1").resolve())},
            }
            assert httpx.get(f"{flaky}/_calls").json()[-3:] == [
                ["/collective_rpc", reload],
                ["/update_weight_version", {"new_version": "1"}],
                ["/resume", None],
            ]
            trainer._refresh()  # the trainer's next check finds every replica current
            assert trainer.replicas_behind == 0


def wait_until(condition: Callable[[], bool], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
