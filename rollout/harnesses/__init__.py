"""The harness adapters, by the name `--harness` takes; anything else is a Python agent,
`module:function` or `path/to/file.py:function` (`python.py`)."""

from __future__ import annotations

from rollout.harness import Harness

HARNESSES: dict[str, str] = {
    "claude-code": "rollout.harnesses.claude_code:ClaudeCode",
    "codex": "rollout.harnesses.codex:Codex",
}
"""name → `module:Class` of its adapter, imported only when chosen. A CLI adapter's class takes
`args`, the extra flags for its CLI (`--harness-arg`), and options by keyword (`docs/harnesses.md`)."""


def harness(spec: str) -> Harness:
    """The adapter `spec` names: a harness of `HARNESSES`, or a Python agent."""
    raise NotImplementedError
