"""An OpenAI Agents SDK agent with a function tool, trained through molt-proxy: the agent is
unchanged; its run gets `run_config(session)`, the SDK's default model (Responses API) on the
session with tracing off (`run_config(session, api="chat_completions")`: its Chat Completions
model).

    python examples/agents_sdk_agent.py      # tiny model, vLLM on CPU and molt-proxy, all local
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
from agents import Agent, FunctionTool, ModelSettings, RunConfig, Runner
from molt_stack import QUESTIONS, SYSTEM_PROMPT, get_weather, print_record, running_proxy, tiny_model

from devtools import AGENTS_SDK_WEATHER_TOOL
from integrations.agents_sdk import run_config
from integrations.session import amolt_session

RUN = Path("runs/agents_sdk")


async def _call_get_weather(_context: Any, arguments: str) -> str:
    return get_weather(**json.loads(arguments))


def weather_tool() -> FunctionTool:
    """`get_weather` with the script's exact JSON schema, not strict. `@function_tool` would
    derive a strict schema (titles, `additionalProperties`) that the tiny model never saw; a
    real model takes `@function_tool` as it is."""
    function = AGENTS_SDK_WEATHER_TOOL["function"]
    return FunctionTool(
        name=function["name"],
        description=function["description"],
        params_json_schema=function["parameters"],
        on_invoke_tool=_call_get_weather,
        strict_json_schema=False,
    )


async def run_agent(config: RunConfig) -> list[str]:
    """Ask each question in one conversation (the last run's items plus the new question);
    returns the agent's answers."""
    agent = Agent(
        name="weather",
        instructions=SYSTEM_PROMPT,
        tools=[weather_tool()],
        model_settings=ModelSettings(extra_body={"seed": 7}),  # a vLLM field, in the body
    )
    items: list[Any] = []
    answers: list[str] = []
    for question in QUESTIONS:
        result = await Runner.run(agent, [*items, {"role": "user", "content": question}], run_config=config)
        items = result.to_input_list()
        answers.append(result.final_output)
        print(f"user: {question}\nassistant: {result.final_output}")
    return answers


async def episode(proxy_url: str) -> dict[str, Any]:
    async with amolt_session(proxy_url, group_id="weather") as session:
        await run_agent(run_config(session, model="tiny-qwen3"))
        return await session.areward(1.0, info={"agent": "agents-sdk"})


def main() -> None:
    RUN.mkdir(parents=True, exist_ok=True)
    model = tiny_model()
    with running_proxy(model, RUN) as proxy_url:
        reward = asyncio.run(episode(proxy_url))
        print_record(reward, httpx.get(f"{proxy_url}/v1/trajectories").json()["data"])


if __name__ == "__main__":
    main()
