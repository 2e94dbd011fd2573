"""Codex CLI (npm `@openai/codex`) as a rollout harness: `--harness codex`.

- **The session.** `$CODEX_HOME/config.toml` (`CODEX_HOME` is `$HOME/.codex`, in the attempt's
  private `HOME`) names one model provider, the Responses API at the attempt's session base URL
  (`…/s/<id>/v1`), whose key Codex reads from `MOLT_API_KEY`: the session key.
- **The run.** `codex exec --sandbox workspace-write --color never [ARGS] -- PROMPT` in the
  workspace. Codex's own sandbox lets the commands it runs write in the workspace (and /tmp)
  only, with no network: a rollout's attempts stay in their workspaces even without
  `--sandbox`. (`Codex(sandbox="danger-full-access")` where that sandbox cannot work, such as
  inside some containers.) Codex refuses to run outside a git repository: a workspace that is
  not one gets an empty repository first (`git init`), so a check can `git status` what the
  harness changed. The config turns off what calls out (update checks, analytics, web search)
  and what adds tools or prompt text (plugins, apps, sub-agents, skills, image tools, the
  environment and permissions messages that name the folder and the date).
- **The transcript.** Its stdout is the final answer (`Outcome.transcript`); the whole session
  is a JSONL file, `$CODEX_HOME/sessions/YYYY/MM/DD/rollout-<time>-<uuid>.jsonl`, whose path goes
  into `Outcome.extra["transcript_file"]`.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollout.harness import Attempt, CommandHarness
from rollout.harnesses.cli import find_cli, newest

KEY_VARIABLE = "MOLT_API_KEY"
"""The variable Codex reads its provider's key from (`env_key`)."""


def write_config(home: Path, base_url: str, model: str | None = None) -> None:
    """`home/.codex/config.toml`: the Responses API at `base_url` (`…/v1`, or `…/s/<session>/v1`)
    as the only provider, nothing that calls out (updates, analytics, web search), and the
    features that add tools or prompt text to every request off; and `home/tmp` (`codex_env`)."""
    (home / ".codex").mkdir(parents=True, exist_ok=True)
    (home / "tmp").mkdir(exist_ok=True)
    (home / ".codex" / "config.toml").write_text(
        (f"model = {json.dumps(model)}\n" if model else "") + 'model_provider = "molt"\n'
        "check_for_update_on_startup = false\n"
        'web_search = "disabled"\n'
        "include_permissions_instructions = false\ninclude_environment_context = false\n"
        "\n[analytics]\nenabled = false\n"
        "\n[features]\n"
        "plugins = false\napps = false\ngoals = false\nimage_generation = false\nview_image = false\n"
        "\n[agents]\nenabled = false\n"
        "\n[skills]\ninclude_instructions = false\n"
        "\n[tools.experimental_request_user_input]\nenabled = false\n"
        "\n[model_providers.molt]\n"
        'name = "molt-proxy"\n'
        f"base_url = {json.dumps(base_url)}\n"
        f'env_key = "{KEY_VARIABLE}"\n'
        'wire_api = "responses"\n'
    )


def codex_env(home: Path, api_key: str) -> dict[str, str]:
    """The environment Codex runs in: `home` as `HOME`, its `CODEX_HOME` (config, sessions) and
    `TMPDIR` in it, the provider's key, and a fixed shell and time zone (both appear in its
    prompt). Codex makes no helper for its sandbox (an alias of itself, which its bubblewrap
    sandbox runs) under the temporary folder, so with a `CODEX_HOME` under /tmp (a pytest or
    `mkdtemp` folder) and a system `bwrap`, every command it runs would fail: its `TMPDIR` is
    the attempt's own instead, which also keeps attempts' temporary files apart."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "CODEX_HOME": str(home / ".codex"),
        "TMPDIR": str(home / "tmp"),
        KEY_VARIABLE: api_key,
        "SHELL": "/bin/bash",
        "TZ": "UTC",
    }


def codex_command(
    cli: Path, prompt: str, *, sandbox: str = "workspace-write", args: Sequence[str] = ()
) -> list[str]:
    """`codex exec …`: the prompt last, after `--`, so a prompt that starts with `-` stays a prompt."""
    return [str(cli), "exec", "--sandbox", sandbox, "--color", "never", *args, "--", prompt]


def git_repository(folder: Path) -> None:
    """Make `folder` a git repository unless it is one (Codex asks for one)."""
    if not (folder / ".git").exists():
        subprocess.run(["git", "init", "-q", str(folder)], check=True, capture_output=True)


class Codex(CommandHarness):
    """`args`: more flags for `codex exec` (`--harness-arg`, e.g. `-c model_reasoning_effort=low`);
    `model`: the model name in its config (None: the one the proxy serves, `Attempt.model`);
    `sandbox`: Codex's sandbox mode for the commands it runs; `cli`: another `codex` than the
    pinned one under `.tools/`."""

    name = "codex"

    def __init__(
        self,
        args: Sequence[str] = (),
        *,
        model: str | None = None,
        sandbox: str = "workspace-write",
        cli: str | Path | None = None,
    ):
        self.cli = find_cli("codex", cli)
        self.args, self.model, self.sandbox = list(args), model, sandbox

    def prepare(self, attempt: Attempt) -> None:
        write_config(attempt.home, attempt.session.base_url, self.model or attempt.model)
        git_repository(attempt.workspace)

    def command(self, attempt: Attempt) -> list[str]:
        return codex_command(self.cli, attempt.task.prompt, sandbox=self.sandbox, args=self.args)

    def env(self, attempt: Attempt) -> dict[str, str]:
        return codex_env(attempt.home, attempt.session.api_key)

    def extra(self, attempt: Attempt) -> dict[str, Any]:
        return {"transcript_file": newest(attempt.home / ".codex" / "sessions", "**/rollout-*.jsonl")}
