"""A Python agent as a harness: `--harness my_agents:solve` or `--harness path/to/agent.py:solve`.

The agent is an ordinary function of the attempt, returning its answer (the transcript a Python
check gets; None is ""):

    def solve(attempt: rollout.harness.Attempt) -> str | None:
        client = attempt.session.client      # an openai.OpenAI bound to the attempt's session
        messages = [{"role": "user", "content": attempt.task.prompt}]
        text = client.chat.completions.create(model="m", messages=messages).choices[0].message.content
        (attempt.workspace / "answer.txt").write_text(text)  # the working directory, too
        return text

It runs in a process of its own per attempt (`python -m rollout.harnesses.python SPEC`, a
`CommandHarness`), its working directory the workspace, so the timeout kills it and whatever it
started, and one agent's crash or global state never touches another's. The attempt travels in
a JSON file named by `MOLT_ROLLOUT_ATTEMPT`; the answer comes back in the file named by
`MOLT_ROLLOUT_ANSWER` (stdout stays the agent's own). `OPENAI_BASE_URL` and `OPENAI_API_KEY`
name the session too, so `openai.OpenAI()` with no arguments lands in it. An exception is a
crash: the session is closed unrewarded with its traceback's end in `info`. The runner posts
the reward: the agent must not.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

import rollout
from integrations.session import MoltSession
from molt_proxy.callables import CallableError, absolute, load
from rollout.harness import Attempt, CommandHarness, Outcome
from rollout.harnesses import HarnessError
from rollout.tasks import Task

ATTEMPT_ENV = "MOLT_ROLLOUT_ATTEMPT"
ANSWER_ENV = "MOLT_ROLLOUT_ANSWER"
_ROOT = Path(rollout.__file__).resolve().parents[1]
"""The folder `rollout` is imported from: the agent's process imports the same code."""


class PythonAgent(CommandHarness):
    name = "python"

    def __init__(self, spec: str):
        self.spec = absolute(spec)  # the agent's working directory is the workspace
        self.cwd = Path.cwd()
        try:
            load(self.spec)  # a wrong name stops the run before its first attempt
        except CallableError as exc:
            raise HarnessError(f"--harness {spec}: {exc}") from None

    def command(self, attempt: Attempt) -> list[str]:
        return [sys.executable, "-m", "rollout.harnesses.python", self.spec]

    def env(self, attempt: Attempt) -> dict[str, str]:
        # The runner's working directory stays importable, as it is where the runner was started.
        path = [str(_ROOT), str(self.cwd), *filter(None, [os.environ.get("PYTHONPATH")])]
        return {
            **super().env(attempt),
            "PYTHONPATH": os.pathsep.join(path),
            ATTEMPT_ENV: str(_attempt_file(attempt)),
            ANSWER_ENV: str(_answer_file(attempt)),
            "OPENAI_BASE_URL": attempt.session.base_url,
            "OPENAI_API_KEY": attempt.session.api_key,
        }

    def transcript(self, attempt: Attempt, stdout: str) -> str:
        answer = _answer_file(attempt)
        return answer.read_text() if answer.exists() else ""

    def run(self, attempt: Attempt) -> Outcome:
        _answer_file(attempt).unlink(missing_ok=True)
        session = {k: v for k, v in asdict(attempt.session).items() if k != "rewarded"}
        record = {
            "task": attempt.task.model_dump(mode="json"),
            "index": attempt.index,
            "session": session,
            "workspace": str(attempt.workspace),
            "home": str(attempt.home),
            "timeout_s": attempt.timeout_s,
        }
        _attempt_file(attempt).write_text(json.dumps(record))
        return super().run(attempt)


def _attempt_file(attempt: Attempt) -> Path:
    return attempt.home / ".molt-rollout-attempt.json"


def _answer_file(attempt: Attempt) -> Path:
    return attempt.home / ".molt-rollout-answer.txt"


def main(spec: str) -> None:
    """In the agent's process: rebuild the attempt, call the agent, write its answer."""
    record = json.loads(Path(os.environ[ATTEMPT_ENV]).read_text())
    attempt = Attempt(
        task=Task.model_validate(record["task"]),
        index=record["index"],
        session=MoltSession(**record["session"]),
        workspace=Path(record["workspace"]),
        home=Path(record["home"]),
        timeout_s=record["timeout_s"],
    )
    answer = load(spec)(attempt)
    Path(os.environ[ANSWER_ENV]).write_text("" if answer is None else str(answer))


if __name__ == "__main__":
    main(sys.argv[1])
