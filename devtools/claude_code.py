"""Claude Code, the real CLI, as a harness for the tiny Qwen3 model: where it is installed,
how to run it offline, and the episode the model learns from what it really sends.

`scripts/setup.sh` installs the pinned CLI (`CLI_VERSION`, from npm) under the checkout's
`.tools/`. Claude Code's prompt is Anthropic's text, and it changes between versions, so the
project keeps no copy of it: `claude_code_episodes()` runs the installed CLI against a stand-in
server that answers with the script (`capture`), and turns the requests it sent into the
conversations the tiny model is taught. Three of them, one task (`TASK`):

- `--bare` (about 1k tokens: 3 tools, a short system prompt): Bash `COMMAND`, then `ANSWER`;
- the default prompt (about 19k tokens: 24 tools, 3 system blocks, a `role: "system"` message
  after the task): the same two replies;
- the title side request it sends without `CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC`: `TITLE`.

What differs from run to run — the date, and the temporary folder that holds the private `HOME`
and the working directory (`run_claude` puts both under one `root`) — is varied while teaching
(`Conversation.vary`), as the template's date is.
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from contextlib import AbstractContextManager
from datetime import date
from pathlib import Path
from typing import Any

from devtools import recording, variants
from devtools.scripts import Conversation
from rollout.harnesses.claude_code import claude_command, claude_env
from rollout.harnesses.cli import TOOLS

CLI_VERSION = "2.1.197"
CLI = TOOLS / "claude"
"""Where `scripts/setup.sh` installs it (`npm install --prefix .tools`)."""

MODEL = "tiny"
"""The `--model` name: Claude Code writes it into its system prompt."""
TASK = "Write hi to hi.txt"
COMMAND = "echo hi | tee hi.txt"
"""The Bash call the model makes: it writes the file and prints `hi` into the tool result."""
ANSWER = "File written."
"""No token of it repeats or is in `COMMAND`: the answer this replaced, "Done: hi.txt says hi.",
had ` hi` before `.txt` and before `.`, which the tiny model told apart by position alone; after
a chunk id it had not seen, Codex's episode wrote "Done: hi.txt says hi.txt says hi." in CI."""
TITLE = '{"title": "Write hi to a file"}'
"""The reply to the title request, which asks for JSON (`output_config.format`)."""


def installed() -> bool:
    """Whether `scripts/setup.sh` installed the CLI (it checks the version)."""
    return CLI.exists()


def run_claude(
    base_url: str, root: Path, *, bare: bool, side_requests: bool = False
) -> subprocess.CompletedProcess[str]:
    """`claude -p --allowedTools Bash --model MODEL [--bare] -- TASK` in `root/work`, its `HOME`
    in `root/home`, offline (`rollout.harnesses.claude_code`, as a rollout runs it); returns the
    finished process (stdout: its final answer)."""
    (root / "home").mkdir(parents=True, exist_ok=True)
    (root / "work").mkdir(exist_ok=True)
    command = claude_command(CLI, TASK, model=MODEL, allowed_tools=["Bash"], args=["--bare"] if bare else [])
    env = claude_env(base_url, root / "home", "sk-molt", side_requests=side_requests)
    return subprocess.run(command, cwd=root / "work", env=env, capture_output=True, text=True, timeout=300)


# --- What Claude Code sends ---------------------------------------------------------------


def scripted_reply(
    body: dict[str, Any], command: str = COMMAND, answer: str = ANSWER
) -> list[dict[str, Any]]:
    """The script's answer to one request, as Anthropic's stream events: `TITLE` to a side
    request (no tools), `answer` after a tool result, else the Bash call `command`."""
    last = body["messages"][-1]["content"]
    if not body.get("tools"):
        block, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": TITLE}
    elif isinstance(last, list) and any(b.get("type") == "tool_result" for b in last):
        block, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": answer}
    else:
        block = {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {}}
        delta = {"type": "input_json_delta", "partial_json": json.dumps({"command": command})}
    stop = "tool_use" if block["type"] == "tool_use" else "end_turn"
    usage = {"input_tokens": 1, "output_tokens": 1}
    message = {"id": "msg_1", "type": "message", "role": "assistant", "model": MODEL, "content": []}
    return [
        {"type": "message_start", "message": {**message, "stop_reason": None, "usage": usage}},
        {"type": "content_block_start", "index": 0, "content_block": block},
        {"type": "content_block_delta", "index": 0, "delta": delta},
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None}, "usage": usage},
        {"type": "message_stop"},
    ]


def recording_server(
    forward_to: str | None = None,
) -> AbstractContextManager[tuple[str, list[dict[str, Any]]]]:
    """An Anthropic API that records what Claude Code sends and answers with the script, or
    passes it on to `forward_to` (`recording.recording_server`); yields its URL and the bodies."""
    return recording.recording_server(scripted_reply, forward_to)


def capture(root: Path, *, bare: bool, side_requests: bool) -> list[dict[str, Any]]:
    """The request bodies one `run_claude` sends, answered by the script, in order."""
    with recording_server() as (url, bodies):
        done = run_claude(url, root, bare=bare, side_requests=side_requests)
    if done.returncode != 0 or done.stdout.strip() != ANSWER:
        raise RuntimeError(f"claude -p did not finish the script: {done.returncode} {done.stderr[-2000:]}")
    return sorted(bodies, key=lambda b: (bool(b.get("tools")), len(b["messages"])))


def slug(path: str) -> str:
    """How Claude Code names a project folder under `~/.claude/projects/`."""
    return re.sub(r"[^a-zA-Z0-9]", "-", path)


def _conversation(body: dict[str, Any], reply: str, vary: dict[str, list[str]]) -> Conversation:
    """A captured request, decoded as the proxy decodes it, with the scripted reply after it."""
    from molt_proxy.wire.anthropic import decode_messages_request

    decoded = decode_messages_request(json.dumps(body).encode()).conversation
    messages = [*decoded.messages, {"role": "assistant", "content": reply}]
    return {"family": "hermes", "tools": decoded.tools, "messages": messages, "vary": vary}


def claude_code_episodes(held_out: bool = False) -> list[Conversation]:
    """The conversations the tiny Qwen3 model learns for Claude Code (see the module's
    docstring); none where the CLI is not installed. `held_out`: varied with stand-ins teaching
    never shows (`variants.drawn`)."""
    if not installed():
        return []
    with tempfile.TemporaryDirectory(prefix="molt-capture-") as folder:
        root = Path(folder).resolve()
        title, *bare = capture(root / "b", bare=True, side_requests=True)
        default = capture(root / "d", bare=False, side_requests=False)
    # Text that differs between runs, and what teaching shows the model in its place
    # (`devtools.variants`).
    roots = variants.drawn(1, variants.folder, held_out)
    days = [d.isoformat() for d in variants.drawn(2, variants.day, held_out)]

    def vary(captured: Path) -> dict[str, list[str]]:
        return {
            str(captured): roots,
            slug(str(captured)): [slug(r) for r in roots],
            date.today().isoformat(): days,
        }

    return [
        _conversation(bare[-1], ANSWER, vary(root / "b")),
        _conversation(default[-1], ANSWER, vary(root / "d")),
        _conversation(title, TITLE, {}),
    ]
