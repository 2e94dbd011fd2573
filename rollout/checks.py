"""A task's check: what its finished workspace is worth.

A command check runs in the workspace (`sh -c`, the runner's environment, HOME the attempt's):
the last line of its stdout, read as a number, is the reward; a command that prints none is
worth its exit code (0 → 1.0, anything else → 0.0). A Python check is
`fn(task, workspace, transcript) -> float | dict`: a dict holds `reward` and whatever else it
wants kept in the reward's `info`.

A check that cannot say (it timed out, raised, or gave no finite number) raises `CheckError`:
the verifier failed, not the policy, so the attempt is closed unrewarded rather than scored 0.
"""

from __future__ import annotations

import math
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from molt_proxy.callables import CallableError, load
from rollout.workspace import OUTPUT_TAIL, shell

if TYPE_CHECKING:
    from rollout.tasks import Task

"""How much of a command check's output `info` keeps (the end: where a test runner's summary is)."""


class CheckError(RuntimeError):
    """A check that gave no reward: why, for the attempt's `info`."""


@dataclass(frozen=True)
class Checked:
    reward: float
    info: dict[str, Any] = field(default_factory=dict)
    """`{"exit_code", "output"}` for a command; what a Python check's dict held besides `reward`."""


def run_check(task: Task, workspace: Path, home: Path, transcript: str, timeout_s: float) -> Checked:
    """The task's reward for `workspace` (see the module docstring)."""
    if isinstance(task.check, str):
        return command_check(task.check, workspace, home, timeout_s)
    return python_check(task.check.python, task, workspace, transcript)


def command_check(command: str, workspace: Path, home: Path, timeout_s: float) -> Checked:
    try:
        done = shell(command, workspace, home, timeout_s)
    except subprocess.TimeoutExpired:
        raise CheckError(f"the check timed out after {timeout_s:g}s") from None
    output = (done.stdout + done.stderr)[-OUTPUT_TAIL:]
    return Checked(
        command_reward(done.stdout, done.returncode), {"exit_code": done.returncode, "output": output}
    )


def command_reward(stdout: str, exit_code: int) -> float:
    """The last line of stdout if it is a finite number, else 1.0 for exit code 0 and 0.0 for any other."""
    lines = stdout.strip().splitlines()
    if lines:
        try:
            value = float(lines[-1].strip())
        except ValueError:
            pass
        else:
            if math.isfinite(value):
                return value
    return 1.0 if exit_code == 0 else 0.0


def python_check(spec: str, task: Task, workspace: Path, transcript: str) -> Checked:
    try:
        fn = load(spec)
    except CallableError as exc:
        raise CheckError(f"check {spec}: {exc}") from None
    try:
        result = fn(task, workspace, transcript)
    except Exception as exc:
        raise CheckError(f"check {spec} raised {exc!r}") from exc
    if isinstance(result, dict):
        rest = {key: value for key, value in result.items() if key != "reward"}
        return Checked(_number(spec, result.get("reward")), rest)
    return Checked(_number(spec, result))


def _number(spec: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise CheckError(
            f"check {spec} returned {value!r}: it must return a finite number or a dict with one as 'reward'"
        )
    return float(value)
