"""`GET /metrics` and the request log (issue 15, items 1 and 2): after a known episode the
counters equal what happened, read with prometheus_client's own text parser; the route follows
the key rules of `/v1/trajectories`; `--log-format json` writes one parseable line per request
with its session, turn and tokens, and never a message's content or a key.

Runs the real app in process in front of the instant stand-in vLLM (`tests/inprocess.py`);
for the gauges, stand-ins that hold a turn until the test lets it go, or fail `/health`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client.parser import text_string_to_metric_families

from molt_proxy import logs
from molt_proxy.cli import parser
from molt_proxy.config import Settings
from tests.helpers import write_checkpoint
from tests.inprocess import inprocess_proxy, mock_reply_ids, mock_vllm, post, qwen3_tokenizer_dir, serve_app

ADMIN_KEY = "admin-telemetry-0123456789abcdef"
AGENT_KEY = "agent-telemetry-0123456789abcdef"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
CHAT = "/s/{}/v1/chat/completions"


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    db = tmp_path_factory.mktemp("telemetry") / "store.db"
    with inprocess_proxy(db, admin_key=ADMIN_KEY, agent_keys=[AGENT_KEY]) as url:
        yield url


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of `/metrics`, by name and labels."""
    response = httpx.get(f"{url}/metrics", headers=ADMIN)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain; version=")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def chat(url: str, session_id: str, messages: list[dict[str, Any]], stream: bool = False) -> dict[str, Any]:
    body = {"model": "tiny", "messages": messages, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    response = post(url, CHAT.format(session_id), json=body, headers=ADMIN)
    assert response.status_code == 200, response.text
    if not stream:
        return response.json()
    chunks = [line[6:] for line in response.text.splitlines() if line.startswith("data: {")]
    return json.loads(chunks[-1])  # the usage chunk


def test_metrics_count_a_known_episode_exactly(proxy: str, tmp_path: Path):
    before = scrape(proxy)
    assert before[("molt_proxy_turns_total", ())] == 0
    assert before[("molt_proxy_trajectories_total", (("status", "rewarded"),))] == 0
    assert before[("molt_proxy_weight_version", ())] == 0

    created = post(proxy, "/v1/sessions", json={"group_id": "task-1"}, headers=ADMIN)
    assert created.status_code == 201
    session = created.json()["session_id"]
    # Three turns on one chain (the third streamed), then a rewritten history: a second chain.
    messages: list[dict[str, Any]] = [{"role": "user", "content": "one"}]
    usages = []
    for turn, content in enumerate(["two", "three", None]):
        reply = chat(proxy, session, messages, stream=turn == 2)
        usages.append(reply["usage"])
        if content is not None:
            messages += [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]}]
            messages += [{"role": "user", "content": content}]
    usages.append(chat(proxy, session, [{"role": "system", "content": "compacted"}, *messages])["usage"])
    # A side request (Claude Code's title request): served, its own session, closed at once.
    title = {
        "model": "tiny",
        "max_tokens": 16,
        "system": "Write a concise, sentence-case title for this conversation.",
        "messages": [{"role": "user", "content": "one"}],
    }
    side = post(proxy, "/v1/messages", json=title, headers=ADMIN)
    assert side.status_code == 200, side.text
    side_usage = side.json()["usage"]
    assert httpx.get(f"{proxy}/v1/embeddings", headers=ADMIN).status_code == 404

    during = scrape(proxy)
    assert during[("molt_proxy_open_sessions", ())] == 1
    assert during[("molt_proxy_in_flight_requests", ())] == 0

    rewarded = post(proxy, "/v1/rewards", json={"session_id": session, "reward": 1.0}, headers=ADMIN)
    assert rewarded.status_code == 200 and len(rewarded.json()["trajectories"]) == 2
    weights = {"path": str(write_checkpoint(tmp_path / "w")), "version": 3}
    assert post(proxy, "/v1/admin/weights", json=weights).status_code == 401  # no key
    pushed = post(proxy, "/v1/admin/weights", json=weights, headers=ADMIN)
    assert pushed.status_code == 200, pushed.text

    replica = httpx.get(f"{proxy}/health").json()["replicas"][0]["url"]
    after = scrape(proxy)
    chat_route = (("route", "/s/{session_id}/v1/chat/completions"), ("status", "200"))
    expected = {
        ("molt_proxy_turns_total", ()): 5,
        ("molt_proxy_tokens_total", (("kind", "prompt"),)): sum(u["prompt_tokens"] for u in usages)
        + side_usage["input_tokens"],
        ("molt_proxy_tokens_total", (("kind", "sampled"),)): sum(u["completion_tokens"] for u in usages)
        + side_usage["output_tokens"],
        ("molt_proxy_chains_opened_total", (("reason", "new_conversation"),)): 1,  # the system prompt
        ("molt_proxy_chains_opened_total", (("reason", "rewrite"),)): 0,
        ("molt_proxy_trajectories_total", (("status", "rewarded"),)): 2,
        ("molt_proxy_trajectories_total", (("status", "unrewarded"),)): 0,
        ("molt_proxy_trajectories_total", (("status", "side"),)): 1,
        ("molt_proxy_requests_total", chat_route): 4,
        ("molt_proxy_requests_total", (("route", "/v1/sessions"), ("status", "201"))): 1,
        ("molt_proxy_requests_total", (("route", "/v1/messages"), ("status", "200"))): 1,
        ("molt_proxy_requests_total", (("route", "/v1/rewards"), ("status", "200"))): 1,
        ("molt_proxy_requests_total", (("route", "/v1/admin/weights"), ("status", "401"))): 1,
        ("molt_proxy_requests_total", (("route", "/v1/admin/weights"), ("status", "200"))): 1,
        ("molt_proxy_requests_total", (("route", "unmatched"), ("status", "404"))): 1,
        ("molt_proxy_request_seconds_count", (("route", "/s/{session_id}/v1/chat/completions"),)): 4,
        ("molt_proxy_upstream_seconds_count", ()): 5,
        ("molt_proxy_refresh_seconds_count", ()): 1,
        ("molt_proxy_open_sessions", ()): 0,
        ("molt_proxy_in_flight_requests", ()): 0,
        ("molt_proxy_weight_version", ()): 3,
        ("molt_proxy_replica_healthy", (("replica", replica),)): 1,
    }
    assert {key: after.get(key) for key in expected} == expected
    assert usages[0]["prompt_tokens"] > 0 and usages[0]["completion_tokens"] > 0
    # The scrape counts no scrape; /health was the only other request.
    routes = {dict(labels)["route"] for name, labels in after if name == "molt_proxy_requests_total"}
    assert routes == {
        "/s/{session_id}/v1/chat/completions",
        "/v1/sessions",
        "/v1/messages",
        "/v1/rewards",
        "/v1/admin/weights",
        "unmatched",
        "/health",
    }


def test_a_new_chain_counts_as_a_rewrite_or_a_new_conversation(proxy: str):
    """A chain opened by a render that starts with a chain's whole first prompt and diverges
    later is a rewrite (an edited reply, of any chain); one that diverges within every first
    prompt (a sub-agent's system prompt, a fresh first message) is a new conversation; a turn
    that continues a chain opens none."""
    reply = "Hello there."  # what the stand-in vLLM samples
    plan = [{"role": "user", "content": "Plan a trip."}]
    search = [{"role": "system", "content": "You search flights."}, {"role": "user", "content": "Find one."}]

    def edited(first: list[dict[str, Any]], answer: str, then: str) -> list[dict[str, Any]]:
        return [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": then}]

    before = scrape(proxy)
    script = [
        plan,  # the session's first chain
        edited(plan, reply, "To Rome."),  # continues it
        edited(plan, "I edited this reply.", "To Rome."),  # rewrite
        search,  # new conversation: a sub-agent
        edited(search, reply, "Cheaper?"),  # continues the sub-agent's chain
        edited(search, "Edited too.", "Cheaper?"),  # rewrite of the sub-agent's chain
        [{"role": "user", "content": "Something else."}],  # new conversation: a fresh prompt
    ]
    for messages in script:
        chat(proxy, "reasons", messages)
    after = scrape(proxy)
    rewarded = post(proxy, "/v1/rewards", json={"session_id": "reasons", "reward": 0.5}, headers=ADMIN)
    assert rewarded.status_code == 200, rewarded.text

    def delta(name: str, *labels: tuple[str, str]) -> float:
        return after[(name, labels)] - before[(name, labels)]

    assert delta("molt_proxy_turns_total") == 7
    assert delta("molt_proxy_chains_opened_total", ("reason", "rewrite")) == 2
    assert delta("molt_proxy_chains_opened_total", ("reason", "new_conversation")) == 2
    assert [t["trajectory_id"] for t in rewarded.json()["trajectories"]] == [f"reasons:{i}" for i in range(5)]


def test_the_gauges_see_turns_in_flight_and_a_replica_down_then_back(tmp_path: Path):
    """Two turns held at the stand-in vLLMs read 2 in flight, and 0 once answered; a replica
    whose `/health` fails reads 0 once the health check takes it out, and 1 once it is back."""
    arrived, release, sick = threading.Semaphore(0), threading.Event(), threading.Event()

    @web.middleware
    async def hold(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path == "/inference/v1/generate":
            arrived.release()
            await asyncio.to_thread(release.wait, 30)
        return await handler(request)

    @web.middleware
    async def failing(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path == "/health" and sick.is_set():
            return web.Response(status=503)
        return await handler(request)

    model = qwen3_tokenizer_dir()
    with (
        mock_vllm(model, middlewares=[hold]) as first,
        mock_vllm(model, middlewares=[hold, failing]) as second,
    ):
        settings = Settings(
            model=str(model),
            upstreams=[first, second],
            db_path=tmp_path / "p.db",
            admin_key=ADMIN_KEY,
            health_interval_s=0.1,
        )
        with serve_app(settings) as url, ThreadPoolExecutor(2) as pool:
            in_flight = ("molt_proxy_in_flight_requests", ())
            assert scrape(url)[in_flight] == 0
            held = [
                pool.submit(chat, url, f"held-{i}", [{"role": "user", "content": "hi"}]) for i in range(2)
            ]
            for _ in held:
                assert arrived.acquire(timeout=30), "a turn reached a stand-in vLLM"
            assert scrape(url)[in_flight] == 2
            release.set()
            sampled = len(mock_reply_ids(model))
            assert [f.result(timeout=30)["usage"]["completion_tokens"] for f in held] == [sampled, sampled]
            assert scrape(url)[in_flight] == 0

            def healthy() -> list[float]:
                scraped = scrape(url)
                return [scraped[("molt_proxy_replica_healthy", (("replica", r),))] for r in (first, second)]

            def up() -> list[bool]:
                return [r["healthy"] for r in httpx.get(f"{url}/health", timeout=10).json()["replicas"]]

            assert healthy() == [1, 1]
            sick.set()
            wait_until(lambda: up() == [True, False], "the health check takes the second replica out")
            assert healthy() == [1, 0]
            sick.clear()
            wait_until(lambda: up() == [True, True], "the second replica is back")
            assert healthy() == [1, 1]


def wait_until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 20
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_metrics_need_the_admin_key_when_keys_are_set(proxy: str):
    assert httpx.get(f"{proxy}/metrics").status_code == 401
    agent = httpx.get(f"{proxy}/metrics", headers={"authorization": f"Bearer {AGENT_KEY}"})
    assert agent.status_code == 403
    assert agent.json()["error"]["type"] == "permission_error"
    assert httpx.get(f"{proxy}/metrics", headers=ADMIN).status_code == 200


SECRET = "zebra-secret-7731-do-not-log"


def test_json_log_lines_parse_name_each_request_and_hold_no_content_or_key(proxy: str, capsys):
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    capsys.readouterr()
    root.handlers.clear()  # out of `configure`'s reach: basicConfig(force=True) closes what it removes
    logs.configure("json")
    try:
        created = post(proxy, "/v1/sessions", json={}, headers=ADMIN).json()
        session, session_key = created["session_id"], created["api_key"]
        body = {"model": "tiny", "messages": [{"role": "user", "content": SECRET}]}
        key = {"authorization": f"Bearer {session_key}"}
        reply = post(proxy, "/v1/chat/completions", json=body, headers=key)
        assert reply.status_code == 200, reply.text
        refused = post(
            proxy, "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {SECRET}"}
        )
        assert refused.status_code == 401
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    written = capsys.readouterr().err
    assert SECRET not in written and ADMIN_KEY not in written and session_key not in written
    lines = [json.loads(line) for line in written.splitlines()]  # every line is one JSON object
    requests = [line for line in lines if line["logger"] == "molt_proxy.requests"]
    replica = httpx.get(f"{proxy}/health").json()["replicas"][0]["url"]
    usage = reply.json()["usage"]
    turn = requests[1]
    assert (turn["method"], turn["route"], turn["status"]) == ("POST", "/v1/chat/completions", 200)
    assert turn["message"].startswith(f"POST /v1/chat/completions 200 latency_s={turn['latency_s']} ")
    assert (turn["session"], turn["segment"], turn["turn"], turn["replica"]) == (session, 0, 0, replica)
    assert (turn["prompt_tokens"], turn["sampled_tokens"]) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    assert turn["latency_s"] >= turn["upstream_s"] > 0
    assert [(r["route"], r["status"], r["session"]) for r in requests] == [
        ("/v1/sessions", 201, None),
        ("/v1/chat/completions", 200, session),
        ("/v1/chat/completions", 401, None),
    ]


def test_serve_takes_log_format_text_or_json():
    assert parser().parse_args(["serve", "--model", "m"]).log_format == "text"
    assert parser().parse_args(["serve", "--model", "m", "--log-format", "json"]).log_format == "json"
    with pytest.raises(SystemExit):
        parser().parse_args(["serve", "--model", "m", "--log-format", "xml"])
