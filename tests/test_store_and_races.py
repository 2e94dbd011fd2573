"""Issue 9, items 7, 9 and 10: session creation is atomic, each token is stored once, and a
weights push is checked whole before any replica is touched.

The races and the weights route run against the real app in process (`tests/inprocess.py`);
storage is measured on a real SQLite file through `Sessions` and `Store`, as the proxy
writes it.
"""

from __future__ import annotations

import asyncio
import json
import random
import sqlite3
import struct
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from molt_proxy import store as store_module
from molt_proxy.config import Settings
from molt_proxy.sessions import Sessions
from molt_proxy.stitching import PromptPlan
from molt_proxy.store import Store
from molt_proxy.tokenizer import Tokenizer
from molt_proxy.types import Generation, ParsedReply, RecordedReply, SessionStatus
from molt_proxy.wire.openai import encode_reply
from tests.helpers import write_checkpoint, write_old_store
from tests.inprocess import (
    chat_body,
    inprocess_proxy,
    loaded_tokenizer,
    mock_vllm,
    qwen3_tokenizer_dir,
    serve_app,
)

TRIALS = 20


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with inprocess_proxy(tmp_path_factory.mktemp("races") / "p.db") as url:
        yield url


# -- 1. session creation races (item 7) ------------------------------------------------------


async def _twice(url: str, first: dict, second: dict, headers: dict[str, str]) -> list[httpx.Response]:
    """Two requests sent at once on two connections."""
    async with httpx.AsyncClient(base_url=url, timeout=60, headers=headers) as client:
        return list(
            await asyncio.gather(
                client.post("/v1/chat/completions", json=first),
                client.post("/v1/chat/completions", json=second),
            )
        )


def test_concurrent_first_requests_naming_one_new_session_both_join_it(proxy):
    for trial in range(TRIALS):
        session = f"race-chat-{trial}"
        replies = asyncio.run(
            _twice(proxy, chat_body("first"), chat_body("second"), {"x-session-id": session})
        )
        assert [r.status_code for r in replies] == [200, 200], [r.text for r in replies]
        described = httpx.get(f"{proxy}/v1/sessions/{session}").json()
        recorded = {c for segment in described["segments"] for c in segment["turns"]}
        assert recorded == {r.json()["id"] for r in replies}


def test_concurrent_first_requests_with_one_group_join_it_and_another_group_is_a_conflict(proxy):
    for trial in range(TRIALS):
        session = f"race-group-{trial}"
        same = asyncio.run(
            _twice(proxy, chat_body("a"), chat_body("b"), {"x-session-id": session, "x-group-id": "g"})
        )
        assert [r.status_code for r in same] == [200, 200], [r.text for r in same]
        other = httpx.post(
            f"{proxy}/v1/chat/completions",
            json=chat_body("c"),
            headers={"x-session-id": session, "x-group-id": "h"},
        )
        assert other.status_code == 409 and other.json()["error"]["param"] == "X-Group-Id"


async def _create_twice(url: str, session: str) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        body = {"session_id": session}
        return list(
            await asyncio.gather(
                client.post("/v1/sessions", json=body), client.post("/v1/sessions", json=body)
            )
        )


def test_concurrent_creation_of_one_session_id_is_one_201_and_one_clean_409(proxy):
    for trial in range(TRIALS):
        replies = asyncio.run(_create_twice(proxy, f"race-create-{trial}"))
        assert sorted(r.status_code for r in replies) == [201, 409], [r.text for r in replies]
        [conflict] = [r.json() for r in replies if r.status_code == 409]
        assert conflict["error"]["type"] == "conflict_error"


def test_a_closed_session_id_is_not_created_again(proxy):
    assert httpx.post(f"{proxy}/s/done/v1/chat/completions", json=chat_body()).status_code == 200
    httpx.post(f"{proxy}/v1/rewards", json={"session_id": "done", "reward": 1}).raise_for_status()
    replies = asyncio.run(_twice(proxy, chat_body("x"), chat_body("y"), {"x-session-id": "done"}))
    assert [r.status_code for r in replies] == [409, 409]
    assert httpx.post(f"{proxy}/v1/sessions", json={"session_id": "done"}).status_code == 409


# -- 2. each token stored once (item 9) ------------------------------------------------------

SESSIONS, TURNS = 40, 4


def _float32(value: float) -> float:
    """vLLM's logprobs are float32 values carried as JSON doubles."""
    return struct.unpack("f", struct.pack("f", value))[0]


async def _record(store: Store, tokenizer: Tokenizer, seed: int = 0) -> Sessions:
    """`SESSIONS` open sessions of `TURNS` turns, recorded as the proxy records them, with
    random ids and logprobs (which compress worst: a real conversation repeats itself)."""
    rng = random.Random(seed)
    sessions = Sessions(store, tokenizer, "tiny")
    for i in range(SESSIONS):
        session = await sessions.create(f"s{i}")
        for t in range(TURNS):
            prompt = [rng.randrange(150_000) for _ in range(rng.randrange(40, 160))]
            sampled = [rng.randrange(150_000) for _ in range(rng.randrange(20, 120))]
            generation = Generation(
                sampled, [_float32(-rng.expovariate(2.0)) for _ in sampled], [t] * len(sampled), "stop"
            )
            plan = PromptPlan(prompt, prompt, tokenizer.ids_bytes(prompt), 0 if t > 0 else None)
            reply = RecordedReply(
                f"c{i}-{t}", 0, "tiny", ParsedReply("ok"), "stop", len(prompt), len(sampled)
            )
            await sessions.record(session, plan, generation, f"h{i}-{t}", reply)
    return sessions


def _live_bytes(path: Path) -> int:
    """Bytes of the pages SQLite holds data in (free pages, reused by later rows, excluded)."""
    db = sqlite3.connect(path)
    try:
        db.execute("PRAGMA walwrite_checkpoint(TRUNCATE)")
        pages = (
            db.execute("PRAGMA page_count").fetchone()[0] - db.execute("PRAGMA freelist_count").fetchone()[0]
        )
        return pages * db.execute("PRAGMA page_size").fetchone()[0]
    finally:
        db.close()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return loaded_tokenizer(str(qwen3_tokenizer_dir()))


def test_finalized_sessions_keep_at_most_30_bytes_per_trajectory_token(tmp_path, tokenizer):
    async def scenario() -> tuple[int, list[dict]]:
        store = Store(tmp_path / "p.db")
        await store.open()
        sessions = await _record(store, tokenizer)
        closed = []
        for i in range(SESSIONS):
            closed += await sessions.close(f"s{i}", float(i), {"i": i}, SessionStatus.REWARDED)
        served = await store.trajectories_after(0, 10_000)
        await store.close()
        assert served == [json.loads(json.dumps(t.to_json())) for t in closed], "the JSON is unchanged"
        return sum(len(t.token_ids) for t in closed), served

    tokens, served = asyncio.run(scenario())
    assert len(served) == SESSIONS and tokens > 20_000
    db = sqlite3.connect(tmp_path / "p.db")
    assert db.execute("SELECT count(*) FROM turns").fetchone()[0] == 0
    assert db.execute("SELECT count(*) FROM completions").fetchone()[0] == SESSIONS * TURNS
    db.close()
    assert _live_bytes(tmp_path / "p.db") / tokens <= 30


def test_a_reward_by_completion_id_after_close_still_finds_its_session(tmp_path, tokenizer):
    async def scenario() -> None:
        store = Store(tmp_path / "p.db")
        await store.open()
        sessions = await _record(store, tokenizer)
        await sessions.close("s3", 1.0, {}, SessionStatus.REWARDED)
        assert await store.session_of_completion("c3-2") == "s3"
        assert await sessions.of_completion("c3-2") == "s3"
        assert await sessions.of_completion("c4-1") == "s4"  # open: still in its turn rows
        await store.close()

    asyncio.run(scenario())


def test_a_reward_by_completion_id_after_close_is_a_conflict_not_unknown(proxy):
    reply = httpx.post(f"{proxy}/s/by-completion/v1/chat/completions", json=chat_body()).json()
    httpx.post(f"{proxy}/v1/rewards", json={"session_id": "by-completion", "reward": 1}).raise_for_status()
    again = httpx.post(f"{proxy}/v1/rewards", json={"completion_id": reply["id"], "reward": 1})
    assert again.status_code == 409 and "by-completion" in again.json()["error"]["message"]


def test_restart_rebuilds_the_open_sessions_from_one_query_of_their_turns(tmp_path, tokenizer):
    async def scenario() -> None:
        store = Store(tmp_path / "p.db")
        await store.open()
        before = await _record(store, tokenizer)
        for i in range(0, SESSIONS, 2):
            await before.close(f"s{i}", 1.0, {}, SessionStatus.REWARDED)
        await store.close()

        store = Store(tmp_path / "p.db")
        await store.open()
        queries: list[str] = []
        await store._run(store.db.set_trace_callback, queries.append)
        after = Sessions(store, tokenizer, "tiny")
        assert await after.recover() == SESSIONS // 2
        await store._run(store.db.set_trace_callback, None)
        assert len([q for q in queries if "FROM turns" in q]) == 1
        for i in range(1, SESSIONS, 2):
            old, new = before.get(f"s{i}"), after.get(f"s{i}")
            assert [
                (s.index, s.token_ids, s.loss_mask, s.logprobs, s.weight_versions, s.turns)
                for s in new.segments
            ] == [
                (s.index, s.token_ids, s.loss_mask, s.logprobs, s.weight_versions, s.turns)
                for s in old.segments
            ]
            assert {i: h for i, (h, _) in new.last.items()} == {i: h for i, (h, _) in old.last.items()}
        assert after.find("s0") is None
        await store.close()

    asyncio.run(scenario())


# -- 3. the weights route checks everything, then acts (item 10) -----------------------------


@pytest.fixture
def weights_proxy(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """(proxy URL, stand-in vLLM URL): the stand-in lists the refresh calls at `/_calls`."""
    model = qwen3_tokenizer_dir()
    with mock_vllm(model) as upstream:
        with serve_app(Settings(model=str(model), upstreams=[upstream], db_path=tmp_path / "p.db")) as url:
            yield url, upstream


def _push(url: str, path: Path | str, version: object) -> httpx.Response:
    return httpx.post(f"{url}/v1/admin/weights", json={"path": str(path), "version": version}, timeout=60)


def _calls(upstream: str) -> list[list]:
    return httpx.get(f"{upstream}/_calls").json()


def _refresh_calls(folder: Path, version: int) -> list[list]:
    return [
        ["/pause?mode=keep", None],
        ["/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}}],
        ["/update_weight_version", {"new_version": str(version)}],
        ["/resume", None],
    ]


def _assert_refused(response: httpx.Response, param: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_a_version_past_int64_is_refused_before_vllm_is_touched(weights_proxy, tmp_path):
    url, upstream = weights_proxy
    folder = write_checkpoint(tmp_path / "v")
    for version in (2**63, -1, 1.5, "3", True, None):
        _assert_refused(_push(url, folder, version), "version")
    assert _calls(upstream) == []
    assert _push(url, folder, 2**63 - 1).status_code == 200


def test_versions_never_go_back_and_an_equal_one_is_a_re_push_of_the_same_folder(weights_proxy, tmp_path):
    url, upstream = weights_proxy
    v4, other = write_checkpoint(tmp_path / "v4"), write_checkpoint(tmp_path / "other")
    assert _push(url, v4, 4).status_code == 200
    assert _calls(upstream) == _refresh_calls(v4, 4)
    _assert_refused(_push(url, v4, 1), "version")
    _assert_refused(_push(url, other, 4), "version")  # another policy under the same label
    assert len(_calls(upstream)) == 4
    # A restarted trainer pushes its current version again: vLLM may have rebooted meanwhile.
    assert _push(url, v4, 4).status_code == 200
    assert _calls(upstream) == _refresh_calls(v4, 4) * 2
    health = httpx.get(f"{url}/health").json()
    assert [r["weight_version"] for r in health["replicas"]] == [4]


def test_a_symlinked_folder_is_resolved_and_vllm_gets_the_real_path(weights_proxy, tmp_path):
    url, upstream = weights_proxy
    real = write_checkpoint(tmp_path / "real")
    (tmp_path / "link").symlink_to(real)
    assert _push(url, tmp_path / "link", 1).status_code == 200
    assert _calls(upstream) == _refresh_calls(real, 1)
    # The label follows the folder, not the link: the same version through the link is the
    # same weights, and a dangling link is refused.
    assert _push(url, real, 1).status_code == 200
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    _assert_refused(_push(url, tmp_path / "dangling", 2), "path")


def test_a_broken_checkpoint_is_refused_before_vllm_is_touched(weights_proxy, tmp_path):
    url, upstream = weights_proxy
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    broken = {
        "garbage config and empty weights": write_checkpoint(
            tmp_path / "a", config=b"\x00garbage", weights=b""
        ),
        "garbage config": write_checkpoint(tmp_path / "b", config=b"{not json"),
        "config without model_type": write_checkpoint(tmp_path / "c", config=b'{"hidden_size": 8}'),
        "config not an object": write_checkpoint(tmp_path / "d", config=b"[1, 2]"),
        "empty weights": write_checkpoint(tmp_path / "e", weights=b""),
        "header longer than the file": write_checkpoint(
            tmp_path / "f", weights=struct.pack("<Q", 1000) + b"{}"
        ),
        "header not JSON": write_checkpoint(tmp_path / "g", weights=struct.pack("<Q", 4) + b"\xff\xfe{]"),
        "truncated tensor data": write_checkpoint(
            tmp_path / "h", weights=struct.pack("<Q", len(header)) + header + bytes(4)
        ),
    }
    (tmp_path / "file").write_text("x")
    for why, folder in broken.items():
        response = _push(url, folder, 1)
        assert response.status_code == 400, (why, response.text)
        assert response.json()["error"]["param"] == "path", why
    _assert_refused(_push(url, tmp_path / "file", 1), "path")
    _assert_refused(_push(url, "relative/folder", 1), "path")
    assert _calls(upstream) == []


def test_a_turn_an_older_proxy_stored_with_its_openai_reply_is_replayed_the_same(tmp_path, tokenizer):
    """Turn rows written before replies were kept format-neutral hold the OpenAI reply: a
    retry after the upgrade must get the very same body, and the echoed call ids still count."""
    old_reply = {
        "id": "chatcmpl-old",
        "object": "chat.completion",
        "created": 5,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "call-1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                    ],
                },
                "logprobs": None,
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3},
        "session_id": "s",
    }
    write_old_store(tmp_path / "old.db", store_module._SCHEMA, json.dumps(old_reply), inferred=True)

    async def scenario() -> None:
        store = Store(tmp_path / "old.db")
        await store.open()
        sessions = Sessions(store, tokenizer, "tiny")
        await sessions.recover()
        session = sessions.get("s")
        [(_, last_reply)] = session.last.values()
        assert last_reply is not None and last_reply.finish_reason == "stop"
        assert encode_reply(last_reply, "s", tokenizer.token_bytes) == old_reply
        assert session.call_ids == {"call-1"}
        await store.close()

    asyncio.run(scenario())
