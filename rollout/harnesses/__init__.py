"""The harness adapters, by the name `--harness` takes; anything else is a Python agent,
`module:function` or `path/to/file.py:function` (`python.py`)."""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from rollout.harness import Harness

HARNESSES: dict[str, str] = {
    "claude-code": "rollout.harnesses.claude_code:ClaudeCode",
    "codex": "rollout.harnesses.codex:Codex",
    "gemini-cli": "rollout.harnesses.gemini_cli:GeminiCli",
    "mini-swe-agent": "rollout.harnesses.mini_swe_agent:MiniSweAgent",
    "opencode": "rollout.harnesses.opencode:OpenCode",
    "qwen-code": "rollout.harnesses.qwen_code:QwenCode",
}
"""name → `module:Class` of its adapter, imported only when chosen. A CLI adapter's class takes
`args`, the extra flags for its CLI (`--harness-arg`), and options by keyword (`docs/harnesses.md`)."""


class HarnessError(ValueError):
    """A `--harness` that names no adapter and no Python agent."""


def harness(spec: str, args: Sequence[str] = ()) -> Harness:
    """The adapter `spec` names: a harness of `HARNESSES` (`args`: extra flags for its CLI), or
    a Python agent (which takes none)."""
    if spec in HARNESSES:
        module, _, name = HARNESSES[spec].partition(":")
        return getattr(importlib.import_module(module), name)(args)
    if args:
        raise HarnessError(
            f"--harness-arg is for a CLI harness ({', '.join(sorted(HARNESSES))}), not {spec!r}"
        )
    if ":" not in spec:
        known = ", ".join(sorted(HARNESSES)) or "none installed"
        raise HarnessError(
            f"unknown harness {spec!r} (harnesses: {known}); a Python agent is module:function"
            " or path/to/file.py:function"
        )
    from rollout.harnesses.python import PythonAgent

    return PythonAgent(spec)
