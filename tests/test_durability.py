"""kill -9 the proxy: everything it acknowledged survives a restart, unchanged."""

from __future__ import annotations

import subprocess
import sys

import httpx
from openai import OpenAI

from devtools import weather_episode
from molt_proxy.export import load
from tests.conftest import ProxyProcess, app_proxy
from tests.helpers import assert_exact, play, trajectories


def test_kill9_after_reward_then_restart_keeps_the_trajectory(qwen3_model, qwen3_vllm, tmp_path):
    proxy = ProxyProcess(
        qwen3_model, qwen3_vllm.url, tmp_path / "p.db", ["--tool-call-parser", "hermes"]
    ).start()
    play(OpenAI(base_url=proxy.base_url("durable"), api_key="x"), weather_episode("hermes"))
    httpx.post(f"{proxy.url}/v1/rewards", json={"session_id": "durable", "reward": 2.5}).raise_for_status()
    before = trajectories(proxy.url)
    proxy.kill9()
    # The restarted proxy runs in this process: what matters is that the killed one is gone.
    with app_proxy(
        qwen3_model, qwen3_vllm.url, tmp_path / "p.db", ["--tool-call-parser", "hermes"]
    ) as restarted:
        assert trajectories(restarted.url) == before


def test_kill9_mid_episode_then_the_episode_continues_in_the_same_segment(qwen3_model, qwen3_vllm, tmp_path):
    args = ["--tool-call-parser", "hermes"]
    proxy = ProxyProcess(qwen3_model, qwen3_vllm.url, tmp_path / "p.db", args).start()
    conversation = weather_episode("hermes")
    run = play(OpenAI(base_url=proxy.base_url("resumed"), api_key="x"), conversation, replies=2)
    proxy.kill9()  # after two acknowledged turns
    with app_proxy(qwen3_model, qwen3_vllm.url, tmp_path / "p.db", args) as restarted:
        run = play(OpenAI(base_url=restarted.base_url("resumed"), api_key="x"), conversation, run=run)
        assert len(run.replies) == 5
        httpx.post(
            f"{restarted.url}/v1/rewards", json={"session_id": "resumed", "reward": 1}
        ).raise_for_status()
        [record] = trajectories(restarted.url)
    assert [t["completion_id"] for t in record["turns"]] == [r.id for r in run.replies]
    assert_exact(record, qwen3_model)


def test_export_round_trip_jsonl_and_parquet(qwen3_model, qwen3_vllm, tmp_path):
    with app_proxy(qwen3_model, qwen3_vllm.url, tmp_path / "p.db") as proxy:
        for name, reward in (("e1", 1.0), ("e2", -0.5)):
            client = OpenAI(base_url=proxy.base_url(name), api_key="x")
            client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": name}], max_tokens=5, seed=2
            )
            info = {"task": name, "nested": {"ok": True}}
            httpx.post(
                f"{proxy.url}/v1/rewards", json={"session_id": name, "reward": reward, "info": info}
            ).raise_for_status()
        served = trajectories(proxy.url)
    assert [t["info"]["task"] for t in served] == ["e1", "e2"]
    for fmt in ("jsonl", "parquet"):
        out = tmp_path / f"out.{fmt}"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "molt_proxy",
                "export",
                "--db",
                str(tmp_path / "p.db"),
                "--format",
                fmt,
                "--out",
                str(out),
            ],
            check=True,
        )
        assert load(out) == served
