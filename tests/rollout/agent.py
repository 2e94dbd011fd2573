"""The Python agent and check the rollout tests run: a real agent of two chat turns through its
session's `openai` client, which writes its first reply to answer.txt in its workspace. What it
does besides is the task's `metadata["behaviour"]`:

    sleep   sleep past any timeout after its turns
    crash   raise after its turns
    hold    write its pid to `metadata["signal"]`, then wait while `metadata["hold"]` exists
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from rollout.harness import Attempt
from rollout.tasks import Task


def agent(attempt: Attempt) -> str:
    client = attempt.session.client
    messages = [{"role": "user", "content": attempt.task.prompt}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, seed=attempt.index)
    text = first.choices[0].message.content or ""
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Once more."}]
    client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, seed=attempt.index)
    Path("answer.txt").write_text(text)  # the working directory is the workspace
    behaviour = attempt.task.metadata.get("behaviour")
    if behaviour == "sleep":
        time.sleep(3600)
    if behaviour == "crash":
        raise RuntimeError("the agent crashed on purpose")
    if behaviour == "hold":
        Path(attempt.task.metadata["signal"]).write_text(str(os.getpid()))
        while Path(attempt.task.metadata["hold"]).exists():
            time.sleep(0.1)
    return text


def check(task: Task, workspace: Path, transcript: str) -> dict:
    """1.0 when the answer the agent returned is the one it wrote."""
    written = (workspace / "answer.txt").read_text()
    return {"reward": 1.0 if written == transcript else 0.0, "answer_chars": len(written)}
