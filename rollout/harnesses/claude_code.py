"""Claude Code (npm `@anthropic-ai/claude-code`) as a rollout harness: `--harness claude-code`.

- **The session.** `ANTHROPIC_BASE_URL` is the attempt's session root (`…/s/<id>`: the Anthropic
  SDK appends `/v1/messages`; the path names the session), `ANTHROPIC_API_KEY` its session key.
  Claude Code first probes that URL with `HEAD /s/<id>`, which the proxy answers as it answers
  `/`, touching no session.
- **The run.** `claude -p --allowedTools Bash,Edit,Write,NotebookEdit [--model M] [ARGS] -- PROMPT`
  in the workspace, with the attempt's private `HOME` (settings, memory, history) and nothing
  that calls out: no telemetry, no updates, no non-essential requests (the title it would ask the
  model for; the proxy would keep such a side request out of training anyway). `-p` runs no
  permission prompts: a tool not allowed is refused. Allowed by default: the shell and the file
  editors, which a task in its own workspace needs; the read-only tools (Read, Glob, Grep) need
  no permission; WebFetch and WebSearch stay refused (no network but the proxy). The allowed
  tools do not change what Claude Code sends the model (its 24 tools and system prompt are the
  same), only what it lets the model run.
- **The transcript.** Its stdout is the final answer (`Outcome.transcript`); the whole
  conversation is a JSONL file under `$HOME/.claude/projects/<the workspace's path, every
  character but letters and digits as '-'>/<its session uuid>.jsonl`, whose path goes into
  `Outcome.extra["transcript_file"]`.

Claude Code writes the working directory, the `HOME` it lives in and `--model` into its system
prompt: keep them alike across a run's attempts.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollout.harness import Attempt, CommandHarness
from rollout.harnesses.cli import find_cli, newest

ALLOWED_TOOLS = ("Bash", "Edit", "Write", "NotebookEdit")


def claude_env(base_url: str, home: Path, api_key: str, *, side_requests: bool = False) -> dict[str, str]:
    """The environment Claude Code runs offline in: the proxy at `base_url` as its API, `home`
    as its `HOME`, no telemetry or updates, and (unless `side_requests`) none of its
    non-essential requests, such as the title it asks the model for."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": api_key,
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    if not side_requests:
        env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] = "1"
    return env


def claude_command(
    cli: Path,
    prompt: str,
    *,
    model: str | None = None,
    allowed_tools: Sequence[str] = ALLOWED_TOOLS,
    args: Sequence[str] = (),
) -> list[str]:
    """`claude -p …`: the prompt last, after `--`, so neither a prompt that starts with `-` nor a
    list-taking flag in `args` (`--disallowedTools A B`) can take it for an option."""
    tools = ["--allowedTools", ",".join(allowed_tools)] if allowed_tools else []
    return [str(cli), "-p", *tools, *(["--model", model] if model else []), *args, "--", prompt]


class ClaudeCode(CommandHarness):
    """`args`: more flags for `claude` (`--harness-arg`, e.g. `--bare`, `--max-turns 20`);
    `model`: the `--model` name (None: the one the proxy serves, `Attempt.model`); `cli`: another
    `claude` than the pinned one under `.tools/`."""

    name = "claude-code"

    def __init__(
        self,
        args: Sequence[str] = (),
        *,
        model: str | None = None,
        allowed_tools: Sequence[str] = ALLOWED_TOOLS,
        cli: str | Path | None = None,
    ):
        self.cli = find_cli("claude", cli)
        self.args, self.model, self.allowed_tools = list(args), model, list(allowed_tools)

    def command(self, attempt: Attempt) -> list[str]:
        model = self.model or attempt.model
        return claude_command(
            self.cli, attempt.task.prompt, model=model, allowed_tools=self.allowed_tools, args=self.args
        )

    def env(self, attempt: Attempt) -> dict[str, str]:
        return claude_env(attempt.proxy_root, attempt.home, attempt.session.api_key)

    def extra(self, attempt: Attempt) -> dict[str, Any]:
        return {"transcript_file": newest(attempt.home / ".claude" / "projects", "*/*.jsonl")}
