"""The trajectory viewer at `/ui` and the offline `/docs` (issue 15, items 4 and 5).

A known episode (a tool call, its result, a weight refresh, a last turn; and a second attempt in
the same group) runs through the real app in front of the stand-in vLLM (`tests/inprocess.py`),
which samples scripted ids with scripted logprobs. Then a real headless Chromium (Debian's
`chromium`, installed by `scripts/setup.sh`) loads the viewer and the test reads its DOM: the
episode's turns, its number of sampled tokens, the tool call, the group side by side.
`MOLT_PROXY_SCREENSHOT=PATH` also saves the trajectory page there (how `docs/viewer.png` is
made).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from molt_proxy.config import Settings
from molt_proxy.tokenizer import Tokenizer
from tests.helpers import write_checkpoint
from tests.inprocess import inprocess_proxy, mock_vllm, post, qwen3_tokenizer_dir, serve_app

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER = "It is sunny in Paris, 21 degrees."
ADMIN_KEY = "admin-viewer-0123456789abcdef"


@dataclass
class Episode:
    url: str
    seq: int
    """The rewarded weather episode's trajectory."""
    trajectory: dict[str, Any]


def logprobs(n: int) -> list[float]:
    """Confident and unsure tokens mixed, so that the colours differ."""
    return [-((k * 0.37) % 2.5) for k in range(n)]


def chat(
    url: str, upstream: str, tokenizer: Tokenizer, session: str, messages: list, reply: str | None
) -> dict:
    if reply is not None:
        ids = [*tokenizer.encode(reply), tokenizer.eos_token_id]
        script = [{"token_ids": ids, "finish_reason": "stop", "logprobs": logprobs(len(ids))}]
        httpx.post(f"{upstream}/_script", json=script, timeout=10).raise_for_status()
    body = {"model": "tiny", "messages": messages, "tools": TOOLS}
    response = post(url, f"/s/{session}/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]


@pytest.fixture(scope="module")
def episode(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Episode]:
    folder = tmp_path_factory.mktemp("viewer")
    model = qwen3_tokenizer_dir()
    tokenizer = Tokenizer.load(str(model))
    with mock_vllm(model) as upstream:
        settings = Settings(
            model=str(model), upstreams=[upstream], db_path=folder / "p.db", tool_call_parser="hermes"
        )
        with serve_app(settings) as url:
            for session in ("weather-1", "weather-2"):
                post(
                    url, "/v1/sessions", json={"session_id": session, "group_id": "weather"}
                ).raise_for_status()
            messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]
            called = chat(url, upstream, tokenizer, "weather-1", messages, CALL)
            assert called["tool_calls"][0]["function"]["name"] == "get_weather"
            call_id = called["tool_calls"][0]["id"]
            messages += [
                called,
                {"role": "tool", "tool_call_id": call_id, "content": '{"sky": "sunny", "c": 21}'},
            ]
            messages.append(chat(url, upstream, tokenizer, "weather-1", messages, ANSWER))
            weights = {"path": str(write_checkpoint(folder / "w1")), "version": 1}
            post(url, "/v1/admin/weights", json=weights).raise_for_status()
            messages.append({"role": "user", "content": "Thanks!"})
            chat(url, upstream, tokenizer, "weather-1", messages, None)  # the stand-in's own reply
            post(url, "/v1/rewards", json={"session_id": "weather-1", "reward": 1.0}).raise_for_status()
            chat(url, upstream, tokenizer, "weather-2", messages[:1], "I do not know.")
            post(url, "/v1/rewards", json={"session_id": "weather-2", "reward": 0.25}).raise_for_status()
            chat(url, upstream, tokenizer, "open-one", messages[:1], None)  # stays open
            stored = httpx.get(f"{url}/v1/trajectories").json()["data"]
            [trajectory] = [t for t in stored if t["session_id"] == "weather-1"]
            yield Episode(url, trajectory["seq"], trajectory)


def chromium(url: str, *extra: str) -> str:
    """The DOM of `url` once its scripts have run, as a headless Chromium serialises it."""
    browser = shutil.which("chromium")
    if browser is None:
        pytest.skip("Debian's chromium is not installed (scripts/setup.sh installs it)")
    profile = Path(os.environ.get("TMPDIR", "/tmp")) / f"molt-viewer-{os.getpid()}"
    command = [
        browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        f"--user-data-dir={profile}", "--virtual-time-budget=4000", "--window-size=1280,1100", *extra, url,
    ]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_the_trajectory_page_shows_every_turn_and_every_sampled_token(episode: Episode, tmp_path: Path):
    t = episode.trajectory
    assert [turn["finish_reason"] for turn in t["turns"]] == ["stop", "stop", "stop"]
    shot = Path(os.environ.get("MOLT_PROXY_SCREENSHOT") or tmp_path / "viewer.png")
    shot.parent.mkdir(parents=True, exist_ok=True)
    dom = chromium(f"{episode.url}/ui#/t/{episode.seq}", "--dump-dom", f"--screenshot={shot}")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert re.findall(r'data-turn="(\d+)"', dom) == ["0", "1", "2"]
    assert dom.count('class="tok sampled"') == sum(t["loss_mask"]) > 0
    assert dom.count('class="tok prompt"') == len(t["token_ids"]) - sum(t["loss_mask"])
    counts = re.findall(r'class="sampled-count">(\d+) sampled<', dom)
    assert [int(n) for n in counts] == [
        turn["completion_end"] - turn["completion_start"] for turn in t["turns"]
    ]
    assert 'get_weather({"city": "Paris"})' in dom
    assert "weights v0" in dom and "weights v1" in dom  # the refresh came before the last turn
    assert "1.000 (rewarded)" in dom


def test_the_list_and_the_group_page(episode: Episode):
    listing = chromium(f"{episode.url}/ui", "--dump-dom")
    assert len(re.findall(r'<tr class="trajectory">', listing)) == 2
    assert len(re.findall(r'<tr class="session">', listing)) == 1
    assert "stream: live" in listing
    group = chromium(f"{episode.url}/ui#/g/weather", "--dump-dom")
    assert len(re.findall(r'class="attempt"', group)) == 2
    assert "Group weather: 2 trajectories, mean reward 0.625" in group
    assert "reward − group mean 0.375" in group and "reward − group mean -0.375" in group


def test_viewer_data_follows_the_trajectory_key_rules_and_docs_load_nothing_from_elsewhere(tmp_path: Path):
    with inprocess_proxy(
        tmp_path / "p.db", admin_key=ADMIN_KEY, agent_keys=["agent-viewer-0123456789"]
    ) as url:
        for path in ("/ui/api/sessions", "/ui/api/trajectories", "/ui/api/trajectories/1"):
            assert httpx.get(url + path).status_code == 401
            agent = httpx.get(url + path, headers={"authorization": "Bearer agent-viewer-0123456789"})
            assert agent.status_code == 403
        assert httpx.get(
            f"{url}/ui/api/trajectories", headers={"authorization": f"Bearer {ADMIN_KEY}"}
        ).json() == {
            "data": [],
            "last_seq": 0,
        }
        for path in ("/ui", "/ui/app.js", "/ui/style.css", "/docs", "/docs/swagger-ui-bundle.js"):
            assert httpx.get(url + path).status_code == 200, path
        docs = httpx.get(f"{url}/docs").text
        assert "/docs/swagger-ui-bundle.js" in docs and "https://" not in docs
        page = httpx.get(f"{url}/ui").text + httpx.get(f"{url}/ui/app.js").text
        assert "https://" not in page and "http://" not in page
        assert httpx.get(f"{url}/redoc").status_code == 404
