"""The `openai`-SDK weather agent (`weather_agent.py`, unchanged) trained through one line:
`with molt_session(proxy_url, group_id=...) as s:` hands it a client bound to a new session,
and `s.reward(...)` closes the episode.

    python examples/openai_session.py        # tiny model, vLLM on CPU and molt-proxy, all local
"""

from __future__ import annotations

from pathlib import Path

import httpx
from molt_stack import print_record, running_proxy, tiny_model
from weather_agent import run_agent

from integrations.session import molt_session

RUN = Path("runs/openai_session")


def main() -> None:
    RUN.mkdir(parents=True, exist_ok=True)
    with running_proxy(tiny_model(), RUN) as proxy_url:
        with molt_session(proxy_url, group_id="weather") as session:
            print(f"\nsession {session.session_id}: the agent's base_url is {session.base_url}\n")
            run_agent(session.client, model="tiny-qwen3")
            reward = session.reward(1.0, info={"agent": "openai"})
        print_record(reward, httpx.get(f"{proxy_url}/v1/trajectories").json()["data"])


if __name__ == "__main__":
    main()
