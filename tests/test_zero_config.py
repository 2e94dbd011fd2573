"""Zero-configuration sessions: agents that send no session id at all (DESIGN §3, mechanism 5),
groups, rewards by completion id, per-turn rewards and the session TTL."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from openai import OpenAI

from devtools import WEATHER_TOOL
from tests.conftest import AppProxy, ProxyProcess, app_proxy
from tests.helpers import assert_exact, reply_as_message, trajectories

QUESTION = "What is the weather in Paris and London?"
SYSTEMS = [
    "You are a weather assistant.",
    "You are a precise weather assistant.",
    "You are a helpful weather assistant.",
    "You are a weather bot.",
]


def agent(client: OpenAI, system: str, turns: int = 3, **kwargs: Any) -> list[Any]:
    """An unchanged tool-using agent: it knows nothing of sessions, only a base URL."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": QUESTION},
    ]
    replies = []
    for _ in range(turns):
        reply = client.chat.completions.create(
            model="tiny", messages=messages, tools=[WEATHER_TOOL], temperature=0, max_tokens=60, **kwargs
        )
        replies.append(reply)
        message = reply.choices[0].message
        messages.append(reply_as_message(message))
        if message.tool_calls:
            messages += [
                {"role": "tool", "tool_call_id": c.id, "content": "Sunny, 22 C."} for c in message.tool_calls
            ]
        else:
            messages.append({"role": "user", "content": "And Tokyo?"})
    return replies


def reward(proxy: AppProxy, **body: Any) -> httpx.Response:
    return httpx.post(f"{proxy.url}/v1/rewards", json=body, timeout=30)


def test_eight_agents_without_session_ids_get_eight_exact_sessions(qwen3_model, qwen3_vllm, start_proxy):
    proxy = start_proxy(qwen3_model, qwen3_vllm, "--tool-call-parser", "hermes")
    client = OpenAI(base_url=proxy.base_url(), api_key="-", max_retries=0)
    # 4 tasks, 2 attempts each: a pair sends byte-identical first requests at temperature 0 and
    # gets the same tool calls back; only the tool-call ids the proxy minted tell them apart.
    with ThreadPoolExecutor(8) as pool:
        runs = list(pool.map(lambda i: agent(client, SYSTEMS[i // 2]), range(8)))

    sessions = [{r.model_extra["session_id"] for r in replies} for replies in runs]
    assert all(len(s) == 1 for s in sessions) and len(set.union(*sessions)) == 8, sessions
    for i, replies in enumerate(runs):
        reward(proxy, completion_id=replies[0].id, reward=0.25, final=False).raise_for_status()
        closed = reward(proxy, completion_id=replies[-1].id, reward=float(i), info={"agent": i})
        assert closed.status_code == 200 and closed.json()["session_id"] == sessions[i].pop()

    records = trajectories(proxy.url)
    assert len(records) == 8  # one segment per session: every turn continued its own history
    by_agent = {int(r["info"]["agent"]): r for r in records}
    for i, replies in enumerate(runs):
        record = by_agent[i]
        assert record["reward"] == float(i) and record["status"] == "rewarded"
        assert [t["completion_id"] for t in record["turns"]] == [r.id for r in replies]
        assert [t["reward"] for t in record["turns"]] == [0.25, None, None]
        assert_exact(record, qwen3_model)
    groups = [by_agent[i]["group_id"] for i in range(8)]
    assert groups[0::2] == groups[1::2] and len(set(groups)) == 4


def test_group_header_and_its_conflicts(qwen3_model, qwen3_vllm, start_proxy):
    proxy = start_proxy(qwen3_model, qwen3_vllm, "--tool-call-parser", "hermes")
    grouped = OpenAI(base_url=proxy.base_url(), api_key="-", default_headers={"X-Group-Id": "task-7"})
    first = agent(grouped, SYSTEMS[0], turns=1)
    second = agent(grouped, SYSTEMS[1], turns=1)
    # Continuing the first conversation under another group is a contradiction, not a new session.
    response = httpx.post(
        f"{proxy.url}/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": _second_request(first[0]),
            "tools": [WEATHER_TOOL],
            "temperature": 0,
        },
        headers={"X-Group-Id": "task-8"},
        timeout=60,
    )
    assert response.status_code == 409 and response.json()["error"]["param"] == "X-Group-Id"
    reward(proxy, completion_id=first[-1].id, reward=1.0).raise_for_status()
    reward(proxy, completion_id=second[-1].id, reward=0.0).raise_for_status()
    assert [r["group_id"] for r in trajectories(proxy.url)] == ["task-7", "task-7"]
    # Explicit sessions take the header at creation too.
    httpx.post(
        f"{proxy.url}/s/named/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={"X-Group-Id": "task-9"},
        timeout=60,
    ).raise_for_status()
    assert httpx.get(f"{proxy.url}/v1/sessions/named").json()["group_id"] == "task-9"


def test_reward_errors_by_completion_id(qwen3_model, qwen3_vllm, start_proxy):
    proxy = start_proxy(qwen3_model, qwen3_vllm)
    client = OpenAI(base_url=proxy.base_url(), api_key="-")
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0
    )
    session = reply.model_extra["session_id"]

    def error(response: httpx.Response, status: int, param: str | None) -> None:
        assert response.status_code == status, response.text
        assert response.json()["error"]["param"] == param

    error(reward(proxy, completion_id="chatcmpl-nobody", reward=1), 404, "completion_id")
    error(reward(proxy, completion_id=reply.id, session_id=session, reward=1), 400, "session_id")
    error(reward(proxy, session_id=session, reward=1, final=False), 400, "final")
    error(reward(proxy, completion_id=reply.id, reward=1, final="no"), 400, "final")
    reward(proxy, completion_id=reply.id, reward=1).raise_for_status()
    error(reward(proxy, completion_id=reply.id, reward=1), 409, "session_id")
    error(reward(proxy, completion_id=reply.id, reward=1, final=False), 409, "completion_id")


def test_idle_sessions_close_unrewarded_after_the_ttl(qwen3_model, qwen3_vllm, start_proxy):
    proxy = start_proxy(qwen3_model, qwen3_vllm, "--session-ttl", "2")
    client = OpenAI(base_url=proxy.base_url(), api_key="-")
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0
    )
    deadline = time.monotonic() + 30
    while not (records := trajectories(proxy.url)) and time.monotonic() < deadline:
        time.sleep(0.5)
    [record] = records
    assert record["status"] == "unrewarded" and record["reward"] is None
    assert record["info"]["closed_by"] == "ttl"
    assert [t["completion_id"] for t in record["turns"]] == [reply.id]
    late = reward(proxy, completion_id=reply.id, reward=1.0)
    assert late.status_code == 409


def _second_request(first: Any) -> list[dict[str, Any]]:
    """The history an agent sends after `first` (the reply to the first request of SYSTEMS[0])."""
    message = first.choices[0].message
    history = [{"role": "system", "content": SYSTEMS[0]}, {"role": "user", "content": QUESTION}]
    history.append(reply_as_message(message))
    return history + [
        {"role": "tool", "tool_call_id": c.id, "content": "Sunny, 22 C."} for c in message.tool_calls
    ]


def test_an_inferred_session_survives_a_proxy_restart(qwen3_model, qwen3_vllm, tmp_path):
    proxy = ProxyProcess(
        qwen3_model, qwen3_vllm.url, tmp_path / "p.db", ["--tool-call-parser", "hermes"]
    ).start()
    [first] = agent(OpenAI(base_url=proxy.base_url(), api_key="-"), SYSTEMS[0], turns=1)
    proxy.kill9()
    # The restarted proxy runs in this process: what matters is that the killed one is gone.
    with app_proxy(
        qwen3_model, qwen3_vllm.url, tmp_path / "p.db", ["--tool-call-parser", "hermes"]
    ) as restarted:
        client = OpenAI(base_url=restarted.base_url(), api_key="-")
        second = client.chat.completions.create(
            model="tiny", messages=_second_request(first), tools=[WEATHER_TOOL], temperature=0, max_tokens=60
        )
        session = first.model_extra["session_id"]
        assert second.model_extra["session_id"] == session
        [segment] = httpx.get(f"{restarted.url}/v1/sessions/{session}").json()["segments"]
    assert segment["turns"] == [first.id, second.id]
