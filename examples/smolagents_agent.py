"""A smolagents `ToolCallingAgent` with default settings, trained through molt-proxy: the only
change to the agent is its model, `openai_model(session)`, smolagents' `OpenAIModel` bound to
the session. It forces a tool call at every step (`tool_choice: "required"`), which the proxy
enforces by constrained decoding.

    python examples/smolagents_agent.py      # tiny model, vLLM on CPU and molt-proxy, all local
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from molt_stack import WEATHER, print_record, running_proxy, tiny_model
from smolagents import Model, ToolCallingAgent, tool

from integrations.session import molt_session
from integrations.smolagents_model import openai_model

RUN = Path("runs/smolagents")
TASK = "What is 2 + 2?"


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city.

    Args:
        city: The city name.
    """
    return WEATHER.get(city, "Unknown city.")


def run_agent(model: Model) -> Any:
    """Run the task (the tiny model answers it at once, through `final_answer`)."""
    return ToolCallingAgent(tools=[get_weather], model=model).run(TASK)


def main() -> None:
    RUN.mkdir(parents=True, exist_ok=True)
    with running_proxy(tiny_model(), RUN) as proxy_url:
        with molt_session(proxy_url, group_id="weather") as session:
            answer = run_agent(openai_model(session, model="tiny-qwen3", seed=7, max_tokens=200))
            reward = session.reward(float(answer == "4"), info={"agent": "smolagents"})
        print_record(reward, httpx.get(f"{proxy_url}/v1/trajectories").json()["data"])


if __name__ == "__main__":
    main()
