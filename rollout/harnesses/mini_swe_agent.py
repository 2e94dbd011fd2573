"""mini-swe-agent (PyPI `mini-swe-agent`), its `mini` command, as a harness.

`scripts/setup.sh` installs the pinned version (`VERSION`) in a virtual environment of its own
under `.tools/mini-swe-agent/`: it brings litellm, which the project's own environment pins
for its tests, so the two never share one.

Measured against the proxy (2.4.6): litellm's `completion` to `POST /v1/chat/completions`,
not streamed, with one tool (`bash`) and no sampling fields but `max_tokens` where set; the
full history each turn. A reply without a tool call is a format error: mini-swe-agent leaves
the reply out of its history and appends a user message that says so, so the next request
does not continue the last one, and the proxy opens a new segment for it (exact, but one
segment per such turn); after three in a row it stops (`RepeatedFormatError`). A command's
output goes back as a tool message; the run ends when a command prints
`COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT` first, and what follows is its submission. It sends
nothing besides the episode.

One config file in the attempt's home holds the task, the model (litellm's `openai/<name>`
at the session's base URL, with the session key) and the run's limits; with it, `mini` asks
nothing (`MSWEA_CONFIGURED`), does not prompt between steps (`yolo`) or at the end
(`--exit-immediately`), and reads litellm's cost table from the package instead of the
network (`LITELLM_LOCAL_MODEL_COST_MAP`; a served model has no cost, `ignore_errors`). Its
trajectory (every message, each with the raw response) is `<home>/mini-swe-agent/trajectory.json`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollout.harness import Attempt, CommandHarness
from rollout.harnesses.cli import find_cli
from rollout.harnesses.served import served_model

VERSION = "2.4.6"
MINI = Path(__file__).resolve().parents[2] / ".tools" / "mini-swe-agent" / "bin" / "mini"
"""Where `scripts/setup.sh` installs it (a virtual environment of its own)."""


def installed() -> bool:
    return MINI.exists()


class MiniSweAgent(CommandHarness):
    """`args`: more flags for `mini` (`--harness-arg`; e.g. `-c agent.step_limit=30`, which
    overrides the adapter's config); `max_tokens`: each request's (None sends none: the proxy then
    allows what the context leaves); `step_limit`: model calls before it stops (0: none but the
    attempt's timeout); `cli`: another `mini` than the pinned one under `.tools/`."""

    name = "mini-swe-agent"

    def __init__(
        self,
        args: Sequence[str] = (),
        *,
        max_tokens: int | None = None,
        step_limit: int = 0,
        cli: str | Path | None = None,
    ) -> None:
        self.cli = MINI if cli is None and installed() else find_cli("mini", cli)
        self.args, self.max_tokens, self.step_limit = list(args), max_tokens, step_limit

    def trajectory(self, attempt: Attempt) -> Path:
        return attempt.home / "mini-swe-agent" / "trajectory.json"

    def config(self, attempt: Attempt) -> Path:
        return attempt.home / "mini-swe-agent" / "molt.yaml"

    def prepare(self, attempt: Attempt) -> None:
        """The run's config (JSON, which is YAML): the task, the model, the limits."""
        kwargs: dict[str, Any] = {"api_base": attempt.session.base_url, "api_key": attempt.session.api_key}
        if self.max_tokens is not None:
            kwargs["max_tokens"] = self.max_tokens
        config = {
            "run": {"task": attempt.task.prompt},
            "agent": {"step_limit": self.step_limit, "cost_limit": 0},
            "model": {
                "model_name": f"openai/{served_model(attempt.session).name}",
                "model_kwargs": kwargs,
                "cost_tracking": "ignore_errors",
            },
        }
        path = self.config(attempt)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(config, indent=1))

    def command(self, attempt: Attempt) -> list[str]:
        # `mini.yaml`: the package's own config (prompts, templates), then the attempt's on top.
        configs = ["-c", "mini.yaml", "-c", str(self.config(attempt))]
        output = ["-o", str(self.trajectory(attempt))]
        return [str(self.cli), "-y", "--exit-immediately", *output, *configs, *self.args]

    def env(self, attempt: Attempt) -> dict[str, str]:
        return super().env(attempt) | {
            "MSWEA_CONFIGURED": "true",
            "MSWEA_SILENT_STARTUP": "1",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        }

    def transcript(self, attempt: Attempt, stdout: str) -> str:
        """The submission; without one (it stopped for a limit or an error), its last reply in
        its history."""
        saved = _saved(self.trajectory(attempt))
        if saved["info"].get("submission"):
            return saved["info"]["submission"]
        replies = [m.get("content") or "" for m in saved["messages"] if m.get("role") == "assistant"]
        return replies[-1] if replies else ""

    def extra(self, attempt: Attempt) -> dict[str, Any]:
        """Its trajectory file (None where it wrote none) and why it stopped (`Submitted`,
        `LimitsExceeded`, `RepeatedFormatError`, an exception's name)."""
        trajectory = self.trajectory(attempt)
        return {
            "transcript_file": str(trajectory) if trajectory.exists() else None,
            "exit_status": _saved(trajectory)["info"].get("exit_status"),
        }


def _saved(trajectory: Path) -> dict[str, Any]:
    """The trajectory file as `mini` last wrote it (it rewrites it after every step); empty
    where there is none whole (killed before its first step ended, or while writing it)."""
    try:
        return json.loads(trajectory.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {"info": {}, "messages": []}
