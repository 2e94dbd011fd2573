"""Development tooling, apart from the runtime packages (`molt_proxy`, `trainer`): the tiny
models that tests, examples and benchmarks run on, the scripts they learn, and the tasks the
examples reward. Imports torch and transformers only inside the functions that need them.

`python -m devtools build-tiny-model` builds a tiny model from the command line (`__main__.py`).
Nothing in `molt_proxy`, `trainer` or `rollout` imports this package.
"""

from devtools.digits import PROMPTS, digit_share
from devtools.scripts import (
    AGENTS_SDK_WEATHER_TOOL,
    DEFAULT_SCRIPTS,
    WEATHER_TOOL,
    Conversation,
    Family,
    as_echoed,
    render_reply,
    thinking_episode,
    weather_episode,
)
from devtools.teaching import teach_tiny_model
from devtools.tinymodel import build_tiny_model
from devtools.tokenizers import Arch, tokenizer_source, tokenizers_root

__all__ = [
    "AGENTS_SDK_WEATHER_TOOL",
    "DEFAULT_SCRIPTS",
    "PROMPTS",
    "WEATHER_TOOL",
    "Arch",
    "Conversation",
    "Family",
    "as_echoed",
    "build_tiny_model",
    "digit_share",
    "render_reply",
    "teach_tiny_model",
    "thinking_episode",
    "tokenizer_source",
    "tokenizers_root",
    "weather_episode",
]
