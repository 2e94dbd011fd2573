"""Sampling parameters are recorded on every turn as vLLM applied them, and `--sampling` pins
them for training runs: the real app, tokenizer and SQLite in front of the stand-in vLLM,
which lists the body of every generate request it got."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import pytest

from molt_proxy import store
from molt_proxy.cli import parser
from molt_proxy.config import Settings, parse_pins
from molt_proxy.types import Sampling, Turn
from tests.helpers import reopened, trajectories, write_old_store
from tests.inprocess import chat_body, mock_vllm, post, qwen3_tokenizer_dir, serve_app

DEFAULTS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "logit_bias": None,
    "seed": None,
    "min_tokens": 0,
    "pinned": [],
}
"""The record of a turn whose agent set nothing: the OpenAI defaults the proxy sends."""


@contextmanager
def proxy_and_vllm(db: Path, **settings: Any) -> Iterator[tuple[str, str]]:
    """(proxy URL, stand-in vLLM URL)."""
    model = qwen3_tokenizer_dir()
    with mock_vllm(model) as upstream:
        with serve_app(Settings(model=str(model), upstreams=[upstream], db_path=db, **settings)) as url:
            yield url, upstream


def sent(upstream: str) -> list[dict[str, Any]]:
    """The sampling params of each generate request vLLM got, in order."""
    return [body["sampling_params"] for body in httpx.get(f"{upstream}/_generated").json()]


def chat(url: str, session: str, **fields: Any) -> dict[str, Any]:
    response = post(url, f"/s/{session}/v1/chat/completions", json=chat_body(**fields))
    assert response.status_code == 200, response.text
    return response.json()


def finish(url: str, session: str) -> list[dict[str, Any]]:
    """Reward the session; its turns' sampling records, in order, from the trajectory stream
    (each request here starts a conversation of its own: a segment each)."""
    post(url, "/v1/rewards", json={"session_id": session, "reward": 1.0}).raise_for_status()
    records = sorted((t for t in trajectories(url) if t["session_id"] == session), key=lambda t: t["segment"])
    return [turn["sampling"] for record in records for turn in record["turns"]]


def test_each_turn_records_the_sampling_vllm_applied_and_that_is_what_was_sent(tmp_path):
    asked = {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.05,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "repetition_penalty": 1.1,
        "logit_bias": {"11": 1.5},
        "seed": 3,
        "min_tokens": 2,
    }
    with proxy_and_vllm(tmp_path / "p.db") as (url, upstream):
        chat(url, "a", **asked)
        chat(url, "a", content="again")  # nothing set: the OpenAI defaults, sent explicitly
        chat(url, "a", content="cold", temperature=0.001)  # vLLM would run it at 0.01
        chat(url, "a", content="greedy", temperature=0, top_k=20, top_p=0.5)  # vLLM drops both
        records = finish(url, "a")
        params = sent(upstream)
    expected = [
        {**DEFAULTS, **asked, "logit_bias": {"11": 1.5}},
        DEFAULTS,
        {**DEFAULTS, "temperature": 0.01},
        {**DEFAULTS, "temperature": 0.0},
    ]
    assert records == expected
    for record, body in zip(records, params, strict=True):
        assert {name: body[name] for name in record if name != "pinned"} == {
            name: value for name, value in record.items() if name != "pinned"
        }


def test_pinned_sampling_overrides_what_agents_send_and_the_record_names_the_pins(tmp_path):
    pins = {"temperature": 1.0, "top_p": 1.0}
    with proxy_and_vllm(tmp_path / "p.db", sampling=pins) as (url, upstream):
        chat(url, "a", temperature=0.2, top_p=0.5, top_k=5)
        chat(url, "a", content="greedy", temperature=0)
        records = finish(url, "a")
        params = sent(upstream)
    pinned = {**DEFAULTS, **pins, "pinned": ["temperature", "top_p"]}
    assert records == [{**pinned, "top_k": 5}, pinned]  # top_k is the agent's: not pinned
    assert [(p["temperature"], p["top_p"], p["top_k"]) for p in params] == [(1.0, 1.0, 5), (1.0, 1.0, 0)]


def test_an_open_sessions_sampling_survives_a_restart(tmp_path):
    db = tmp_path / "p.db"
    with proxy_and_vllm(db) as (url, _):
        chat(url, "a", temperature=0.5, top_k=7)
    with proxy_and_vllm(db) as (url, _):  # recovered from the store's turn rows
        assert finish(url, "a") == [{**DEFAULTS, "temperature": 0.5, "top_k": 7}]


def test_a_store_from_before_sampling_was_recorded_opens_and_its_turns_read_none(tmp_path):
    db_path = tmp_path / "old.db"
    write_old_store(db_path, store._SCHEMA.replace(",\n    sampling TEXT", ""), "{}")
    with sqlite3.connect(db_path) as db:
        assert "sampling" not in [row[1] for row in db.execute("PRAGMA table_info(turns)")]

    [(session, turns)] = reopened(db_path)
    assert session.id == "s" and turns[0].generation.token_ids == [3] and turns[0].sampling is None


def test_sampling_pins_parse_from_name_value_pairs():
    assert parse_pins("temperature=1, top_p=0.95,top_k=-1") == {
        "temperature": 1.0,
        "top_p": 0.95,
        "top_k": -1,
    }
    assert parse_pins("") == {}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("temprature=1", "cannot pin sampling field 'temprature'"),
        ("seed=1", "cannot pin sampling field 'seed'"),
        ("temperature", "is not NAME=VALUE"),
        ("temperature=hot", "is not a number"),
        ("top_k=0.5", "is not an integer"),
        ("top_p=0", "out of range: (0, 1]"),
        ("temperature=3", "out of range: [0, 2]"),
        ("min_p=nan", "out of range"),
    ],
)
def test_a_bad_sampling_pin_is_refused_with_what_is_wrong(spec, message, capsys):
    with pytest.raises(ValueError, match=None) as error:
        parse_pins(spec)
    assert message in str(error.value)
    with pytest.raises(SystemExit):
        parser().parse_args(["serve", "--model", "m", "--sampling", spec])
    assert message in capsys.readouterr().err


def test_settings_refuse_a_bad_pin_too():
    with pytest.raises(ValueError, match="cannot pin sampling field 'temp'"):
        Settings(model="m", sampling={"temp": 1.0})


def test_the_record_survives_json_and_parquet_forms():
    record = Sampling(temperature=0.7, top_k=20, logit_bias={11: 1.5}, seed=3, pinned=["temperature"])
    turn = Turn("c", 0, 1, 2, "stop", sampling=record)
    assert Turn.from_json(json.loads(json.dumps(asdict(turn)))) == turn
    # Parquet gives a struct every key any record had, null where this one had none
    assert Sampling.from_json({**asdict(record), "logit_bias": {"11": 1.5, "12": None}}) == record
    assert Turn.from_json({**asdict(turn), "sampling": None}).sampling is None
