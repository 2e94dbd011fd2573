"""The task set: one JSON object per line.

    {"id": "count-3", "prompt": "Find the file that contains 'needle' and write its line count to answer.txt",
     "files": {"a.txt": "...", "b/c.txt": "..."},          # optional: laid into the workspace
     "directory": "tasks/count-3",                          # optional: copied into the workspace
     "setup": "git init -q",                               # optional: run in the workspace first
     "check": "test \"$(cat answer.txt)\" = 7",             # a command, or {"python": "module:function"}
     "metadata": {...}}                                     # optional: anything, kept in `info`

The check decides the reward (`rollout.checks`): a command's printed number (its last line of
stdout), or else its exit code (0 → 1.0, anything else → 0.0); a Python check is
`function(task, workspace, transcript) -> float | dict` (a dict holds `reward` and what else
goes into `info`). A relative `directory`, and a Python check's relative `file.py`, are read from
the task file's folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from molt_proxy.callables import absolute
from molt_proxy.errors import BadRequest
from molt_proxy.ids import check_group_id
from molt_proxy.session import DEFAULT_GROUP_PREFIX


class PythonCheck(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    python: str = Field(min_length=1)
    """`module:function` or `path/to/file.py:function`."""


class Task(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    """The task's name: the group id of its attempts (`eval/<id>` for an evaluation run)."""
    prompt: str = Field(min_length=1)
    check: str | PythonCheck
    """A shell command, or `{"python": "module:function"}` (or `path/to/file.py:function`)."""
    files: dict[str, str] = {}
    directory: Path | None = None
    setup: str | None = None
    metadata: dict[str, Any] = {}

    @field_validator("id")
    @classmethod
    def _group_id(cls, value: str) -> str:
        try:
            check_group_id(value, "id")  # the id is the attempts' group id
        except BadRequest as exc:
            raise ValueError(exc.message) from None
        if value.startswith((DEFAULT_GROUP_PREFIX, "eval/")):
            raise ValueError(f"must not start with {DEFAULT_GROUP_PREFIX!r} or 'eval/' (the proxy's own)")
        return value

    @field_validator("check")
    @classmethod
    def _command(cls, value: str | PythonCheck) -> str | PythonCheck:
        if isinstance(value, str) and not value.strip():
            raise ValueError("an empty command")
        return value

    @field_validator("files")
    @classmethod
    def _inside(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if not name or Path(name).is_absolute() or ".." in Path(name).parts:
                raise ValueError(f"the path {name!r} must stay inside the workspace")
        return value


class TaskFileError(ValueError):
    """A task file that cannot be run: says which line and what is wrong."""


def load_tasks(path: Path) -> list[Task]:
    """Every task of the JSONL file at `path`, checked before anything runs; a relative
    `directory` or Python check file is made absolute against the file's folder."""
    tasks: list[Task] = []
    seen: set[str] = set()
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise TaskFileError(f"cannot read the task file {path}: {exc}") from None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            task = Task.model_validate(json.loads(line))
        except (ValueError, ValidationError) as exc:
            raise TaskFileError(f"{path}:{number}: {_reason(exc)}") from None
        if task.directory is not None and not task.directory.is_absolute():
            task = task.model_copy(update={"directory": path.parent / task.directory})
        if isinstance(task.check, PythonCheck):
            task = task.model_copy(
                update={"check": PythonCheck(python=absolute(task.check.python, path.parent))}
            )
        if task.id in seen:
            raise TaskFileError(f"{path}:{number}: the id {task.id!r} is used twice")
        seen.add(task.id)
        tasks.append(task)
    if not tasks:
        raise TaskFileError(f"{path}: no tasks")
    return tasks


def _reason(exc: Exception) -> str:
    if not isinstance(exc, ValidationError):
        return f"not JSON: {exc}"
    return "; ".join(
        f"{'.'.join(str(part) for part in error['loc']) or 'task'}: {error['msg']}" for error in exc.errors()
    )
