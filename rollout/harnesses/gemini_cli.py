"""Gemini CLI (npm `@google/gemini-cli`), `gemini` headless, as a harness: `--harness gemini-cli`.

`scripts/setup.sh` installs the pinned CLI (`VERSION`) under `.tools/` with the other CLIs.

- **The session.** Gemini CLI speaks only Google's Gemini API. `GOOGLE_GEMINI_BASE_URL` is
  `attempt.proxy_root` (`…/s/<id>`; its SDK appends `/v1beta/models/<model>:streamGenerateContent`),
  `GEMINI_API_KEY` the session key (sent as `x-goog-api-key`). The model is the name the proxy
  serves (it goes into the URL).
- **Offline.** `~/.gemini/settings.json` in the private home picks the API-key auth (no login
  dialog), turns off usage statistics, telemetry, update checks, IDE integration and folder
  trust (a fresh workspace would otherwise be untrusted: headless, it then refuses to run), and
  the side calls: the next-speaker check and the LLM loop detection (after 30 turns), which
  would ask another model name (`gemini-3-flash-preview`) than the one served.
  `GEMINI_CLI_NO_RELAUNCH` keeps it one process (it relaunches itself with a bigger heap).
- **The run.** In the workspace: `gemini --approval-mode yolo --output-format json --session-id
  <uuid> [ARGS] --prompt=PROMPT` (every tool call approved: the workspace is the attempt's own;
  `--prompt=…` keeps a prompt that starts with `-` a prompt). It prints one JSON object; the
  answer is its `response`.
- **The transcript.** The chat record, `~/.gemini/tmp/<workspace's name>/chats/session-<time>-<the
  session id's first 8 characters>.jsonl`, goes into `Outcome.extra["transcript_file"]`.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollout.harness import Attempt, CommandHarness
from rollout.harnesses.cli import TOOLS, find_cli, newest
from rollout.harnesses.served import served_model

VERSION = "0.61.0"


def installed() -> bool:
    return (TOOLS / "gemini").exists()


def write_settings(home: Path, model: str) -> None:
    """`home/.gemini/settings.json`: API-key auth, `model`, nothing that calls out, no side calls."""
    settings = {
        "security": {"auth": {"selectedType": "gemini-api-key"}, "folderTrust": {"enabled": False}},
        "general": {"enableAutoUpdate": False, "enableAutoUpdateNotification": False},
        "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False},
        "ide": {"enabled": False},
        "model": {"name": model, "skipNextSpeakerCheck": True, "disableLoopDetection": True},
    }
    (home / ".gemini").mkdir(parents=True, exist_ok=True)
    (home / ".gemini" / "settings.json").write_text(json.dumps(settings, indent=1))


def gemini_env(home: Path, base_url: str, api_key: str) -> dict[str, str]:
    """The environment Gemini CLI runs in: `home` as `HOME`, the Gemini API at `base_url` (the
    proxy's root or a session's `…/s/<id>`), the key, one process, a fixed time zone and shell."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "GOOGLE_GEMINI_BASE_URL": base_url,
        "GEMINI_API_KEY": api_key,
        "GEMINI_CLI_NO_RELAUNCH": "true",
        "SHELL": "/bin/bash",
        "TZ": "UTC",
    }


def gemini_command(cli: Path, prompt: str, session: str, args: Sequence[str] = ()) -> list[str]:
    flags = ["--approval-mode", "yolo", "--output-format", "json", "--session-id", session]
    return [str(cli), *flags, *args, f"--prompt={prompt}"]


def response(stdout: str) -> str:
    """The answer in what `--output-format json` printed; nothing where it printed no object."""
    try:
        printed = json.loads(stdout)
    except json.JSONDecodeError:
        return ""
    return (printed.get("response") or "") if isinstance(printed, dict) else ""


def session_id(attempt: Attempt) -> str:
    """Gemini CLI's session id for the attempt (a UUID, as it requires), named by its molt session."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, attempt.session.base_url))


class GeminiCli(CommandHarness):
    """`args`: more flags for `gemini` (`--harness-arg`); `model`: the model name (None: the one
    the proxy serves); `cli`: another `gemini` than the pinned one under `.tools/`."""

    name = "gemini-cli"

    def __init__(self, args: Sequence[str] = (), *, model: str | None = None, cli: str | Path | None = None):
        self.cli = find_cli("gemini", cli)
        self.args, self.model = list(args), model

    def prepare(self, attempt: Attempt) -> None:
        write_settings(attempt.home, self.model or attempt.model or served_model(attempt.session).name)

    def command(self, attempt: Attempt) -> list[str]:
        return gemini_command(self.cli, attempt.task.prompt, session_id(attempt), self.args)

    def env(self, attempt: Attempt) -> dict[str, str]:
        return gemini_env(attempt.home, attempt.proxy_root, attempt.session.api_key)

    def transcript(self, attempt: Attempt, stdout: str) -> str:
        return response(stdout)

    def extra(self, attempt: Attempt) -> dict[str, Any]:
        chats = attempt.home / ".gemini" / "tmp"
        found = newest(chats, f"*/chats/session-*-{session_id(attempt)[:8]}.jsonl")
        return {"transcript_file": found, "session": session_id(attempt)}
