"""OpenCode (npm `opencode-ai`), `opencode run`, as a harness.

`scripts/setup.sh` installs the pinned CLI (`VERSION`) under `.tools/` with the other CLIs.

Measured against the proxy (1.18.33): the AI SDK's OpenAI-compatible provider, so
`POST /v1/chat/completions` streamed (`stream_options.include_usage`), with 10 tools (`bash`,
`edit`, `glob`, `grep`, `read`, `skill`, `task`, `todowrite`, `webfetch`, `write`),
`tool_choice: "auto"`, `max_tokens` = the model's output limit, no sampling fields; about 7k
tokens of prompt on the first turn. Besides the episode it asks the same model for the
session's title (no tools, system "You are a title generator"): the adapter names the session
(`--title`), which leaves that request out. Past the context limit less the output limit, it
summarizes the conversation (a request of its own, and a new segment after it).

Offline: the provider is the one config file in the private home
(`~/.config/opencode/opencode.json`: the session's base URL and key, the served model with
its context); `OPENCODE_DISABLE_MODELS_FETCH` keeps it from downloading the models.dev
catalog, `OPENCODE_DISABLE_AUTOUPDATE`, `…_DEFAULT_PLUGINS`, `…_LSP_DOWNLOAD` and `…_SHARE`
from the rest; it still installs `@opencode-ai/plugin` into its config folder in the
background at every start, which `offline=true` in the home's `.npmrc` turns into a warning
in its log instead of a download. The prompt goes in on stdin: `opencode run` quotes a
message given as arguments (`"…"`) when it holds a space. `--format json` prints its events
(JSON lines); the answer is the text of its last step. Its session (every message and part; the
only one in the attempt's home) is in `~/.local/share/opencode/opencode.db` (SQLite), which
`opencode export` prints.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollout.harness import Attempt, CommandHarness
from rollout.harnesses.cli import TOOLS, find_cli
from rollout.harnesses.served import served_model

VERSION = "1.18.33"
PROVIDER = "molt"
OFFLINE = {
    "OPENCODE_DISABLE_MODELS_FETCH": "true",
    "OPENCODE_DISABLE_AUTOUPDATE": "true",
    "OPENCODE_DISABLE_DEFAULT_PLUGINS": "true",
    "OPENCODE_DISABLE_LSP_DOWNLOAD": "true",
    "OPENCODE_DISABLE_SHARE": "true",
}


def installed() -> bool:
    return (TOOLS / "opencode").exists()


class OpenCode(CommandHarness):
    """`args`: more flags for `opencode run` (`--harness-arg`, e.g. `--agent plan`);
    `max_tokens`: the model's output limit, each request's `max_tokens` and what OpenCode keeps
    free of the context before it summarizes (it needs one: its default, 32,000, would leave a
    32k context almost nothing); `cli`: another `opencode` than the pinned one under `.tools/`.
    Every permission is granted (`--auto`): the workspace is the attempt's own."""

    name = "opencode"

    def __init__(
        self, args: Sequence[str] = (), *, max_tokens: int = 4096, cli: str | Path | None = None
    ) -> None:
        self.cli = find_cli("opencode", cli)
        self.args, self.max_tokens = list(args), max_tokens

    def prepare(self, attempt: Attempt) -> None:
        """The provider (`~/.config/opencode/opencode.json`), `.npmrc` and the prompt's file."""
        served = served_model(attempt.session)
        limit = {"context": served.max_model_len or 2 * self.max_tokens, "output": self.max_tokens}
        config = {
            "model": f"{PROVIDER}/{served.name}",
            "autoupdate": False,
            "share": "disabled",
            "provider": {
                PROVIDER: {
                    "npm": "@ai-sdk/openai-compatible",
                    "name": "molt-proxy",
                    "options": {"baseURL": attempt.session.base_url, "apiKey": attempt.session.api_key},
                    "models": {served.name: {"name": served.name, "limit": limit}},
                }
            },
        }
        folder = attempt.home / ".config" / "opencode"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "opencode.json").write_text(json.dumps(config, indent=1))
        (attempt.home / ".npmrc").write_text("offline=true\n")
        _prompt(attempt).write_text(attempt.task.prompt)

    def command(self, attempt: Attempt) -> list[str]:
        title = f"{attempt.task.id} #{attempt.index}"
        run = [str(self.cli), "run", "--title", title, "--format", "json", "--auto", *self.args]
        return ["/bin/sh", "-c", 'exec "$@" < "$0"', str(_prompt(attempt)), *run]

    def env(self, attempt: Attempt) -> dict[str, str]:
        return super().env(attempt) | OFFLINE

    def transcript(self, attempt: Attempt, stdout: str) -> str:
        """The text parts of its last step."""
        texts: list[str] = []
        for event in _events(stdout):
            if event.get("type") == "step_start":
                texts = []
            elif event.get("type") == "text":
                texts.append(event["part"]["text"])
        return "".join(texts)

    def extra(self, attempt: Attempt) -> dict[str, Any]:
        """Its store (None where it made none): the attempt's home holds this one session."""
        store = attempt.home / ".local" / "share" / "opencode" / "opencode.db"
        return {"transcript_file": str(store) if store.exists() else None}


def _prompt(attempt: Attempt) -> Path:
    return attempt.home / "prompt.txt"


def _events(stdout: str) -> list[dict[str, Any]]:
    """Its JSON lines; a line cut off by a kill is left out."""
    events = []
    for line in stdout.splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events
