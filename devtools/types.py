"""What a script is: the conversations the tiny models learn, and the reply format of each.

Imports nothing from `devtools`, so the scripts, the captures of the harness CLIs and the
teaching all share it without importing one another (`devtools.scripts`).
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict

Family = Literal["hermes", "llama3_json"]
"""vLLM's `--tool-call-parser` name, which also fixes the reply format the model writes."""


class Conversation(TypedDict):
    """One scripted chat: every assistant message in it is a reply the model must learn."""

    family: Family
    tools: list[dict[str, Any]] | None
    messages: list[dict[str, Any]]
    vary: NotRequired[dict[str, list[str]]]
    """Text in the messages and tools that differs from run to run (a date, a folder), with what
    teaching shows in its place: on teaching day k, its k-th value (cyclically)."""
