"""A LangGraph ReAct agent with a weather tool, trained through molt-proxy: the only change
to the agent is its model, `chat_model(session)`, a `ChatOpenAI` bound to the session.

    python examples/langgraph_agent.py       # tiny model, vLLM on CPU and molt-proxy, all local
"""

from __future__ import annotations

import warnings
from pathlib import Path

import httpx
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import BaseMessage
from langchain_core.tools import StructuredTool
from langgraph.prebuilt import create_react_agent
from molt_stack import QUESTIONS, SYSTEM_PROMPT, get_weather, print_record, running_proxy, tiny_model

from devtools import WEATHER_TOOL
from integrations.langchain_chat import chat_model
from integrations.session import molt_session

RUN = Path("runs/langgraph")


def weather_tool() -> StructuredTool:
    """`get_weather` with the script's exact JSON schema. `@tool` would write the same schema
    with its keys in another order; the template prints tools verbatim, and the tiny model
    knows only the prompt of its script (a real model takes `@tool` as it is)."""
    function = WEATHER_TOOL["function"]
    return StructuredTool.from_function(
        get_weather,
        name=function["name"],
        description=function["description"],
        args_schema=function["parameters"],
    )


def run_agent(model: BaseChatModel) -> list[BaseMessage]:
    """Ask each question in one conversation; the graph calls the tool until the model answers."""
    with warnings.catch_warnings():
        # LangGraph 1.x points to `langchain.agents.create_agent`, which needs the `langchain`
        # package; `create_react_agent` is the same loop and ships with `langgraph` itself.
        warnings.simplefilter("ignore", DeprecationWarning)
        agent = create_react_agent(model, [weather_tool()], prompt=SYSTEM_PROMPT)
    messages: list[BaseMessage] = []
    for question in QUESTIONS:
        messages = agent.invoke({"messages": [*messages, {"role": "user", "content": question}]})["messages"]
        print(f"user: {question}\nassistant: {messages[-1].content}")
    return messages


def main() -> None:
    RUN.mkdir(parents=True, exist_ok=True)
    with running_proxy(tiny_model(), RUN) as proxy_url:
        with molt_session(proxy_url, group_id="weather") as session:
            run_agent(chat_model(session, model="tiny-qwen3", seed=7))
            reward = session.reward(1.0, info={"agent": "langgraph"})
        print_record(reward, httpx.get(f"{proxy_url}/v1/trajectories").json()["data"])


if __name__ == "__main__":
    main()
