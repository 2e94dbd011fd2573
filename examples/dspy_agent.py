"""A DSPy `ReAct` program with a tool, trained through molt-proxy: the only change to the
program is its language model, `lm(session)`, a `dspy.LM` bound to the session. DSPy writes
each step as a fresh prompt, so the session's name is what keeps the episode together.

    python examples/dspy_agent.py            # tiny model, vLLM on CPU and molt-proxy, all local
"""

from __future__ import annotations

from pathlib import Path

import dspy
import httpx
from molt_stack import WEATHER, print_record, running_proxy, tiny_model

from integrations.dspy_lm import lm
from integrations.session import molt_session

RUN = Path("runs/dspy")
QUESTION = "What is the weather in Paris?"


def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return WEATHER.get(city, "Unknown city.")


def run_agent(model: dspy.LM) -> dspy.Prediction:
    """ReAct over `get_weather`: tool steps until it calls `finish`, then the answer."""
    react = dspy.ReAct("question -> answer", tools=[get_weather])
    with dspy.context(lm=model):
        prediction = react(question=QUESTION)
    print(f"question: {QUESTION}\nanswer: {prediction.answer}")
    return prediction


def main() -> None:
    RUN.mkdir(parents=True, exist_ok=True)
    with running_proxy(tiny_model(), RUN) as proxy_url:
        with molt_session(proxy_url, group_id="weather") as session:
            prediction = run_agent(lm(session, model="tiny-qwen3", seed=7, max_tokens=200))
            reward = session.reward(float("22 C" in prediction.answer), info={"agent": "dspy"})
        print_record(reward, httpx.get(f"{proxy_url}/v1/trajectories").json()["data"])


if __name__ == "__main__":
    main()
