"""`GET /metrics` (issue 15, item 1): after a known episode the counters equal what happened,
read with prometheus_client's own text parser; the route follows the key rules of
`/v1/trajectories`.

Runs the real app in process in front of the instant stand-in vLLM (`tests/inprocess.py`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import write_checkpoint
from tests.inprocess import inprocess_proxy, post

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
        ("molt_proxy_turns_total", ()): 4,
        ("molt_proxy_tokens_total", (("kind", "prompt"),)): sum(u["prompt_tokens"] for u in usages),
        ("molt_proxy_tokens_total", (("kind", "sampled"),)): sum(u["completion_tokens"] for u in usages),
        ("molt_proxy_chains_opened_total", (("reason", "extends_no_chain"),)): 1,
        ("molt_proxy_trajectories_total", (("status", "rewarded"),)): 2,
        ("molt_proxy_trajectories_total", (("status", "unrewarded"),)): 0,
        ("molt_proxy_trajectories_total", (("status", "side"),)): 0,
        ("molt_proxy_requests_total", chat_route): 4,
        ("molt_proxy_requests_total", (("route", "/v1/sessions"), ("status", "201"))): 1,
        ("molt_proxy_requests_total", (("route", "/v1/rewards"), ("status", "200"))): 1,
        ("molt_proxy_requests_total", (("route", "/v1/admin/weights"), ("status", "401"))): 1,
        ("molt_proxy_requests_total", (("route", "/v1/admin/weights"), ("status", "200"))): 1,
        ("molt_proxy_requests_total", (("route", "unmatched"), ("status", "404"))): 1,
        ("molt_proxy_request_seconds_count", (("route", "/s/{session_id}/v1/chat/completions"),)): 4,
        ("molt_proxy_upstream_seconds_count", ()): 4,
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
        "/v1/rewards",
        "/v1/admin/weights",
        "unmatched",
        "/health",
    }


def test_metrics_need_the_admin_key_when_keys_are_set(proxy: str):
    assert httpx.get(f"{proxy}/metrics").status_code == 401
    agent = httpx.get(f"{proxy}/metrics", headers={"authorization": f"Bearer {AGENT_KEY}"})
    assert agent.status_code == 403
    assert agent.json()["error"]["type"] == "permission_error"
    assert httpx.get(f"{proxy}/metrics", headers=ADMIN).status_code == 200
