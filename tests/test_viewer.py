"""The trajectory viewer at `/ui` and the offline `/docs` (issue 15, items 4 and 5).

A known episode (a tool call, its result, a weight refresh, a last turn; and a second attempt in
the same group, with the advantages a trainer posted for both; and a session whose history was
rewritten, so it has two segments) runs through the real app in front of the stand-in vLLM
(`tests/inprocess.py`), which samples scripted ids with scripted logprobs. Then a real headless
Chromium (Debian's `chromium`, installed by `scripts/setup.sh`) loads the viewer and the test
reads its DOM: the episode's turns, its number of sampled tokens, the tool call, the group side
by side with its advantages. One Chromium driven over the DevTools protocol (on a pipe) then
sets the list's filters, follows segment links, and sees a trajectory finalized after the page
loaded appear in the list from the stream, without a reload.
`MOLT_PROXY_SCREENSHOT=PATH` also saves the trajectory page there (how `docs/viewer.png` is
made).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from molt_proxy.config import Settings
from molt_proxy.tokenizer import Tokenizer
from tests.helpers import write_checkpoint
from tests.inprocess import inprocess_proxy, loaded_tokenizer, mock_vllm, post, qwen3_tokenizer_dir, serve_app

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
    seqs: dict[str, int]
    """Every trajectory's seq, by trajectory id."""
    upstream: str
    tokenizer: Tokenizer


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
    tokenizer = loaded_tokenizer(str(model))
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
            post(url, "/v1/sessions", json={"session_id": "twice", "group_id": "rewrite"}).raise_for_status()
            chat(url, upstream, tokenizer, "twice", [{"role": "user", "content": "Count to three."}], "1 2 3")
            rewritten = [{"role": "user", "content": "Count to two."}]  # extends no chain: segment 1
            chat(url, upstream, tokenizer, "twice", rewritten, "1 2")
            post(url, "/v1/rewards", json={"session_id": "twice", "reward": 0.5}).raise_for_status()
            advantages = [
                {"trajectory_id": "weather-1:0", "turn_advantages": [0.5, 0.25, 0.125]},
                {"trajectory_id": "weather-2:0", "advantage": -0.5},
            ]
            body = {"step": 7, "version": 1, "trajectories": advantages}
            post(url, "/v1/admin/advantages", json=body).raise_for_status()
            stored = httpx.get(f"{url}/v1/trajectories").json()["data"]
            [trajectory] = [t for t in stored if t["session_id"] == "weather-1"]
            seqs = {t["trajectory_id"]: t["seq"] for t in stored}
            yield Episode(url, trajectory["seq"], trajectory, seqs, upstream, tokenizer)


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


class Browser:
    """One headless Chromium driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`:
    JSON messages ended by NUL, commands on its fd 3, answers and events on its fd 4): a page
    that stays open while the test acts on the proxy, read as it changes."""

    def __init__(self, url: str, profile: Path):
        browser = shutil.which("chromium")
        if browser is None:
            pytest.skip("Debian's chromium is not installed (scripts/setup.sh installs it)")
        commands, self._commands = os.pipe()
        self._answers, answers = os.pipe()

        def on_fds_3_and_4() -> None:  # in the child; moved up first, as either may be 3 or 4
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (commands, answers)]
            for target, fd in zip((3, 4), high, strict=True):
                os.dup2(fd, target)

        self.process = subprocess.Popen(
            [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--remote-debugging-pipe", f"--user-data-dir={profile}", "--window-size=1280,1100", url],
            preexec_fn=on_fds_3_and_4, pass_fds=(3, 4), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        os.close(commands)
        os.close(answers)
        self._read, self._id = b"", 0
        [page] = [t for t in self.call("Target.getTargets")["targetInfos"] if t["type"] == "page"]
        self.session = self.call("Target.attachToTarget", targetId=page["targetId"], flatten=True)[
            "sessionId"
        ]

    def call(self, method: str, session: str | None = None, **params: Any) -> dict[str, Any]:
        self._id += 1
        message = {
            "id": self._id,
            "method": method,
            "params": params,
            **({"sessionId": session} if session else {}),
        }
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        while True:
            while b"\0" not in self._read:
                chunk = os.read(self._answers, 1 << 16)
                assert chunk, "chromium closed its pipe"
                self._read += chunk
            raw, self._read = self._read.split(b"\0", 1)
            answer = json.loads(raw)
            if answer.get("id") == self._id:
                assert "error" not in answer, answer
                return answer["result"]

    def js(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", self.session, expression=expression, returnByValue=True)
        return result["result"].get("value")

    def until(self, expression: str, expected: Any, timeout_s: float = 20.0) -> None:
        """Wait until `expression` evaluates to `expected` in the page (it renders asynchronously)."""
        deadline = time.monotonic() + timeout_s
        while (value := self.js(expression)) != expected:
            assert time.monotonic() < deadline, f"{expression} is {value!r}, not {expected!r}"
            time.sleep(0.05)

    def close(self) -> None:
        self.process.kill()
        self.process.wait()
        os.close(self._commands)
        os.close(self._answers)


ROWS = "[...document.querySelectorAll('tr.trajectory')].map((row) => row.children[1].textContent)"


def set_filter(name: str, value: str) -> str:
    """JS that sets one filter as a user would (the value, then a change event)."""
    return (
        f"(() => {{ const box = document.getElementById('filter-{name}'); box.value = {json.dumps(value)};"
        " box.dispatchEvent(new Event('change')); })()"
    )


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
    assert "turn advantages 0.500, 0.250, 0.125 (posted by the trainer: step 7, weights v1)" in dom
    assert re.findall(r'class="turn-advantage">advantage ([-.0-9]+)<', dom) == ["0.500", "0.250", "0.125"]


def test_the_list_and_the_group_page(episode: Episode):
    listing = chromium(f"{episode.url}/ui", "--dump-dom")
    assert len(re.findall(r'<tr class="trajectory">', listing)) == 4
    assert len(re.findall(r'<tr class="session">', listing)) == 1
    assert "stream: live" in listing
    group = chromium(f"{episode.url}/ui#/g/weather", "--dump-dom")
    assert len(re.findall(r'class="attempt"', group)) == 2
    assert "Group weather: 2 trajectories, mean reward 0.625" in group
    assert re.findall(r'<span class="advantage">([^<]*)</span>', group) == [
        "reward 1.000 · turn advantages 0.500, 0.250, 0.125 (posted by the trainer: step 7, weights v1)",
        "reward 0.250 · advantage -0.500 (posted by the trainer: step 7, weights v1)",
    ]
    assert re.findall(r"· advantage ([-.0-9]+)</span>", group) == ["0.500", "0.250", "0.125"]  # at each turn
    unposted = chromium(f"{episode.url}/ui#/g/rewrite", "--dump-dom")
    assert (
        re.findall(r'<span class="advantage">([^<]*)</span>', unposted)
        == ["reward 0.500 · reward − group mean 0.000 (the trainer posted no advantage)"] * 2
    )


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


def test_filters_segments_and_a_trajectory_that_arrives_after_the_page_loaded(
    episode: Episode, tmp_path: Path
):
    """Last in the file: it finalizes one more trajectory."""
    url, seqs = episode.url, episode.seqs
    browser = Browser(f"{url}/ui#/?group=weath", tmp_path / "profile")
    try:
        browser.until(ROWS, ["weather-2:0", "weather-1:0"])  # the filter read from the address
        browser.until("document.getElementById('filter-group').value", "weath")
        browser.js(set_filter("group", ""))
        browser.until(ROWS, ["twice:1", "twice:0", "weather-2:0", "weather-1:0"])
        browser.js(set_filter("min", "0.5"))
        browser.until(ROWS, ["twice:1", "twice:0", "weather-1:0"])
        assert browser.js("location.hash") == "#/?min=0.5"
        browser.js(set_filter("max", "0.5"))
        browser.until(ROWS, ["twice:1", "twice:0"])
        browser.js(set_filter("min", ""))
        browser.js(set_filter("max", "0.3"))
        browser.until(ROWS, ["weather-2:0"])
        browser.js(set_filter("max", ""))
        browser.js(set_filter("status", "side"))
        browser.until(ROWS, [])
        browser.js(set_filter("status", "rewarded"))
        browser.until(ROWS, ["twice:1", "twice:0", "weather-2:0", "weather-1:0"])
        assert browser.js("location.hash") == "#/?status=rewarded"

        browser.js("window.loadedOnce = true")  # gone if the page were reloaded
        post(url, "/v1/sessions", json={"session_id": "late", "group_id": "late"}).raise_for_status()
        chat(url, episode.upstream, episode.tokenizer, "late", [{"role": "user", "content": "Hi"}], "Hello.")
        post(url, "/v1/rewards", json={"session_id": "late", "reward": 0.75}).raise_for_status()
        browser.until(ROWS, ["late:0", "twice:1", "twice:0", "weather-2:0", "weather-1:0"])
        assert browser.js("window.loadedOnce") is True
        assert browser.js("document.getElementById('live').textContent") == "stream: live"

        segments = "document.querySelector('dl.meta dd:nth-of-type(2)').innerHTML"
        first, second = seqs["twice:0"], seqs["twice:1"]
        assert second == first + 1
        browser.js(f"location.hash = '#/t/{first}'")
        browser.until(segments, f'<span><b>0</b> <a href="#/t/{second}">1</a> </span>')
        assert "Count to three." in browser.js("document.getElementById('turns').textContent")
        browser.js(f"location.hash = '#/t/{second}'")
        browser.until(segments, f'<span><a href="#/t/{first}">0</a> <b>1</b> </span>')
        assert "Count to two." in browser.js("document.getElementById('turns').textContent")
    finally:
        browser.close()
