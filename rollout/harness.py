"""What a harness adapter is: how to run one attempt of a task against its session.

An adapter knows three things about its harness: how to point it at a session (a base URL, a
key, a header), how to run it non-interactively on a prompt, and where it leaves its answer
(its transcript). Everything else (sessions, workspaces, timeouts, checks, rewards, resume) is
the runner's. A CLI harness is a `CommandHarness`: a command line and an environment; a Python
agent is a callable (`harnesses/python.py`). A new harness is one file under
`rollout/harnesses/` and one line in its registry (`harnesses/__init__.py`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from integrations.session import MoltSession

if TYPE_CHECKING:
    from rollout.sandbox import Sandbox
    from rollout.tasks import Task

KILLED_GRACE_S = 5.0
"""After a timeout's kill, how long to wait for the output pipes to close."""
TAIL_BYTES = 4096
"""How much of a harness's stderr the reward's `info` keeps (the end, where errors are)."""


@dataclass(frozen=True)
class Attempt:
    """One attempt at one task: everything an adapter needs to run it."""

    task: Task
    index: int
    """0 … attempts − 1 within the task's group."""
    session: MoltSession
    """The attempt's own session: `session.base_url` is its OpenAI base (`…/s/<id>/v1`),
    `session.api_key` its key; every request the harness sends lands in this episode."""
    workspace: Path
    """A fresh directory of its own, with the task's files laid in and its setup run."""
    home: Path
    """A private HOME for the harness (its config, caches, transcripts), outside the workspace."""
    timeout_s: float
    sandbox: Sandbox | None = None
    """Where a `CommandHarness` runs its command; None: directly, in the workspace."""
    model: str | None = None
    """The name the proxy serves: what a CLI harness asks for unless its adapter names another."""

    @property
    def proxy_root(self) -> str:
        """The session's base URL without `/v1`: what Anthropic clients take (they add `/v1/messages`)."""
        return self.session.base_url.removesuffix("/v1")


@dataclass
class Outcome:
    """How an attempt's harness run ended."""

    exit_code: int | None
    """None: it did not exit by itself (timed out and killed, or it raised)."""
    transcript: str = ""
    """The harness's answer: what it printed, or what it wrote to its transcript file."""
    stderr_tail: str = ""
    duration_s: float = 0.0
    timed_out: bool = False
    error: str | None = None
    """Why the run failed before the harness could finish (its exception), if it did."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Harness-specific facts for the reward's `info` (e.g. the transcript file's path)."""


class Harness(Protocol):
    """An adapter: runs one attempt to its end (or its timeout) and says how it ended."""

    name: str

    def run(self, attempt: Attempt) -> Outcome: ...


class CommandHarness:
    """A harness that is a command line: subclasses give `command` and `env` (`prepare` where it
    needs files first, `transcript` where the answer is not its stdout, `extra` for facts found
    after the run). `run` starts it in the workspace, in a process group of its own (a timeout
    kills whatever it started too), stdin closed, stdout and stderr kept."""

    name = "command"

    def prepare(self, attempt: Attempt) -> None:
        """Before the command runs: write its config under `attempt.home`, and the like."""

    def command(self, attempt: Attempt) -> list[str]:
        raise NotImplementedError

    def env(self, attempt: Attempt) -> dict[str, str]:
        """The whole environment: nothing of the runner's leaks in unless named here."""
        return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(attempt.home)}

    def transcript(self, attempt: Attempt, stdout: str) -> str:
        return stdout

    def extra(self, attempt: Attempt) -> dict[str, Any]:
        """`Outcome.extra`, read once the command has ended (e.g. where its transcript file is)."""
        return {}

    def wait(self, process: subprocess.Popen[str], attempt: Attempt) -> tuple[str, str]:
        """The command's stdout and stderr once it ends; `subprocess.TimeoutExpired` when the
        attempt's time is up first (`run` then kills its process group). A test ends the wait
        on an event instead of a clock (`tests/rollout/timeouts.py`)."""
        return process.communicate(timeout=attempt.timeout_s)

    def run(self, attempt: Attempt) -> Outcome:
        self.prepare(attempt)
        command, env = self.command(attempt), self.env(attempt)
        if attempt.sandbox is not None:
            command, env = attempt.sandbox.wrap(command, env, attempt)
        started = time.monotonic()
        try:
            process = subprocess.Popen(
                command,
                cwd=attempt.workspace,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                errors="replace",
                start_new_session=True,
            )
        except OSError as exc:  # no such program, not executable: it never ran
            return Outcome(exit_code=None, error=f"cannot run {command[0]}: {exc}")
        timed_out = False
        try:
            stdout, stderr = self.wait(process, attempt)
        except subprocess.TimeoutExpired:
            timed_out = True
            stdout, stderr = _killed(process)
        return Outcome(
            exit_code=None if timed_out else process.returncode,
            transcript=self.transcript(attempt, stdout),
            stderr_tail=stderr[-TAIL_BYTES:],
            duration_s=time.monotonic() - started,
            timed_out=timed_out,
            extra=self.extra(attempt),
        )


def _killed(process: subprocess.Popen[str]) -> tuple[str, str]:
    """Kill the process group and read what is left of its output. A child that left the group
    (`setsid`) may still hold the pipes open: after a grace period they are closed unread,
    rather than waiting on it for ever (a sandbox kills such children too: `rollout/sandbox.py`)."""
    os.killpg(process.pid, signal.SIGKILL)
    try:
        return process.communicate(timeout=KILLED_GRACE_S)
    except subprocess.TimeoutExpired:
        for pipe in (process.stdout, process.stderr):
            if pipe is not None:
                pipe.close()
        process.wait()
        return "", ""
