"""A pydantic-ai agent with a tool, and one with structured output (`output_type`), trained
through molt-proxy: the only change to either agent is its model, `chat_model(session)`,
pydantic-ai's `OpenAIChatModel` bound to the session.

    python examples/pydantic_ai_agent.py     # tiny model, vLLM on CPU and molt-proxy, all local
"""

from __future__ import annotations

from pathlib import Path

import httpx
from molt_stack import QUESTIONS, SYSTEM_PROMPT, get_weather, print_record, running_proxy, tiny_model
from pydantic import BaseModel
from pydantic_ai import Agent, Tool
from pydantic_ai.models import Model

from devtools import WEATHER_TOOL
from integrations.pydantic_ai_model import chat_model
from integrations.session import molt_session

RUN = Path("runs/pydantic_ai")
SETTINGS = {"seed": 7, "max_tokens": 200}


class Forecast(BaseModel):
    city: str
    temperature_c: int


def weather_tool() -> Tool:
    """`get_weather` with the script's exact JSON schema, not strict. pydantic-ai marks a tool
    `strict` whenever its schema allows, and vLLM constrains a strict tool's calls: every turn
    with it would be a constrained turn, which the trainer leaves out by default (docs/sampling.md,
    Constrained decoding). `@agent.tool_plain(strict=False)` does the same for a real model;
    the tiny one knows only the script's schema."""
    function = WEATHER_TOOL["function"]
    tool = Tool.from_schema(
        get_weather,
        name=function["name"],
        description=function["description"],
        json_schema=function["parameters"],
    )
    tool.strict = False
    return tool


def run_agent(model: Model) -> list[str]:
    """Ask each question in one conversation (the last run's messages as history)."""
    agent = Agent(model, system_prompt=SYSTEM_PROMPT, tools=[weather_tool()], model_settings=SETTINGS)
    history, answers = [], []
    for question in QUESTIONS:
        result = agent.run_sync(question, message_history=history)
        history = result.all_messages()
        answers.append(result.output)
        print(f"user: {question}\nassistant: {result.output}")
    return answers


def run_forecast(model: Model) -> Forecast:
    """Structured output: pydantic-ai forces its output tool (`tool_choice: "required"`), so
    every turn is constrained decoding (recorded `constrained`)."""
    agent = Agent(
        model,
        system_prompt=SYSTEM_PROMPT,
        tools=[weather_tool()],
        output_type=Forecast,
        model_settings=SETTINGS,
    )
    forecast = agent.run_sync("What is the weather in Paris?").output
    print(f"forecast: {forecast!r}")
    return forecast


def main() -> None:
    RUN.mkdir(parents=True, exist_ok=True)
    with running_proxy(tiny_model(), RUN) as proxy_url:
        with molt_session(proxy_url, group_id="weather") as session:
            run_agent(chat_model(session, model="tiny-qwen3"))
            reward = session.reward(1.0, info={"agent": "pydantic-ai"})
        with molt_session(proxy_url, group_id="forecast") as session:
            forecast = run_forecast(chat_model(session, model="tiny-qwen3"))
            session.reward(float(forecast.temperature_c == 22), info={"agent": "pydantic-ai"})
        print_record(reward, httpx.get(f"{proxy_url}/v1/trajectories").json()["data"])


if __name__ == "__main__":
    main()
