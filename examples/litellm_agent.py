"""The weather agent written against LiteLLM's `completion`, trained through molt-proxy: its
calls get `litellm_params(session)`, LiteLLM's `openai/` provider pointed at the session.

    python examples/litellm_agent.py         # tiny model, vLLM on CPU and molt-proxy, all local
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import httpx
from molt_stack import QUESTIONS, SYSTEM_PROMPT, get_weather, print_record, running_proxy, tiny_model

from devtools import WEATHER_TOOL
from integrations.litellm_params import litellm_params
from integrations.session import molt_session

RUN = Path("runs/litellm")


def run_agent(params: dict[str, str], max_steps: int = 10) -> list[dict[str, Any]]:
    """Ask each question; answer the model's tool calls until it replies in text."""
    # LiteLLM fetches its model price list from the internet when imported (and retries for
    # seconds offline); a proxy needs no prices.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT}]
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        for _ in range(max_steps):
            reply = litellm.completion(
                **params, messages=messages, tools=[WEATHER_TOOL], seed=7, max_tokens=200
            )
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                print(f"user: {question}\nassistant: {message.content}")
                break
            for call in message.tool_calls:
                result = get_weather(**json.loads(call.function.arguments))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return messages


def main() -> None:
    RUN.mkdir(parents=True, exist_ok=True)
    with running_proxy(tiny_model(), RUN) as proxy_url:
        with molt_session(proxy_url, group_id="weather") as session:
            run_agent(litellm_params(session, model="tiny-qwen3"))
            reward = session.reward(1.0, info={"agent": "litellm"})
        print_record(reward, httpx.get(f"{proxy_url}/v1/trajectories").json()["data"])


if __name__ == "__main__":
    main()
