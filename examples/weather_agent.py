"""An ordinary tool-using agent, written against the `openai` SDK and nothing else.

It knows nothing about molt-proxy: point `base_url` at the proxy and every turn it takes is
recorded token-exactly. Run it against any OpenAI-compatible server:

    python examples/weather_agent.py --base-url http://127.0.0.1:8000/s/my-episode/v1
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from openai import OpenAI

WEATHER = {"Paris": "Sunny, 22 C.", "London": "Rainy, 14 C.", "Tokyo": "Cloudy, 18 C."}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "The city name."}},
                "required": ["city"],
            },
        },
    }
]
QUESTIONS = ["What is the weather in Paris and London?", "And Tokyo?", "Thanks!"]


def get_weather(city: str) -> str:
    return WEATHER.get(city, "Unknown city.")


def run_agent(client: OpenAI, model: str, max_steps: int = 10) -> list[dict[str, Any]]:
    """Ask each question; answer the model's tool calls until it replies in text."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a weather assistant."}]
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        for _ in range(max_steps):
            reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, seed=7)
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                print(f"user: {question}\nassistant: {message.content}")
                break
            for call in message.tool_calls:
                result = get_weather(**json.loads(call.function.arguments))
                print(f"  tool {call.function.name}({call.function.arguments}) -> {result}")
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return messages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", default="default")
    args = parser.parse_args()
    run_agent(OpenAI(base_url=args.base_url, api_key="unused"), args.model)


if __name__ == "__main__":
    main()
