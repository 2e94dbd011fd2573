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
from pathlib import Path

from rollout.harness import Attempt, CommandHarness, Outcome
from rollout.harnesses.served import served_model

VERSION = "0.24.4"
QWEN = Path(__file__).resolve().parents[2] / ".tools" / "node_modules" / ".bin" / "qwen"
"""Where `scripts/setup.sh` installs it (`npm install --prefix .tools`)."""


def installed() -> bool:
    return QWEN.exists()


def session_id(attempt: Attempt) -> str:
    """Qwen Code's session id for the attempt (a UUID, as it requires), named by its molt session."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, attempt.session.base_url))


class QwenCode(CommandHarness):
    """`qwen` on the task's prompt in the workspace, against the attempt's session, every tool
    call approved (`--approval-mode yolo`: the workspace is the attempt's own)."""

    name = "qwen-code"

    def __init__(self, *, max_tokens: int | None = None) -> None:
        self.max_tokens = max_tokens
        """Each request's `max_tokens` (`QWEN_CODE_MAX_OUTPUT_TOKENS`); None: Qwen Code's own."""

    def settings(self, attempt: Attempt) -> None:
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
        self.settings(attempt)
        return [
            str(QWEN),
            "--approval-mode",
            "yolo",
            "--output-format",
            "json",
            "--session-id",
            session_id(attempt),
            f"--prompt={attempt.task.prompt}",
        ]

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

    def run(self, attempt: Attempt) -> Outcome:
        outcome = super().run(attempt)
        chats = attempt.home / ".qwen" / "projects"
        found = sorted(chats.glob(f"*/chats/{session_id(attempt)}.jsonl"))
        outcome.extra |= {"session": session_id(attempt), "chat": str(found[0]) if found else None}
        return outcome
