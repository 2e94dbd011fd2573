"""The harness adapters, by the name `--harness` takes; anything else is a Python agent,
`module:function` or `path/to/file.py:function` (`python.py`)."""

from __future__ import annotations

from rollout.harness import Harness

HARNESSES: dict[str, str] = {
    "mini-swe-agent": "rollout.harnesses.mini_swe_agent:MiniSweAgent",
    "opencode": "rollout.harnesses.opencode:OpenCode",
    "qwen-code": "rollout.harnesses.qwen_code:QwenCode",
}
"""name → `module:Class` of its adapter, imported only when chosen."""


def harness(spec: str) -> Harness:
    """The adapter `spec` names: a harness of `HARNESSES`, or a Python agent."""
    raise NotImplementedError
