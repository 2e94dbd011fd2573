"""An attempt's directories: a fresh workspace with the task laid in, and a private HOME beside it.

    <root>/work        the task's `directory` copied, then its `files` written, then its `setup`
                       run there; the harness's working directory and what the check looks at
    <root>/home        HOME for the harness and the check: its config, caches and transcripts
                       stay out of the workspace and out of the user's own HOME

A root that exists is emptied first: a rerun attempt starts from nothing its interrupted run left.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollout.tasks import Task

OUTPUT_TAIL = 2048


class SetupError(RuntimeError):
    """The task could not be laid in (its directory is missing, or its setup command failed): an
    error of that attempt, recorded in its results line."""


def prepare(task: Task, root: Path, timeout_s: float) -> tuple[Path, Path]:
    """`(workspace, home)` under `root`, ready for the harness."""
    shutil.rmtree(root, ignore_errors=True)
    workspace, home = root / "work", root / "home"
    home.mkdir(parents=True)
    if task.directory is not None:
        if not task.directory.is_dir():
            raise SetupError(f"the task's directory {task.directory} is not a directory")
        shutil.copytree(task.directory, workspace, symlinks=True)
    workspace.mkdir(exist_ok=True)
    for name, text in task.files.items():
        path = workspace / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    if task.setup is not None:
        _setup(task.setup, workspace, home, timeout_s)
    return workspace, home


def shell(command: str, workspace: Path, home: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """`sh -c command` in the workspace with the attempt's HOME, as the task's setup and its
    check run (the runner's environment otherwise: they are the task's, not the harness's)."""
    return subprocess.run(
        ["sh", "-c", command],
        cwd=workspace,
        env={**os.environ, "HOME": str(home)},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        errors="replace",
        timeout=timeout_s,
    )


def _setup(command: str, workspace: Path, home: Path, timeout_s: float) -> None:
    try:
        done = shell(command, workspace, home, timeout_s)
    except subprocess.TimeoutExpired:
        raise SetupError(f"the setup command timed out after {timeout_s:g}s") from None
    if done.returncode != 0:
        output = (done.stdout + done.stderr)[-OUTPUT_TAIL:].strip()
        raise SetupError(f"the setup command exited with {done.returncode}: {output}")
