"""Evaluation episodes: a session created with `{"train": false}` is recorded and streamed like
any other, in a group under `eval/`, which the trainer never trains on (tests/trainer/test_loop.py)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.inprocess import app_client


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    with app_client(tmp_path_factory.mktemp("eval") / "p.db") as client:
        yield client


def create(proxy: httpx.Client, body: dict) -> httpx.Response:
    return proxy.post("/v1/sessions", json=body, timeout=30)


def test_train_false_puts_the_session_in_an_eval_group(proxy: httpx.Client) -> None:
    assert create(proxy, {"group_id": "digits", "train": False}).json()["group_id"] == "eval/digits"
    assert create(proxy, {"group_id": "eval/digits", "train": False}).json()["group_id"] == "eval/digits"
    assert create(proxy, {"train": False}).json()["group_id"] == "eval/"
    assert create(proxy, {"group_id": "digits", "train": True}).json()["group_id"] == "digits"


def test_train_must_be_a_boolean(proxy: httpx.Client) -> None:
    response = create(proxy, {"group_id": "digits", "train": "no"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["message"]) == ("train", "'train' must be a boolean")


def test_an_eval_episode_is_recorded_and_streamed_with_its_eval_group(proxy: httpx.Client) -> None:
    session = create(proxy, {"session_id": "exam", "group_id": "digits", "train": False}).json()
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    proxy.post(session["base_url"] + "/chat/completions", json=body).raise_for_status()
    proxy.post("/v1/rewards", json={"session_id": "exam", "reward": 0.5}).raise_for_status()
    [record] = [r for r in proxy.get("/v1/trajectories").json()["data"] if r["session_id"] == "exam"]
    assert (record["group_id"], record["reward"]) == ("eval/digits", 0.5)
