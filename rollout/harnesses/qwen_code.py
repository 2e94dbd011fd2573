"""Qwen Code (npm `@qwen-code/qwen-code`), `qwen` headless, as a harness.

`scripts/setup.sh` installs the pinned CLI (`VERSION`) under `.tools/` with the other CLIs (it
asks for Node 22 and runs on Node 20 here).

Measured against the proxy (0.24.4): the `openai` SDK, `POST /v1/chat/completions` streamed
(`stream_options.include_usage`) with 14 tools and `max_tokens` where set, no sampling fields;
about 17k tokens of prompt on the first turn (a 27k-character system prompt, then a user
message of parts: the skills list and today's date as `<system-reminder>`s, then the prompt).
Besides the episode, after every answer it asks the same model, with the conversation and 6
tools, to extract memories for later sessions ("managed auto-memory"): the settings turn that
off here (and its consolidation, "dream"), which leaves one request per turn. Past a share of
the context it compresses the history (a request of its own, and a new segment after it).

Offline: `~/.qwen/settings.json` in the private home picks the OpenAI-compatible provider and
the served model, turns off usage statistics, telemetry and update checks; the base URL and the
session key come in `OPENAI_BASE_URL` and `OPENAI_API_KEY`. The prompt goes in as `--prompt=…`
(exact; a positional prompt that starts with `-` would be read as a flag). `--output-format
json` prints its events as one JSON array; the answer is the `result` event's. The adapter names
the session (`--session-id`), so its chat record is known before it starts:
`~/.qwen/projects/<workspace>/chats/<session>.jsonl`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollout.harness import Attempt, CommandHarness
from rollout.harnesses.cli import TOOLS, find_cli, newest
from rollout.harnesses.served import served_model

VERSION = "0.24.4"


def installed() -> bool:
    return (TOOLS / "qwen").exists()


def session_id(attempt: Attempt) -> str:
    """Qwen Code's session id for the attempt (a UUID, as it requires), named by its molt session."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, attempt.session.base_url))


class QwenCode(CommandHarness):
    """`args`: more flags for `qwen` (`--harness-arg`, e.g. `--max-session-turns 20`);
    `max_tokens`: each request's (`QWEN_CODE_MAX_OUTPUT_TOKENS`; None: Qwen Code's own); `cli`:
    another `qwen` than the pinned one under `.tools/`. Every tool call is approved
    (`--approval-mode yolo`): the workspace is the attempt's own."""

    name = "qwen-code"

    def __init__(
        self, args: Sequence[str] = (), *, max_tokens: int | None = None, cli: str | Path | None = None
    ) -> None:
        self.cli = find_cli("qwen", cli)
        self.args, self.max_tokens = list(args), max_tokens

    def prepare(self, attempt: Attempt) -> None:
        """`~/.qwen/settings.json`: the provider, the served model, nothing that calls out, no
        memory extraction."""
        settings = {
            "security": {"auth": {"selectedType": "openai"}},
            "model": {"name": served_model(attempt.session).name},
            "general": {"enableAutoUpdate": False},
            "privacy": {"usageStatisticsEnabled": False},
            "telemetry": {"enabled": False},
            "memory": {"enableManagedAutoMemory": False, "enableManagedAutoDream": False},
        }
        folder = attempt.home / ".qwen"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "settings.json").write_text(json.dumps(settings, indent=1))

    def command(self, attempt: Attempt) -> list[str]:
        session = ["--session-id", session_id(attempt)]
        flags = ["--approval-mode", "yolo", "--output-format", "json", *session, *self.args]
        return [str(self.cli), *flags, f"--prompt={attempt.task.prompt}"]

    def env(self, attempt: Attempt) -> dict[str, str]:
        env = super().env(attempt) | {
            "OPENAI_BASE_URL": attempt.session.base_url,
            "OPENAI_API_KEY": attempt.session.api_key,
            "QWEN_CODE_SUPPRESS_YOLO_WARNING": "1",
        }
        if self.max_tokens is not None:
            env["QWEN_CODE_MAX_OUTPUT_TOKENS"] = str(self.max_tokens)
        return env

    def transcript(self, attempt: Attempt, stdout: str) -> str:
        """The `result` event's text; nothing where it printed no whole array (it was killed)."""
        try:
            events = json.loads(stdout)
        except json.JSONDecodeError:
            return ""
        results = [e.get("result") or "" for e in events if e.get("type") == "result"]
        return results[-1] if results else ""

    def extra(self, attempt: Attempt) -> dict[str, Any]:
        """Its chat record (None where it wrote none) and its session id."""
        chat = newest(attempt.home / ".qwen" / "projects", f"*/chats/{session_id(attempt)}.jsonl")
        return {"transcript_file": chat, "session": session_id(attempt)}
