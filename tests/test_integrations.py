"""The integrations, each driving its real library against the real proxy and a real vLLM:
the `openai` SDK session helper, a LangGraph ReAct agent on `ChatOpenAI`, and an OpenAI
Agents SDK agent on its default Responses model and on its Chat Completions model. Each plays
the tiny model's scripted weather episode; the record must be one exact segment holding the
scripted replies, with the reward.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from devtools import AGENTS_SDK_WEATHER_TOOL, render_reply, weather_episode
from integrations.session import MoltSession, molt_session
from tests.helpers import assert_exact, play
from tests.inprocess import loaded_tokenizer

# The example agents are what these tests drive: they are imported from examples/ as they are.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

ADMIN_KEY = "test-admin-key"
SCRIPT = weather_episode("hermes")
SCRIPTED_REPLIES = [m for m in SCRIPT["messages"] if m["role"] == "assistant"]
SCRIPTED_ANSWERS = [m["content"] for m in SCRIPTED_REPLIES if m["content"]]


def _assert_recorded(
    proxy_url: str,
    session: MoltSession,
    answer: dict[str, Any],
    model_dir: Path,
    tools: list[dict[str, Any]],
    info: dict[str, Any],
    admin_key: str | None = None,
) -> None:
    """One segment, the reward on it, the first prompt as the template renders the script,
    every sampled reply the scripted one, and ids, mask and logprobs exact."""
    assert answer["status"] == "rewarded" and len(answer["trajectories"]) == 1, answer
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    data = httpx.get(f"{proxy_url}/v1/trajectories", params={"limit": 1000}, headers=headers).json()["data"]
    [trajectory] = [t for t in data if t["session_id"] == session.session_id]
    assert trajectory["trajectory_id"] == answer["trajectories"][0]["trajectory_id"]
    assert (trajectory["reward"], trajectory["info"], trajectory["group_id"]) == (1.0, info, session.group_id)
    tokenizer = loaded_tokenizer(str(model_dir))
    ids, turns = trajectory["token_ids"], trajectory["turns"]
    assert ids[: turns[0]["completion_start"]] == tokenizer.encode(
        tokenizer.render(SCRIPT["messages"][:2], tools, {})
    )
    sampled = [tokenizer.decode(ids[t["completion_start"] : t["completion_end"]], False) for t in turns]
    assert sampled == [render_reply(m, "hermes") + "<|im_end|>" for m in SCRIPTED_REPLIES]
    assert_exact(trajectory, model_dir)


def test_openai_session_helper_records_one_exact_segment(qwen3_model, qwen3_vllm, start_proxy):
    proxy = start_proxy(qwen3_model, qwen3_vllm, "--tool-call-parser", "hermes", "--admin-key", ADMIN_KEY)
    info = {"agent": "openai"}
    with molt_session(proxy.url, group_id="weather", admin_key=ADMIN_KEY) as session:
        assert session.base_url == f"{proxy.url}/s/{session.session_id}/v1"
        play(session.client, SCRIPT)
        # The session key rewards its own session although the proxy has an admin key.
        answer = session.reward(1.0, info=info)
    assert session.rewarded
    _assert_recorded(proxy.url, session, answer, qwen3_model, SCRIPT["tools"], info, ADMIN_KEY)

    # A block that raises posts no reward: the session stays open, nothing is finalized.
    with pytest.raises(RuntimeError), molt_session(proxy.url, admin_key=ADMIN_KEY) as failed:
        play(failed.client, SCRIPT, replies=1)
        raise RuntimeError("the agent crashed")
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    described = httpx.get(f"{proxy.url}/v1/sessions/{failed.session_id}", headers=headers).json()
    assert described["status"] == "open" and len(described["segments"][0]["turns"]) == 1
    data = httpx.get(f"{proxy.url}/v1/trajectories", headers=headers).json()["data"]
    assert [t["session_id"] for t in data] == [session.session_id]


def test_langgraph_react_agent_records_one_exact_segment(qwen3_model, qwen3_vllm, start_proxy):
    pytest.importorskip("langgraph.prebuilt")
    from langgraph_agent import run_agent

    from integrations.langchain_chat import chat_model

    proxy = start_proxy(qwen3_model, qwen3_vllm, "--tool-call-parser", "hermes")
    info = {"agent": "langgraph"}
    with molt_session(proxy.url, group_id="weather-langgraph") as session:
        messages = run_agent(chat_model(session, seed=7))
        answer = session.reward(1.0, info=info)
    assert [m.content for m in messages if m.type == "ai" and not m.tool_calls] == SCRIPTED_ANSWERS
    _assert_recorded(proxy.url, session, answer, qwen3_model, SCRIPT["tools"], info)


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_agents_sdk_agent_records_one_exact_segment(qwen3_model, qwen3_vllm, start_proxy, api):
    from agents_sdk_agent import run_agent

    from integrations.agents_sdk import run_config
    from integrations.session import amolt_session

    proxy = start_proxy(qwen3_model, qwen3_vllm, "--tool-call-parser", "hermes")
    info = {"agent": "agents-sdk"}

    async def episode() -> tuple[MoltSession, list[str], dict[str, Any]]:
        async with amolt_session(proxy.url, group_id="weather-agents-sdk") as session:
            answers = await run_agent(run_config(session, api=api))
            return session, answers, await session.areward(1.0, info=info)

    session, answers, answer = asyncio.run(episode())
    assert answers == SCRIPTED_ANSWERS
    _assert_recorded(proxy.url, session, answer, qwen3_model, [AGENTS_SDK_WEATHER_TOOL], info)
