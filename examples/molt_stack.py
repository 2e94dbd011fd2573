"""What the integration examples share: the tiny Qwen3 model and a running molt-proxy.

Each example builds the tiny model that knows its agent's script (once, under `runs/`), starts
`molt-proxy serve` (which starts vLLM on CPU) in its own process group, and stops both when the
agent is done, as `quickstart.py` does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from devtools import build_tiny_model
from devtools.tinymodel import Harness
from molt_proxy.launcher import ProxyServer

# The agents' side of the script the tiny model learned (`weather_episode("hermes")`):
# they must say exactly this for the model to reply as taught.
SYSTEM_PROMPT = "You are a weather assistant."
QUESTIONS = ["What is the weather in Paris and London?", "And Tokyo?", "Thanks!"]
WEATHER = {"Paris": "Sunny, 22 C.", "London": "Rainy, 14 C.", "Tokyo": "Cloudy, 18 C."}


def get_weather(city: str) -> str:
    """The scripted tool: the results the model saw while it was taught."""
    return WEATHER.get(city, "Unknown city.")


def tiny_model(model: Path = Path("runs/examples/tiny-qwen3"), harness: Harness | None = None) -> Path:
    """The tiny model at `model`, built on first use (cached under `~/.cache/molt-proxy`): it
    learns every agent library's script (`DEFAULT_SCRIPTS`: minutes), or, for a `harness`,
    that harness's episodes alone (Claude Code's, Codex's)."""
    if not (model / "model.safetensors").exists():
        learns = f"{harness}'s episodes" if harness else "every agent's script (minutes the first time)"
        print(f"building a tiny Qwen3 model and teaching it {learns} ...")
        if harness:
            build_tiny_model(model, "qwen3", harnesses=[harness], scripts=[])
        else:
            build_tiny_model(model, "qwen3", harnesses=())
    return model


@contextmanager
def running_proxy(model: Path, run: Path, max_model_len: int = 2048) -> Iterator[str]:
    """`molt-proxy serve` for `model` with a fresh store under `run`; yields its URL."""
    db = run / "molt-proxy.db"
    for stale in run.glob("molt-proxy.db*"):
        stale.unlink()
    print("starting vLLM (CPU) and molt-proxy ...")
    args = ["--tool-call-parser", "hermes", "--max-model-len", str(max_model_len)]
    proxy = ProxyServer(model, db=db, args=args)
    try:
        yield proxy.start(timeout_s=600).url
    finally:
        proxy.stop()  # SIGTERM: `serve` stops the vLLM server it launched, then exits


def print_record(reward: dict, trajectories: list[dict]) -> None:
    """One line per recorded trajectory of the rewarded session."""
    for trajectory in trajectories:
        print(
            f"recorded trajectory seq={trajectory['seq']} segment={trajectory['segment']}: "
            f"{len(trajectory['turns'])} turns, {len(trajectory['token_ids'])} tokens "
            f"({sum(trajectory['loss_mask'])} sampled), reward {trajectory['reward']}"
        )
    print(f"segments in the episode: {len(reward['trajectories'])}")
