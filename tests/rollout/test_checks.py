"""A task's check turns a workspace into a reward: a command's printed number or its exit code,
or a Python function's number or dict; a check that cannot say raises `CheckError`, naming why."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout.checks import Checked, CheckError, command_reward, run_check
from rollout.tasks import Task

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize(
    ("stdout", "exit_code", "reward"),
    [
        ("", 0, 1.0),
        ("", 1, 0.0),
        ("12 passed in 0.1s\n", 0, 1.0),
        ("12 passed in 0.1s\n", 3, 0.0),
        ("checking\n0.25\n", 0, 0.25),
        ("checking\n0.25\n\n  \n", 0, 0.25),  # the last line that holds anything
        ("-3\n", 1, -3.0),  # a printed number wins over the exit code
        ("nan\n", 0, 1.0),  # not finite: not a reward
        ("inf\n", 2, 0.0),
    ],
)
def test_a_command_is_worth_its_last_printed_number_else_its_exit_code(
    stdout: str, exit_code: int, reward: float
) -> None:
    assert command_reward(stdout, exit_code) == reward


def task(check: str | dict) -> Task:
    return Task.model_validate({"id": "t", "prompt": "p", "check": check})


def test_a_command_check_runs_in_the_workspace_with_the_attempts_home(tmp_path: Path) -> None:
    (tmp_path / "answer.txt").write_text("7\n")
    command = 'test "$(cat answer.txt)" = 7 && echo "home $HOME" >&2 && echo 0.5'
    checked = run_check(task(command), tmp_path, Path("/h"), "", timeout_s=30)
    assert checked == Checked(0.5, {"exit_code": 0, "output": "0.5\nhome /h\n"})
    assert run_check(task("exit 4"), tmp_path, Path("/h"), "", timeout_s=30) == Checked(
        0.0, {"exit_code": 4, "output": ""}
    )


def test_a_command_check_keeps_the_end_of_a_long_output(tmp_path: Path) -> None:
    checked = run_check(task("seq 1 5000"), tmp_path, tmp_path, "", timeout_s=30)
    assert checked.reward == 5000.0
    assert len(checked.info["output"]) == 2048 and checked.info["output"].endswith("4999\n5000\n")


def test_a_command_check_that_times_out_gives_no_reward(tmp_path: Path) -> None:
    with pytest.raises(CheckError, match=r"^the check timed out after 0.5s$"):
        run_check(task("sleep 30"), tmp_path, tmp_path, "", timeout_s=0.5)


def test_a_python_check_gets_the_task_the_workspace_and_the_transcript(tmp_path: Path) -> None:
    (tmp_path / "answer.txt").write_text("hello")
    checked = run_check(task({"python": f"{HERE}/agent.py:check"}), tmp_path, tmp_path, "hello", 30)
    assert checked == Checked(1.0, {"answer_chars": 5})
    (tmp_path / "checks.py").write_text(
        "def half(task, workspace, transcript):\n    return 0.5 if task.id == 't' else 0\n"
        "def count(task, workspace, transcript):\n    return len(transcript)\n"
    )
    assert run_check(task({"python": f"{tmp_path}/checks.py:half"}), tmp_path, tmp_path, "", 30) == Checked(
        0.5
    )
    assert run_check(
        task({"python": f"{tmp_path}/checks.py:count"}), tmp_path, tmp_path, "abc", 30
    ) == Checked(3.0)


@pytest.mark.parametrize(
    ("code", "message"),
    [
        ("def c(t, w, x):\n    return 'yes'", "check {spec} returned 'yes': it must return a finite number"),
        ("def c(t, w, x):\n    return True", "check {spec} returned True: it must return a finite number"),
        (
            "def c(t, w, x):\n    return {'ok': 1}",
            "check {spec} returned None: it must return a finite number",
        ),
        (
            "def c(t, w, x):\n    return float('nan')",
            "check {spec} returned nan: it must return a finite number",
        ),
        ("def c(t, w, x):\n    raise KeyError('x')", "check {spec} raised KeyError('x')"),
        ("def d(t, w, x):\n    return 1", "check {spec}: {file} has no function 'c'"),
    ],
)
def test_a_python_check_that_cannot_say_names_itself_and_why(tmp_path: Path, code: str, message: str) -> None:
    file = tmp_path / "bad.py"
    file.write_text(code + "\n")
    spec = f"{file}:c"
    with pytest.raises(CheckError) as error:
        run_check(task({"python": spec}), tmp_path, tmp_path, "", 30)
    assert str(error.value).startswith(message.format(spec=spec, file=file))


def test_a_python_check_file_is_read_from_the_task_files_folder(tmp_path: Path) -> None:
    from rollout.tasks import load_tasks

    (tmp_path / "set").mkdir()
    (tmp_path / "set" / "tasks.jsonl").write_text(
        '{"id": "a", "prompt": "p", "check": {"python": "checks/mine.py:c"}}\n'
        '{"id": "b", "prompt": "p", "check": {"python": "tests.rollout.agent:check"}}\n'
    )
    a, b = load_tasks(tmp_path / "set" / "tasks.jsonl")
    assert a.check.python == f"{tmp_path}/set/checks/mine.py:c"
    assert b.check.python == "tests.rollout.agent:check"
