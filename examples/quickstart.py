"""The whole proxy on one machine, with nothing downloaded: build a tiny model, start vLLM
and molt-proxy, run an unchanged agent through it, reward it, and show its exact record.

    python examples/quickstart.py            # writes everything under runs/quickstart/
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
from openai import OpenAI

sys.path.insert(0, str(Path(__file__).parent))
from weather_agent import run_agent  # noqa: E402

from devtools import build_tiny_model  # noqa: E402
from devtools.scripts import weather_episode  # noqa: E402
from molt_proxy.export import export  # noqa: E402
from molt_proxy.launcher import ProxyServer  # noqa: E402

RUN = Path("runs/quickstart")


def main() -> None:
    RUN.mkdir(parents=True, exist_ok=True)
    model = RUN / "tiny-qwen3"
    if not (model / "model.safetensors").exists():
        print("building a tiny Qwen3 model and teaching it the weather script (about half a minute) ...")
        # Taught this agent's script alone: the tests' model knows every agent's, in minutes.
        build_tiny_model(model, "qwen3", harnesses=(), scripts=[weather_episode("hermes")])
    db = RUN / "molt-proxy.db"
    for stale in [*RUN.glob("molt-proxy.db*"), *RUN.glob("molt-proxy.log")]:
        stale.unlink()
    log = RUN / "molt-proxy.log"  # one line per request: kept out of this script's output
    print(f"starting vLLM (CPU) and molt-proxy (log: {log}) ...")
    flags = ["--tool-call-parser", "hermes", "--max-model-len", "2048"]
    proxy = ProxyServer(model, db=db, args=flags, log_path=log)
    try:
        url = proxy.start(timeout_s=600).url
        session = httpx.post(f"{url}/v1/sessions", json={"group_id": "weather"}).json()
        print(f"\nsession {session['session_id']}: agent base_url = {session['base_url']}\n")
        run_agent(OpenAI(base_url=session["base_url"], api_key="unused"), model="tiny-qwen3")
        reward = httpx.post(f"{url}/v1/rewards", json={"session_id": session["session_id"], "reward": 1.0})
        reward.raise_for_status()
        [trajectory] = httpx.get(f"{url}/v1/trajectories").json()["data"]
        sampled = sum(trajectory["loss_mask"])
        print(
            f"\nrecorded trajectory seq={trajectory['seq']}: {len(trajectory['turns'])} turns, "
            f"{len(trajectory['token_ids'])} tokens ({sampled} sampled by the policy), "
            f"reward {trajectory['reward']}, segments in the episode: {len(reward.json()['trajectories'])}"
        )
    finally:
        proxy.stop()
    out = RUN / "trajectories.jsonl"
    export(db, out, "jsonl")
    print(f"store: {db}\nexport: {out}")


if __name__ == "__main__":
    main()
