"""Echo restoration (DESIGN §2, `molt_proxy/echo.py`): an agent that echoes what the proxy
returned, re-serialised or as it was cut, stays in one segment over the exact sampled ids; a
real rewrite still opens a new segment.

In process: the real app with the real Qwen3 and Llama-3.2 tokenizers, templates and vLLM's
parsers, in front of the stand-in vLLM answering the sampled ids each test scripts
(`POST /_script`). The last tests sample with a real vLLM on CPU and check exactness.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from devtools import WEATHER_TOOL, tokenizer_source, weather_episode
from molt_proxy import store
from molt_proxy.config import Settings
from molt_proxy.echo import Returned, restore, same_json
from molt_proxy.rendering import Renders
from molt_proxy.sessions import Sessions
from molt_proxy.store import Store
from molt_proxy.tokenizer import Tokenizer
from molt_proxy.types import ParsedReply
from tests.helpers import (
    assert_exact,
    play,
    reply_as_message,
    trajectories,
    write_old_store,
)
from tests.inprocess import loaded_tokenizer, mock_vllm, serve_app

QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


OWN = "own"
"""`session` of `Proxy.chat` and the others: the test's own named session."""


@dataclass
class Proxy:
    url: str
    upstream: str
    tokenizer: Tokenizer
    own: str = "s"
    """The test's own session (the proxy serves a module's tests)."""

    def sample(self, text: str = "", finish_reason: str = "stop", ids: list[int] | None = None) -> list[int]:
        """Queue the ids the stand-in vLLM samples next: `ids`, else `text` and the end-of-turn
        id (none for `length`). Returns them."""
        if ids is None:
            ids = self.tokenizer.encode(text) + (
                [self.tokenizer.eos_token_id] if finish_reason == "stop" else []
            )
        script = [{"token_ids": ids, "finish_reason": finish_reason}]
        httpx.post(f"{self.upstream}/_script", json=script, timeout=10).raise_for_status()
        return ids

    def chat(
        self, messages: list[dict[str, Any]], session: str | None = OWN, **fields: Any
    ) -> dict[str, Any]:
        """A chat in `session`; None: no session id (zero-config)."""
        session = self.own if session == OWN else session
        base = f"{self.url}/s/{session}/v1" if session else f"{self.url}/v1"
        body = {"model": "m", "messages": messages, "tools": [WEATHER_TOOL], **fields}
        response = httpx.post(f"{base}/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()

    def segments(self, session: str = OWN) -> list[list[str]]:
        session = self.own if session == OWN else session
        described = httpx.get(f"{self.url}/v1/sessions/{session}", timeout=10).json()
        return [segment["turns"] for segment in described["segments"]]

    def record(self, session: str = OWN) -> list[dict[str, Any]]:
        session = self.own if session == OWN else session
        httpx.post(f"{self.url}/v1/rewards", json={"session_id": session, "reward": 1}).raise_for_status()
        return [t for t in trajectories(self.url) if t["session_id"] == session]


def _tokenizer_dir(arch: str) -> Path:
    source = tokenizer_source(arch)
    if source is None:
        pytest.skip(f"the real {arch} tokenizer is not in ../shared/tokenizers")
    return source


@contextmanager
def served(arch: str, db: Path, reasoning_parser: str | None = None) -> Iterator[Proxy]:
    model = _tokenizer_dir(arch)
    parser = "hermes" if arch == "qwen3" else "llama3_json"
    with mock_vllm(model) as upstream:
        settings = Settings(
            model=str(model),
            upstreams=[upstream],
            db_path=db,
            tool_call_parser=parser,
            reasoning_parser=reasoning_parser,
        )
        with serve_app(settings) as url:
            yield Proxy(url, upstream, loaded_tokenizer(str(model)))


@pytest.fixture(scope="module")
def qwen3_proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    with served("qwen3", tmp_path_factory.mktemp("echo") / "qwen3.db") as proxy:
        yield proxy


@pytest.fixture(scope="module")
def llama_proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    with served("llama", tmp_path_factory.mktemp("echo") / "llama.db") as proxy:
        yield proxy


@pytest.fixture
def qwen3(qwen3_proxy: Proxy) -> Proxy:
    return replace(qwen3_proxy, own=uuid.uuid4().hex)


@pytest.fixture
def llama(llama_proxy: Proxy) -> Proxy:
    return replace(llama_proxy, own=uuid.uuid4().hex)


def qwen3_call(arguments: str) -> str:
    return f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>'


def llama_call(arguments: str) -> str:
    return f'{{"name": "get_weather", "parameters": {arguments}}}'


def echoed(reply: dict[str, Any], arguments: str | None = None) -> dict[str, Any]:
    """The reply's message as an agent echoes it, its one call's arguments re-serialised."""
    message = {k: v for k, v in reply["choices"][0]["message"].items() if v is not None}
    if arguments is not None:
        [call] = message["tool_calls"]
        message["tool_calls"] = [{**call, "function": {**call["function"], "arguments": arguments}}]
    return message


def results(reply: dict[str, Any]) -> list[dict[str, Any]]:
    calls = reply["choices"][0]["message"]["tool_calls"]
    return [{"role": "tool", "tool_call_id": c["id"], "content": "Sunny, 22 C."} for c in calls]


def tool_episode(proxy: Proxy, call: str, echo: str, session: str | None = OWN) -> list[Any]:
    """Two turns: the model samples the tool `call`, the agent echoes it with its arguments as
    `echo` and the result, the model answers. Returns both replies, the first's sampled ids
    and the second request's history."""
    sampled = proxy.sample(call)
    first = proxy.chat(QUESTION, session)
    history = [*QUESTION, echoed(first, echo), *results(first)]
    proxy.sample("Sunny.")
    second = proxy.chat(history, session)
    return [first, second, sampled, history]


def continued_exactly(proxy: Proxy, first: dict, second: dict, sampled: list[int], history: list) -> None:
    """`second` continued `first`'s segment: its prompt is the first prompt, the sampled ids,
    then the rest of the render after the reply as returned (the template's closing on)."""
    [record] = proxy.record()
    first_turn, second_turn = record["turns"]
    ids = record["token_ids"]
    assert ids[first_turn["completion_start"] : first_turn["completion_end"]] == sampled
    assert second_turn["prompt_start"] == first_turn["completion_end"]
    assert second["usage"]["prompt_tokens"] == second_turn["completion_start"]
    rest = proxy.tokenizer.ids_bytes(ids[second_turn["prompt_start"] : second_turn["completion_start"]])
    assert proxy.tokenizer.render(history, [WEATHER_TOOL], {}).encode().endswith(rest)


def test_qwen3_compact_json_echo_is_one_segment(qwen3):
    first, second, sampled, history = tool_episode(qwen3, qwen3_call('{"city": "Paris"}'), '{"city":"Paris"}')
    assert qwen3.segments() == [[first["id"], second["id"]]]
    continued_exactly(qwen3, first, second, sampled, history)


def test_qwen3_sorted_keys_and_dropped_whitespace_are_one_segment(qwen3):
    arguments = '{"unit": "c",  "city": "Paris", "days": [1, 2.0]}'
    echo = json.dumps(json.loads(arguments), sort_keys=True, separators=(",", ":"))
    first, second, sampled, history = tool_episode(qwen3, qwen3_call(arguments), echo)
    assert echo.startswith('{"city"') and qwen3.segments() == [[first["id"], second["id"]]]
    continued_exactly(qwen3, first, second, sampled, history)


@pytest.mark.parametrize(
    "echo", ['{"city": "Lyon"}', '{"city": "Paris", "unit": "c"}', '{"city": ["Paris"]}']
)
def test_qwen3_arguments_that_mean_something_else_open_a_segment(qwen3, echo):
    first, second, _, history = tool_episode(qwen3, qwen3_call('{"city": "Paris"}'), echo)
    assert qwen3.segments() == [[first["id"]], [second["id"]]]
    [_, new] = qwen3.record()
    prompt = new["token_ids"][: new["turns"][0]["completion_start"]]
    assert prompt == qwen3.tokenizer.encode(qwen3.tokenizer.render(history, [WEATHER_TOOL], {}))


def test_qwen3_thinking_continues_in_a_tool_loop_and_opens_a_segment_where_the_template_drops_it(tmp_path):
    with served("qwen3", tmp_path / "thinking.db", reasoning_parser="qwen3") as proxy:
        # Sampled without the newlines the template writes around reasoning: the echo view
        # maps the re-rendered reply back while the template shows it (a tool loop)...
        proxy.sample("<think>Paris, then.</think>" + qwen3_call('{"city":"Paris"}'))
        first = proxy.chat(QUESTION)
        assert first["choices"][0]["message"]["reasoning_content"] == "Paris, then."
        history = [*QUESTION, echoed(first, '{"city": "Paris"}'), *results(first)]
        proxy.sample("<think>Done.</think>Sunny.")
        second = proxy.chat(history)
        assert proxy.segments() == [[first["id"], second["id"]]]
        # ... but not once a user turn makes the template drop earlier reasoning: a rewrite,
        # even where the reply's echo view would match (it does not show the reasoning).
        replies = [first, second]
        for question in ("Thanks!", "Bye?"):
            history += [echoed(replies[-1]), {"role": "user", "content": question}]
            proxy.sample("<think>Polite.</think>Bye.")
            replies.append(proxy.chat(history))
        assert proxy.segments() == [[first["id"], second["id"]], [replies[2]["id"]], [replies[3]["id"]]]


THINKING_OFF = {"chat_template_kwargs": {"enable_thinking": False}}
EMPTY_THINK = b"<|im_start|>assistant\n<think>\n\n</think>\n\n"
"""How Qwen3's generation prompt ends with thinking off; its history shows no such block."""


def sent(upstream: str, turns: int) -> list[list[int]]:
    """The prompt ids of the last `turns` generate requests the stand-in vLLM got."""
    return [body["token_ids"] for body in httpx.get(f"{upstream}/_generated").json()[-turns:]]


def test_a_generation_prompts_end_the_history_leaves_out_is_probed_from_the_template(qwen3, llama):
    qwen3_renders, llama_renders = Renders(qwen3.tokenizer), Renders(llama.tokenizer)
    assert qwen3_renders.dropped([WEATHER_TOOL], {"enable_thinking": False}) == "<think>\n\n</think>\n\n"
    assert qwen3_renders.dropped([WEATHER_TOOL], {}) == ""
    assert qwen3_renders.dropped(None, {"enable_thinking": True}) == ""
    assert llama_renders.dropped([WEATHER_TOOL], {}) == llama_renders.dropped(None, {}) == ""


def test_qwen3_thinking_off_is_one_segment_over_the_ids_sent_and_survives_a_restart(tmp_path):
    """With thinking off, Qwen3's generation prompt ends with an empty `<think>` block that its
    history leaves out: the echo view stands for it, so every turn continues the segment over
    the ids the model saw (a restart rebuilds that view from the store)."""
    db = tmp_path / "off.db"
    with served("qwen3", db) as proxy:
        sampled = proxy.sample(qwen3_call('{"city": "Paris"}'))
        replies = [proxy.chat(QUESTION, **THINKING_OFF)]
        history = [*QUESTION, echoed(replies[0], '{"city":"Paris"}'), *results(replies[0])]
        sampled += proxy.sample("Sunny.")
        replies.append(proxy.chat(history, **THINKING_OFF))
        prompts = sent(proxy.upstream, 2)
    history += [echoed(replies[-1]), {"role": "user", "content": "Thanks!"}]
    with served("qwen3", db) as restarted:
        sampled += restarted.sample("Bye.")
        replies.append(restarted.chat(history, **THINKING_OFF))
        prompts += sent(restarted.upstream, 1)
        assert restarted.segments() == [[r["id"] for r in replies]]
        [record] = restarted.record()
    ids, turns = record["token_ids"], record["turns"]
    assert [ids[: t["completion_start"]] for t in turns] == prompts
    assert [i for t in turns for i in ids[t["completion_start"] : t["completion_end"]]] == sampled
    assert all(restarted.tokenizer.ids_bytes(p).endswith(EMPTY_THINK) for p in prompts)
    rendered = restarted.tokenizer.render(history, [WEATHER_TOOL], {"enable_thinking": False}).encode()
    assert EMPTY_THINK not in rendered[: -len(EMPTY_THINK)]  # the history shows none
    rest = restarted.tokenizer.ids_bytes(ids[turns[2]["prompt_start"] : turns[2]["completion_start"]])
    assert rest.startswith(b"\n<|im_start|>user\nThanks!") and rendered.endswith(rest)


def test_a_reply_without_calls_or_text_is_found_by_its_reasoning():
    """An Anthropic reply shows no whitespace-only text block, so a reply that only thinks is
    echoed as its thinking alone: found by it, its whitespace comes back as sampled."""
    returned = Returned()
    returned.add("s", ParsedReply(content="\n\n", reasoning_content="\nHm.\n"))
    find = returned.of_session("s")
    echoed = {"role": "assistant", "content": "", "reasoning_content": "Hm."}
    assert restore([echoed], find) == [
        {"role": "assistant", "content": "\n\n", "reasoning_content": "\nHm.\n"}
    ]
    other = {"role": "assistant", "content": "", "reasoning_content": "Hm?"}
    assert restore([other], find) == [other]


def test_json_values_compare_by_meaning():
    assert same_json({"a": 1, "b": [1.0, None]}, {"b": [1, None], "a": 1.0})
    assert not same_json({"a": 1}, {"a": True}) and not same_json({"a": 0}, {"a": False})
    assert not same_json({"a": "1"}, {"a": 1}) and not same_json([1, 2], [2, 1])


def test_llama_tojson_template_continues_over_compact_sampled_arguments(llama):
    # Llama-3.2's template prints arguments with `tojson`: the compact bytes the model sampled
    # never come back, whatever the agent echoes; the reply's echo view maps them back.
    first, second, sampled, history = tool_episode(llama, llama_call('{"city":"Paris"}'), '{"city": "Paris"}')
    assert llama.segments() == [[first["id"], second["id"]]]
    continued_exactly(llama, first, second, sampled, history)


def test_trimmed_content_is_one_segment(qwen3, llama):
    for proxy in (qwen3, llama):
        history = list(QUESTION)
        replies = []
        for text in ("  It is sunny.\n\n", "Warm, too. "):
            proxy.sample(text)
            replies.append(proxy.chat(history))
            history += [{"role": "assistant", "content": text.strip()}, {"role": "user", "content": "And?"}]
        assert proxy.segments() == [[r["id"] for r in replies]]
    # A trimmed echo of what was returned is restored; other content is a rewrite.
    qwen3.sample("Rain.")
    qwen3.chat([*history[:-2], {"role": "assistant", "content": "Snow."}, history[-1]])
    assert len(qwen3.segments()) == 2


def test_stop_strings_stay_one_segment_over_three_turns(qwen3):
    for include in (False, True):
        session, history, replies, sampled = f"stop-{include}", list(QUESTION), [], []
        for text in (" I wipe", " a wiper", " the tree"):
            # vLLM ends on the token holding "e" and keeps all of it: no end-of-turn id.
            sampled.append(qwen3.sample(ids=qwen3.tokenizer.encode(text)))
            fields = {"stop": ["e"], "include_stop_str_in_output": include}
            reply = qwen3.chat(history, session, **fields)
            content = reply["choices"][0]["message"]["content"]
            assert content == text[: text.index("e") + include]
            replies.append(reply)
            history += [echoed(reply), {"role": "user", "content": "More."}]
        assert qwen3.segments(session) == [[r["id"] for r in replies]]
        [record] = qwen3.record(session)
        turns = record["turns"]
        assert [record["token_ids"][t["completion_start"] : t["completion_end"]] for t in turns] == sampled
        # After each cut reply the prompt goes on with the template's own closing.
        for turn in turns[1:]:
            rest = qwen3.tokenizer.ids_bytes(
                record["token_ids"][turn["prompt_start"] : turn["completion_start"]]
            )
            assert rest.startswith(b"<|im_end|>\n<|im_start|>user\nMore.")
        generated = httpx.get(f"{qwen3.upstream}/_generated", timeout=10).json()
        assert generated[-1]["sampling_params"]["include_stop_str_in_output"] is include


def test_stop_token_ids_stay_one_segment(qwen3):
    dot = qwen3.tokenizer.encode(".")[0]
    history, replies = list(QUESTION), []
    for text in ("Sunny", "Warm"):
        qwen3.sample(ids=[*qwen3.tokenizer.encode(text), dot])
        reply = qwen3.chat(history, stop_token_ids=[dot])
        assert reply["choices"][0]["message"]["content"] == text
        replies.append(reply)
        history += [echoed(reply), {"role": "user", "content": "And?"}]
    assert qwen3.segments() == [[r["id"] for r in replies]]
    [record] = qwen3.record()
    second = record["turns"][1]
    # The sampled stop id stands for the template's end of turn: no `<|im_end|>` is added.
    assert record["token_ids"][second["prompt_start"] - 1] == dot
    rest = record["token_ids"][second["prompt_start"] : second["completion_start"]]
    assert qwen3.tokenizer.ids_bytes(rest).startswith(b"\n<|im_start|>user\nAnd?")


def test_a_length_cut_inside_a_character_stays_one_segment(qwen3):
    cut = qwen3.tokenizer.encode("Il fait \U0001d518")  # the last character takes two ids
    partial = next(n for n in range(1, len(cut)) if _splits_a_character(qwen3.tokenizer, cut[:n]))
    history, replies = list(QUESTION), []
    for _ in range(2):
        qwen3.sample(ids=cut[:partial], finish_reason="length")
        reply = qwen3.chat(history, max_tokens=partial)
        assert reply["choices"][0]["message"]["content"].endswith("\ufffd")
        replies.append(reply)
        history += [echoed(reply), {"role": "user", "content": "Go on."}]
    assert qwen3.segments() == [[r["id"] for r in replies]]


def test_a_call_cut_off_by_max_tokens_is_a_call_and_its_echo_continues(qwen3):
    """The whole-reply parser found no call in a call cut off by `max_tokens` (its JSON is
    incomplete) and returned its markup as text, while a stream had already sent the call out:
    the whole reply is now what the stream adds up to (issue 26.12; whole and streamed on a
    real vLLM in `tests/test_anthropic_vllm.py`), and its echo continues the segment."""
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "cel'
    ids = qwen3.tokenizer.encode(cut)
    qwen3.sample(ids=ids, finish_reason="length")
    whole = qwen3.chat(QUESTION, max_tokens=len(ids))
    message = whole["choices"][0]["message"]
    [call] = message["tool_calls"]
    assert (whole["choices"][0]["finish_reason"], message["content"]) == ("length", None)
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "cel'}
    qwen3.sample("Sunny.")
    history = [*QUESTION, echoed(whole), {"role": "tool", "tool_call_id": call["id"], "content": "Sunny."}]
    qwen3.chat(history)
    assert len(qwen3.segments()) == 1  # the echo of the cut call continued the segment


def _splits_a_character(tokenizer: Tokenizer, ids: list[int]) -> bool:
    try:
        tokenizer.ids_bytes(ids).decode()
    except UnicodeDecodeError:
        return True
    return False


def test_zero_config_compact_json_episode_is_one_session_and_survives_a_restart(tmp_path):
    # pydantic-ai's episode: no session id, arguments echoed compact; one reply cut by a stop
    # string before the restart and echoed after it (its echo view comes from the store). A
    # stand-in vLLM (and its script) is per proxy: the restarted proxy gets its own.
    db = tmp_path / "p.db"
    with served("qwen3", db) as proxy:
        first, second, _, history = tool_episode(
            proxy, qwen3_call('{"city": "Paris"}'), '{"city":"Paris"}', session=None
        )
        history += [echoed(second), {"role": "user", "content": "Wipe?"}]
        proxy.sample(ids=proxy.tokenizer.encode(" I wipe"))
        third = proxy.chat(history, session=None, stop=["e"])
        replies = [first, second, third]
        [session] = {r["session_id"] for r in replies}
        assert proxy.segments(session) == [[r["id"] for r in replies]]
    history += [echoed(third), {"role": "user", "content": "And Lyon?"}]
    with served("qwen3", db) as restarted:
        restarted.sample(qwen3_call('{"city": "Lyon"}'))
        replies.append(restarted.chat(history, session=None))
        history += [echoed(replies[-1], '{"city":"Lyon"}'), *results(replies[-1])]
        restarted.sample("Cloudy.")
        replies.append(restarted.chat(history, session=None))
        assert {r["session_id"] for r in replies} == {session}
        assert restarted.segments(session) == [[r["id"] for r in replies]]


def test_a_store_from_before_echo_views_opens_and_its_turns_continue_by_their_sampled_bytes(tmp_path):
    db_path = tmp_path / "old.db"
    write_old_store(db_path, store._SCHEMA.replace(",\n    echo BLOB", ""), "{}")
    with sqlite3.connect(db_path) as db:
        assert "echo" not in [row[1] for row in db.execute("PRAGMA table_info(turns)")]

    async def reopen() -> Sessions:
        old = Store(db_path)
        await old.open()
        try:
            sessions = Sessions(old, loaded_tokenizer(str(_tokenizer_dir("qwen3"))), "tiny")
            await sessions.recover()
            return sessions
        finally:
            await old.close()

    [segment] = asyncio.run(reopen()).get("s").segments
    assert segment.token_ids.tolist() == [1, 2, 3] and segment.echo is None
    with sqlite3.connect(db_path) as db:
        assert "echo" in [row[1] for row in db.execute("PRAGMA table_info(turns)")]


# -- real sampling: vLLM on CPU, the openai SDK --------------------------------------------


def pydantic_ai_echo(message: Any) -> dict[str, Any]:
    """An echo as pydantic-ai and Claude Code write it: arguments compact with sorted keys,
    content trimmed."""
    data = reply_as_message(message)
    for call in data.get("tool_calls", []):
        arguments = json.loads(call["function"]["arguments"])
        call["function"]["arguments"] = json.dumps(arguments, separators=(",", ":"), sort_keys=True)
    if data.get("content"):
        data["content"] = data["content"].strip()
    return data


def test_vllm_re_serialising_agents_named_and_zero_config_are_one_exact_segment(
    qwen3_model, qwen3_vllm, start_proxy
):
    proxy = start_proxy(qwen3_model, qwen3_vllm, "--tool-call-parser", "hermes")
    conversation = weather_episode("hermes")
    sessions = []
    for base in (proxy.base_url("named"), proxy.base_url()):
        client = OpenAI(base_url=base, api_key="-", max_retries=0)
        replies = play(client, conversation, echo=pydantic_ai_echo).replies
        assert '"city": "Paris"' in replies[0].choices[0].message.tool_calls[0].function.arguments
        [session] = {r.model_extra["session_id"] for r in replies}  # zero-config: one session
        described = httpx.get(f"{proxy.url}/v1/sessions/{session}", timeout=10).json()
        assert [s["turns"] for s in described["segments"]] == [[r.id for r in replies]]
        sessions.append(session)
    for session in sessions:
        httpx.post(f"{proxy.url}/v1/rewards", json={"session_id": session, "reward": 1}).raise_for_status()
    records = trajectories(proxy.url)
    assert [r["session_id"] for r in records] == sessions
    for record in records:
        assert_exact(record, qwen3_model)


def test_vllm_cut_replies_echoed_as_returned_stay_one_exact_segment(qwen3_model, qwen3_vllm, start_proxy):
    proxy = start_proxy(qwen3_model, qwen3_vllm, "--tool-call-parser", "hermes")
    newline = loaded_tokenizer(str(qwen3_model)).encode("\n")
    cases = {
        "stop": {"stop": ["e"]},
        "stop-included": {"stop": ["e"], "include_stop_str_in_output": True},
        "stop-id": {"stop_token_ids": newline},
    }
    for session, fields in cases.items():
        client = OpenAI(base_url=proxy.base_url(session), api_key="-", max_retries=0)
        history: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]
        replies = []
        for _ in range(3):
            reply = client.chat.completions.create(
                model="tiny",
                messages=history,
                tools=[WEATHER_TOOL],
                temperature=0,
                max_tokens=60,  # the greedy tiny model writes a newline after 33 tokens at most
                extra_body=fields,
            )
            replies.append(reply)
            history += [reply_as_message(reply.choices[0].message), {"role": "user", "content": "More."}]
        described = httpx.get(f"{proxy.url}/v1/sessions/{session}", timeout=10).json()
        assert [s["turns"] for s in described["segments"]] == [[r.id for r in replies]]
        httpx.post(f"{proxy.url}/v1/rewards", json={"session_id": session, "reward": 1}).raise_for_status()
    for record in trajectories(proxy.url):
        assert [t["finish_reason"] for t in record["turns"]] == ["stop"] * 3
        assert_exact(record, qwen3_model)
