"""Gemini CLI, the real one, as a harness for the tiny Qwen3 model: where it is installed, how
to run it offline, and the episode the model learns from what it really sends.

`scripts/setup.sh` installs the pinned CLI (`CLI_VERSION`, from npm) under the checkout's
`.tools/`. Gemini CLI's prompt is Google's text, and it changes between versions, so the
project keeps no copy of it: `gemini_cli_episode()` runs the installed CLI against a stand-in
Gemini API that answers with the script (`capture`), and turns the requests it sent into the
conversation the tiny model is taught: `gemini -p TASK` calls `run_shell_command` with
`COMMAND` (Gemini CLI runs it and sends the output back), then answers `ANSWER`.

`rollout.harnesses.gemini_cli` (which rollouts share) keeps it offline and free of side calls:
two `streamGenerateContent` requests, nothing else. What differs between runs — the date and
the folders in its session context (the `HOME` and working directory `run_gemini` puts under
one `root`), and the process group id it writes into a command's output — is varied while
teaching (`Conversation.vary`).
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import date
from pathlib import Path
from typing import Any

from devtools import recording, variants
from devtools.scripts import Conversation
from rollout.harnesses.cli import TOOLS
from rollout.harnesses.gemini_cli import gemini_command, gemini_env, response, write_settings

CLI_VERSION = "0.61.0"
CLI = TOOLS / "gemini"
"""Where `scripts/setup.sh` installs it (`npm install --prefix .tools`)."""

MODEL = "tiny"
"""The model name: it goes into the URL (`/v1beta/models/tiny:streamGenerateContent`), not the prompt."""
SESSION = "0b0e6c52-7f7c-4d3b-9a0e-6f7d1f4a2c11"
"""Gemini CLI's own session id (`--session-id`): it names its chat record, not the prompt."""
TASK = "Write hi to hi.txt"
COMMAND = "echo hi | tee hi.txt"
"""The `run_shell_command` call the model makes: it writes the file and prints `hi` into the output."""
ANSWER = "File written."
"""Claude Code's (`devtools.claude_code.ANSWER` says why this one)."""


def installed() -> bool:
    """Whether `scripts/setup.sh` installed the CLI."""
    return CLI.exists()


def run_gemini(base_url: str, root: Path) -> subprocess.CompletedProcess[str]:
    """`gemini --approval-mode yolo --output-format json --prompt=TASK` in `root/work`, its
    `HOME` in `root/home`, against the Gemini API at `base_url` (the proxy's root or a session's
    `…/s/<id>`; `rollout.harnesses.gemini_cli`, as a rollout runs it); returns the finished
    process (stdout: one JSON object, its answer in `response`)."""
    write_settings(root / "home", MODEL)
    (root / "work").mkdir(exist_ok=True)
    return subprocess.run(
        gemini_command(CLI, TASK, SESSION),
        cwd=root / "work",
        env=gemini_env(root / "home", base_url, "sk-molt"),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )


# --- What Gemini CLI sends ----------------------------------------------------------------


def _reply_events(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The script's answer to one request, as one `streamGenerateContent` chunk."""
    if any("functionResponse" in part for part in body["contents"][-1]["parts"]):
        parts: list[dict[str, Any]] = [{"text": ANSWER}]
    else:
        parts = [{"functionCall": {"name": "run_shell_command", "args": {"command": COMMAND}}}]
    candidate = {"content": {"role": "model", "parts": parts}, "finishReason": "STOP", "index": 0}
    usage = {"promptTokenCount": 1, "candidatesTokenCount": 1, "totalTokenCount": 2}
    return [{"candidates": [candidate], "usageMetadata": usage, "modelVersion": MODEL}]


@contextmanager
def recording_server(
    forward_to: str | None = None, paths: list[str] | None = None
) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A Gemini API that records what Gemini CLI sends (the paths too, into `paths`) and answers
    with the script, or passes it on to `forward_to` (`recording.recording_server`); yields its
    URL (a `GOOGLE_GEMINI_BASE_URL`) and the bodies."""
    with recording.recording_server(_reply_events, forward_to, encode=recording.data_events, paths=paths) as (
        url,
        bodies,
    ):
        yield url, bodies


def capture(root: Path) -> list[dict[str, Any]]:
    """The request bodies one `run_gemini` sends, answered by the script, in order: two
    `streamGenerateContent` requests (anything else is an error: the script answers no other)."""
    paths: list[str] = []
    with recording_server(paths=paths) as (url, bodies):
        done = run_gemini(url, root)
    if done.returncode != 0 or response(done.stdout) != ANSWER:
        raise RuntimeError(f"gemini -p did not finish the script: {done.returncode} {done.stderr[-2000:]}")
    if paths != [f"/v1beta/models/{MODEL}:streamGenerateContent?alt=sse"] * 2:
        raise RuntimeError(f"gemini -p sent other requests than the script's two: {paths}")
    return bodies


def tool_output(body: dict[str, Any]) -> str:
    """The output of the call a request answers: what Gemini CLI sent back for `COMMAND`."""
    [part] = body["contents"][-1]["parts"]
    return part["functionResponse"]["response"]["output"]


def spoken(day: date) -> str:
    """A date as its session context writes it: `Monday, December 7, 2026`."""
    return f"{day:%A, %B} {day.day}, {day.year}"


def gemini_cli_episode(held_out: bool = False) -> list[Conversation]:
    """The conversation the tiny Qwen3 model learns for Gemini CLI (see the module's
    docstring); none where the CLI is not installed. `held_out`: varied with stand-ins teaching
    never shows (`variants.drawn`)."""
    if not installed():
        return []
    from molt_proxy.wire.gemini import decode_generate_request

    with tempfile.TemporaryDirectory(prefix="molt-capture-") as folder:
        root = Path(folder).resolve()
        _, last = capture(root)
    decoded = decode_generate_request(json.dumps(last).encode(), MODEL).conversation
    pgid = re.search(r"Process Group PGID: \d+", tool_output(last))
    assert pgid is not None, tool_output(last)
    # Text that differs between runs, and what teaching shows the model in its place
    # (`devtools.variants`). The folders sit in the prompt's tail, a few dozen tokens before the
    # reply (unlike Claude Code's, in its system prompt).
    vary = {
        str(root): variants.drawn(5, variants.folder, held_out),
        spoken(date.today()): [spoken(d) for d in variants.drawn(6, variants.day, held_out)],
        pgid[0]: [f"Process Group PGID: {n}" for n in variants.drawn(7, variants.pid, held_out)],
    }
    messages = [*decoded.messages, {"role": "assistant", "content": ANSWER}]
    return [{"family": "hermes", "tools": decoded.tools, "messages": messages, "vary": vary}]
