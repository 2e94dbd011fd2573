"""Session identification by each mechanism, and concurrent sessions that never mix."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI

from tests.conftest import app_proxy
from tests.helpers import reply_as_message
from tests.inprocess import loaded_tokenizer


@pytest.fixture(scope="module")
def proxy(qwen3_model, qwen3_vllm, tmp_path_factory):
    with app_proxy(qwen3_model, qwen3_vllm.url, tmp_path_factory.mktemp("sessions") / "p.db") as served:
        yield served


def ask(client: OpenAI, text: str, **kwargs):
    return client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": text}], max_tokens=4, seed=1, **kwargs
    )


def turns_of(proxy, session_id: str) -> list[str]:
    description = httpx.get(f"{proxy.url}/v1/sessions/{session_id}").json()
    return [cid for segment in description["segments"] for cid in segment["turns"]]


def test_session_by_url_path(proxy):
    reply = ask(OpenAI(base_url=proxy.base_url("by-path"), api_key="x"), "path")
    assert turns_of(proxy, "by-path") == [reply.id]


def test_session_by_header(proxy):
    client = OpenAI(base_url=proxy.base_url(), api_key="x", default_headers={"X-Session-Id": "by-header"})
    reply = ask(client, "header")
    assert turns_of(proxy, "by-header") == [reply.id]


def test_session_by_minted_key(proxy):
    minted = httpx.post(f"{proxy.url}/v1/sessions", json={"group_id": "task-7"}).json()
    assert minted["api_key"].startswith("mp-sess-") and minted["group_id"] == "task-7"
    reply = ask(OpenAI(base_url=proxy.base_url(), api_key=minted["api_key"]), "key")
    assert turns_of(proxy, minted["session_id"]) == [reply.id]
    # The minted base_url works as well, and lands in the same session.
    again = ask(OpenAI(base_url=minted["base_url"], api_key="x"), "url")
    assert turns_of(proxy, minted["session_id"])[-1] == again.id


def test_session_by_metadata(proxy):
    reply = ask(OpenAI(base_url=proxy.base_url(), api_key="x"), "meta", metadata={"session_id": "by-meta"})
    assert turns_of(proxy, "by-meta") == [reply.id]


def test_path_wins_over_header_and_metadata(proxy):
    client = OpenAI(base_url=proxy.base_url("winner"), api_key="x", default_headers={"X-Session-Id": "loser"})
    reply = ask(client, "first match wins", metadata={"session_id": "loser2"})
    assert turns_of(proxy, "winner") == [reply.id]
    assert httpx.get(f"{proxy.url}/v1/sessions/loser").status_code == 404


def test_two_concurrent_sessions_never_mix(proxy):
    def episode(name: str) -> list[str]:
        client = OpenAI(base_url=proxy.base_url(name), api_key="x")
        history = [{"role": "user", "content": f"I am {name}."}]
        ids = []
        for turn in range(4):
            reply = client.chat.completions.create(model="tiny", messages=history, max_tokens=6, seed=turn)
            ids.append(reply.id)
            history += [
                reply_as_message(reply.choices[0].message),
                {"role": "user", "content": f"{name} {turn}"},
            ]
        return ids

    with ThreadPoolExecutor(2) as pool:
        alice, bob = pool.map(episode, ["alice", "bob"])
    assert turns_of(proxy, "alice") == alice and turns_of(proxy, "bob") == bob
    for name in ("alice", "bob"):
        httpx.post(f"{proxy.url}/v1/rewards", json={"session_id": name, "reward": 1}).raise_for_status()
    records = httpx.get(f"{proxy.url}/v1/trajectories", params={"limit": 1000}).json()["data"]

    tokenizer = loaded_tokenizer(str(proxy.model))
    for name, other, ids in (("alice", "bob", alice), ("bob", "alice", bob)):
        # A random model's replies may not re-render verbatim, so a session can have several
        # segments; together they hold exactly its own turns and none of the other's text.
        own = [r for r in records if r["session_id"] == name]
        assert [t["completion_id"] for r in own for t in r["turns"]] == ids
        for record in own:
            prompt_ids = [t for t, m in zip(record["token_ids"], record["loss_mask"], strict=True) if not m]
            text = tokenizer.hf.decode(prompt_ids)
            assert f"I am {name}." in text and f"I am {other}." not in text and f"{other} " not in text


def test_sessions_without_a_group_are_grouped_by_their_first_prompt(proxy):
    for name, text in (("same1", "task A"), ("same2", "task A"), ("other", "task B")):
        ask(OpenAI(base_url=proxy.base_url(name), api_key="x"), text)
        httpx.post(f"{proxy.url}/v1/rewards", json={"session_id": name, "reward": 0}).raise_for_status()
    groups = {
        r["session_id"]: r["group_id"]
        for r in httpx.get(f"{proxy.url}/v1/trajectories", params={"limit": 1000}).json()["data"]
    }
    assert groups["same1"] == groups["same2"] != groups["other"]
    assert groups["same1"].startswith("prompt-")
