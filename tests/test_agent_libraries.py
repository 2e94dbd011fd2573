"""pydantic-ai, smolagents, DSPy and LiteLLM, each driving its real library against the real
proxy and a real vLLM (one short episode each, on the shared tiny Qwen3 model, which learned
each library's requests: `devtools/library_scripts.py`).

Each asserts the sessions and segments of the episode and that every recorded prompt is the
template's render of what the library sent: pydantic-ai and LiteLLM echo their replies (one
segment per episode), DSPy folds the trajectory into text (one session, a chain per call), and
smolagents answers in one forced step (one constrained segment). Logprobs are exact on
unconstrained turns; on constrained ones (forced tool calls) vLLM records the grammar-masked
distribution, which can only raise a sampled token's logprob.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from devtools import WEATHER_TOOL, render_reply
from devtools.library_scripts import (
    ANSWER,
    dspy_react_episodes,
    pydantic_ai_output_episode,
    smolagents_episode,
)
from integrations.session import MoltSession, molt_session
from tests.helpers import forward_logprobs
from tests.inprocess import loaded_tokenizer
from tests.test_integrations import SCRIPT, SCRIPTED_ANSWERS, _assert_recorded

# The example agents are what these tests drive: they are imported from examples/ as they are.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
# LiteLLM fetches its price list from the internet when imported, retrying for seconds offline.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


def _session_trajectories(
    proxy_url: str, session: MoltSession, answer: dict[str, Any]
) -> list[dict[str, Any]]:
    """The rewarded session's trajectories, one per segment in segment order; the store holds
    no other session's."""
    data = httpx.get(f"{proxy_url}/v1/trajectories", params={"limit": 1000}).json()["data"]
    assert {t["session_id"] for t in data} == {session.session_id}
    assert answer["status"] == "rewarded"
    assert [t["trajectory_id"] for t in data] == [t["trajectory_id"] for t in answer["trajectories"]]
    return sorted(data, key=lambda t: t["segment"])


def _assert_taught(
    trajectory: dict[str, Any], model_dir: Path, script: dict[str, Any], constrained: bool
) -> None:
    """One segment of one call: its prompt is the template's render of the script's history
    (what the library sent), its reply the scripted one; the ids, mask and logprobs hold."""
    tokenizer = loaded_tokenizer(str(model_dir))
    ids, turns, messages = trajectory["token_ids"], trajectory["turns"], script["messages"]
    taught = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    assert [t["constrained"] for t in turns] == [constrained] * len(taught)
    assert ids[: turns[0]["completion_start"]] == tokenizer.encode(
        tokenizer.render(messages[: taught[0]], script["tools"], {})
    )
    sampled = [tokenizer.decode(ids[t["completion_start"] : t["completion_end"]], False) for t in turns]
    assert sampled == [render_reply(messages[i], "hermes") + "<|im_end|>" for i in taught]
    _assert_logprobs(trajectory, model_dir)


def _assert_logprobs(trajectory: dict[str, Any], model_dir: Path, tolerance: float = 1e-4) -> None:
    """Mask on exactly the sampled ids; their logprobs the model's own on unconstrained
    turns, and at least that on constrained ones (vLLM renormalised over what the grammar
    allowed); zero and version -1 elsewhere."""
    ids, mask, logprobs = trajectory["token_ids"], trajectory["loss_mask"], trajectory["logprobs"]
    reference = forward_logprobs(model_dir, ids)
    sampled: set[int] = set()
    for turn in trajectory["turns"]:
        positions = range(turn["completion_start"], turn["completion_end"])
        sampled |= set(positions)
        for i in positions:
            if turn["constrained"]:
                assert reference[i] - tolerance <= logprobs[i] <= 0.0, (i, logprobs[i], reference[i])
            else:
                assert abs(logprobs[i] - reference[i]) <= tolerance, (i, logprobs[i], reference[i])
    assert {i for i, m in enumerate(mask) if m} == sampled
    assert all(
        logprobs[i] == 0.0 and trajectory["weight_versions"][i] == -1 for i in range(len(ids)) if not mask[i]
    )


def test_pydantic_ai_agents_record_one_segment_each(qwen3_model, qwen3_vllm, start_proxy):
    pytest.importorskip("pydantic_ai")
    from pydantic_ai_agent import Forecast, run_agent, run_forecast

    from integrations.pydantic_ai_model import chat_model

    proxy = start_proxy(qwen3_model, qwen3_vllm, "--tool-call-parser", "hermes")
    # A tool: pydantic-ai echoes each call's arguments compacted; the episode stays one segment.
    info = {"agent": "pydantic-ai"}
    with molt_session(proxy.url, group_id="weather-pydantic-ai") as session:
        answers = run_agent(chat_model(session))
        answer = session.reward(1.0, info=info)
    assert answers == SCRIPTED_ANSWERS
    _assert_recorded(proxy.url, session, answer, qwen3_model, SCRIPT["tools"], info)

    # `output_type`: the output tool is forced, so both turns are constrained, and still one segment.
    with molt_session(proxy.url, group_id="forecast-pydantic-ai") as forecast_session:
        assert run_forecast(chat_model(forecast_session)) == Forecast(city="Paris", temperature_c=22)
        answer = forecast_session.reward(1.0)
    data = httpx.get(f"{proxy.url}/v1/trajectories", params={"limit": 1000}).json()["data"]
    [trajectory] = [t for t in data if t["session_id"] == forecast_session.session_id]
    assert answer["trajectories"] == [
        {"seq": trajectory["seq"], "trajectory_id": trajectory["trajectory_id"]}
    ]
    _assert_taught(trajectory, qwen3_model, pydantic_ai_output_episode(WEATHER_TOOL), constrained=True)


def test_smolagents_tool_calling_agent_records_one_constrained_segment(qwen3_model, qwen3_vllm, start_proxy):
    pytest.importorskip("smolagents")
    from smolagents_agent import run_agent

    from integrations.smolagents_model import openai_model

    proxy = start_proxy(qwen3_model, qwen3_vllm, "--tool-call-parser", "hermes")
    with molt_session(proxy.url, group_id="smolagents") as session:
        # Default settings: the step is sent with `tool_choice: "required"`, a constrained turn.
        final = run_agent(openai_model(session, seed=7, max_tokens=100))
        answer = session.reward(1.0)
    assert final == "4"
    [trajectory] = _session_trajectories(proxy.url, session, answer)
    _assert_taught(trajectory, qwen3_model, smolagents_episode(WEATHER_TOOL), constrained=True)


def test_dspy_react_is_one_session_of_exact_chains(qwen3_model, qwen3_vllm, start_proxy):
    pytest.importorskip("dspy")
    from dspy_agent import run_agent

    from integrations.dspy_lm import lm

    proxy = start_proxy(qwen3_model, qwen3_vllm, "--tool-call-parser", "hermes")
    with molt_session(proxy.url, group_id="weather-dspy") as session:
        prediction = run_agent(lm(session, seed=7, max_tokens=100))
        answer = session.reward(1.0)
    assert prediction.answer == ANSWER
    trajectories = _session_trajectories(proxy.url, session, answer)
    scripts = dspy_react_episodes()
    assert len(trajectories) == len(scripts) == 3
    for trajectory, script in zip(trajectories, scripts, strict=True):
        _assert_taught(trajectory, qwen3_model, script, constrained=False)


def test_litellm_agent_records_one_exact_segment(qwen3_model, qwen3_vllm, start_proxy):
    pytest.importorskip("litellm")
    from litellm_agent import run_agent

    from integrations.litellm_params import litellm_params

    proxy = start_proxy(qwen3_model, qwen3_vllm, "--tool-call-parser", "hermes")
    info = {"agent": "litellm"}
    with molt_session(proxy.url, group_id="weather-litellm") as session:
        messages = run_agent(litellm_params(session))
        answer = session.reward(1.0, info=info)
    assert [
        m["content"] for m in messages if m["role"] == "assistant" and m.get("content")
    ] == SCRIPTED_ANSWERS
    _assert_recorded(proxy.url, session, answer, qwen3_model, SCRIPT["tools"], info)
