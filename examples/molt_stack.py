"""What the integration examples share: the tiny Qwen3 model and a running molt-proxy.

Each example builds the tiny model that knows the scripted weather episode (once, under its
run folder), starts `molt-proxy serve` (which starts vLLM on CPU) in its own process group,
and stops both when the agent is done, exactly as `quickstart.py` does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from molt_proxy.launcher import free_port, wait_healthy
from molt_proxy.tinymodel import WEATHER_TOOL, build_tiny_model, teach_tiny_model, weather_episode

# The agents' side of the script the tiny model learned (`weather_episode("hermes")`):
# they must say exactly this for the model to reply as taught.
SYSTEM_PROMPT = "You are a weather assistant."
QUESTIONS = ["What is the weather in Paris and London?", "And Tokyo?", "Thanks!"]
WEATHER = {"Paris": "Sunny, 22 C.", "London": "Rainy, 14 C.", "Tokyo": "Cloudy, 18 C."}


def get_weather(city: str) -> str:
    """The scripted tool: the results the model saw while it was taught."""
    return WEATHER.get(city, "Unknown city.")


# The OpenAI Agents SDK sends every function tool with `"strict": <bool>` beside its
# parameters; Qwen3's template prints the tool as sent (vLLM's own server prints it too), so
# its prompt differs from the script's by those bytes, and a model that knows only its script
# loses it. The Agents SDK example therefore gets a tiny model taught the script as the SDK
# sends it; a real model needs nothing of the kind.
AGENTS_SDK_WEATHER_TOOL = {"type": "function", "function": {**WEATHER_TOOL["function"], "strict": False}}


def build_agents_sdk_model(out: Path) -> Path:
    """A tiny Qwen3 model taught `weather_episode("hermes")` with the SDK's tool spelling."""
    build_tiny_model(out, "qwen3", teach=False)
    generation_config = (out / "generation_config.json").read_text()  # neutral sampling defaults
    teach_tiny_model(out, [{**weather_episode("hermes"), "tools": [AGENTS_SDK_WEATHER_TOOL]}])
    (out / "generation_config.json").write_text(generation_config)  # saving the model rewrote it
    return out


def tiny_model(
    model: Path = Path("runs/quickstart/tiny-qwen3"), build: Callable[[Path], Path] | None = None
) -> Path:
    """The tiny model at `model` (by default the one `quickstart.py` builds), built on first
    use (about a minute) with `build` (by default the weather script, `DEFAULT_SCRIPTS`)."""
    if not (model / "model.safetensors").exists():
        print("building a tiny Qwen3 model that knows the weather script ...")
        (build or (lambda out: build_tiny_model(out, "qwen3")))(model)
    return model


@contextmanager
def running_proxy(model: Path, run: Path) -> Iterator[str]:
    """`molt-proxy serve` for `model` with a fresh store under `run`; yields its URL."""
    db = run / "molt-proxy.db"
    for stale in run.glob("molt-proxy.db*"):
        stale.unlink()
    port = free_port()
    print("starting vLLM (CPU) and molt-proxy ...")
    proxy = subprocess.Popen(
        [sys.executable, "-m", "molt_proxy", "serve", "--model", str(model), "--port", str(port),
         "--db", str(db), "--tool-call-parser", "hermes", "--max-model-len", "2048"],
        start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proxy, 600, what="molt-proxy")
        yield url
    finally:
        # SIGINT, not SIGTERM: uvicorn re-raises the signal it caught once it has shut down,
        # and an unhandled SIGTERM would then end `serve` before it stops its vLLM server;
        # SIGINT comes back as KeyboardInterrupt, and `serve` stops vLLM on its way out.
        os.killpg(proxy.pid, signal.SIGINT)
        proxy.wait(timeout=60)


def print_record(reward: dict, trajectories: list[dict]) -> None:
    """One line per recorded trajectory of the rewarded session."""
    for trajectory in trajectories:
        print(
            f"recorded trajectory seq={trajectory['seq']} segment={trajectory['segment']}: "
            f"{len(trajectory['turns'])} turns, {len(trajectory['token_ids'])} tokens "
            f"({sum(trajectory['loss_mask'])} sampled), reward {trajectory['reward']}"
        )
    print(f"segments in the episode: {len(reward['trajectories'])}")
