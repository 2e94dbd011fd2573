"""Codex CLI, the real one, as a harness for the tiny Qwen3 model: where it is installed, how to
run it offline, and the episode the model learns from what it really sends.

`scripts/setup.sh` installs the pinned CLI (`CLI_VERSION`, from npm) under the checkout's
`.tools/`. Codex's prompt is OpenAI's text, and it changes between versions, so the project
keeps no copy of it: `codex_episode()` runs the installed CLI against a stand-in server that
answers with the script (`capture`), and turns the requests it sent into the conversation the
tiny model is taught: `codex exec TASK` calls `exec_command` with `COMMAND` (Codex runs it in
its sandbox and sends the output back), then answers `ANSWER`.

`write_config` (`rollout.harnesses.codex`, which rollouts share) keeps the prompt lean and the
same from run to run: no plugins, apps, goals, sub-agents, skills, web search, image or
user-input tool, no sandbox note and no environment message (which name the folder and the
date); the base prompt and 2 tools (`exec_command`, `write_stdin`) remain. What still differs
between runs — the chunk id and wall time Codex writes into a tool's output — is varied while
teaching (`Conversation.vary`).
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from devtools import recording, variants
from devtools.scripts import Conversation
from rollout.harnesses.cli import TOOLS
from rollout.harnesses.codex import codex_command, codex_env, git_repository, write_config

CLI_VERSION = "0.171.0"
CLI = TOOLS / "codex"
"""Where `scripts/setup.sh` installs it (`npm install --prefix .tools`)."""

MODEL = "tiny"
"""The `model` name: only a name to the proxy (Codex does not write it into its prompt)."""
TASK = "Write hi to hi.txt"
COMMAND = "echo hi | tee hi.txt"
"""The `exec_command` call the model makes: it writes the file and prints `hi` into the output."""
ANSWER = "File written."
"""Claude Code's (`devtools.claude_code.ANSWER` says why this one)."""


def _chunk_id(rng: random.Random) -> str:
    return f"Chunk ID: {rng.getrandbits(24):06x}"


def _wall_time(rng: random.Random) -> str:
    """From 0.1 ms to 10 s, as many under a millisecond as over a second (a loaded machine's
    sandboxed `tee` takes seconds)."""
    return f"Wall time: {10 ** rng.uniform(-4, 1):.4f} seconds"


def installed() -> bool:
    """Whether `scripts/setup.sh` installed the CLI."""
    return CLI.exists()


def run_codex(base_url: str, root: Path) -> subprocess.CompletedProcess[str]:
    """`codex exec TASK` in `root/work`, a git repository (made if missing; Codex asks for
    one), sandboxed to write there (and in /tmp), its home in `root/home`, against the
    Responses API at `base_url` (`rollout.harnesses.codex`, as a rollout runs it); returns the
    finished process (stdout: its final answer)."""
    env = codex_env(root / "home", "sk-molt")
    write_config(root / "home", base_url, MODEL)
    work = root / "work"
    git_repository(work)
    return subprocess.run(
        codex_command(CLI, TASK),
        cwd=work,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )


# --- What Codex sends ---------------------------------------------------------------------


def _reply_events(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The script's answer to one request, as Responses stream events."""
    if body["input"][-1].get("type") == "function_call_output":
        text = {"type": "output_text", "text": ANSWER, "annotations": []}
        item = {"type": "message", "id": "msg_1", "role": "assistant", "content": [text]}
    else:
        arguments = json.dumps({"cmd": COMMAND})
        item = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "exec_command"}
        item |= {"arguments": arguments, "status": "completed"}
    response = {"id": "resp_1", "object": "response", "model": MODEL, "output": []}
    usage = {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2}
    return [
        {"type": "response.created", "response": {**response, "status": "in_progress"}},
        {"type": "response.output_item.done", "output_index": 0, "item": item},
        {"type": "response.completed", "response": {**response, "status": "completed", "usage": usage}},
    ]


@contextmanager
def recording_server(forward_to: str | None = None) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A Responses API that records what Codex sends and answers with the script, or passes it
    on to `forward_to` (`recording.recording_server`); yields its `/v1` URL and the bodies."""
    with recording.recording_server(_reply_events, forward_to) as (url, bodies):
        yield f"{url}/v1", bodies


def capture(root: Path) -> list[dict[str, Any]]:
    """The request bodies one `run_codex` sends, answered by the script, in order."""
    with recording_server() as (url, bodies):
        done = run_codex(url, root)
    if done.returncode != 0 or done.stdout.strip() != ANSWER:
        raise RuntimeError(f"codex exec did not finish the script: {done.returncode} {done.stderr[-2000:]}")
    return bodies


def tool_output(body: dict[str, Any]) -> str:
    """The output of the call a request answers: what Codex sent back for `COMMAND`."""
    last = body["input"][-1]
    assert last["type"] == "function_call_output", last
    return last["output"]


def codex_episode(held_out: bool = False) -> list[Conversation]:
    """The conversation the tiny Qwen3 model learns for Codex (see the module's docstring);
    none where the CLI is not installed. `held_out`: varied with stand-ins teaching never shows
    (`variants.drawn`)."""
    if not installed():
        return []
    from molt_proxy.wire.responses import conversation, decode_responses_request

    with tempfile.TemporaryDirectory(prefix="molt-capture-") as folder:
        _, last = capture(Path(folder))
    decoded = conversation(decode_responses_request(json.dumps(last).encode()), [])
    output = tool_output(last)
    chunk, wall = (re.search(rf"{name}: .*", output)[0] for name in ("Chunk ID", "Wall time"))
    # Text that differs between runs (in a tool's output, just before the answer), and what
    # teaching shows the model in its place (`devtools.variants`).
    vary = {
        chunk: variants.drawn(3, _chunk_id, held_out),
        wall: variants.drawn(4, _wall_time, held_out),
    }
    messages = [*decoded.messages, {"role": "assistant", "content": ANSWER}]
    return [{"family": "hermes", "tools": decoded.tools, "messages": messages, "vary": vary}]
