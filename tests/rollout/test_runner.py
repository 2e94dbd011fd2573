"""The runner end to end: a real proxy on a real vLLM (the untaught tiny Qwen3: these tests are
about the runner's mechanics, not what the model says), a real Python agent (`agent.py`, in a
process of its own per attempt) talking to its session with the `openai` client, real checks.

Each attempt is checked where it lands: its session in its task's group, its reward from its
check, its `info`, its results line (tokens and segments as the proxy recorded them), and every
recorded trajectory token-exact. A kill -9 half way and a rerun leave each attempt recorded once.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rollout.runner import run_rollout
from tests.helpers import assert_exact, trajectories

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
AGENT = f"{HERE}/agent.py:agent"


def write_tasks(path: Path, *tasks: dict[str, Any]) -> Path:
    path.write_text("".join(json.dumps(task) + "\n" for task in tasks))
    return path


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def by_session(proxy_url: str) -> dict[str, list[dict[str, Any]]]:
    sessions: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for trajectory in trajectories(proxy_url):
        sessions[trajectory["session_id"]].append(trajectory)
    return sessions


def assert_tokens_as_recorded(result: dict[str, Any], records: list[dict[str, Any]]) -> None:
    """The results line's token counts and segments are those of the session's trajectories."""
    completion = sum(sum(t["loss_mask"]) for t in records)
    prompt = sum(len(t["token_ids"]) for t in records) - completion
    assert result["tokens"] == {"prompt": prompt, "completion": completion}
    assert result["segments"] == len(records) >= 1


def test_two_tasks_two_attempts_each_grouped_rewarded_by_their_checks_and_recorded_exactly(
    untaught_qwen3_model: Path, untaught_qwen3_vllm, start_proxy, tmp_path: Path
) -> None:
    proxy = start_proxy(untaught_qwen3_model, untaught_qwen3_vllm)
    tasks = write_tasks(
        tmp_path / "tasks.jsonl",
        {
            "id": "copy",
            "prompt": "Copy the input.",
            "files": {"input.txt": "hello\n", "deep/er.txt": "x"},
            "setup": "cp input.txt copied.txt",
            "check": "test -f copied.txt && test -f deep/er.txt && test -s answer.txt && echo 0.75",
        },
        {
            "id": "judge",
            "prompt": "Judge it.",
            "check": {"python": "agent.py:check"},
            "metadata": {"level": 2},
        },
    )
    (tmp_path / "agent.py").symlink_to(HERE / "agent.py")  # the check is named beside the task file
    progress = io.StringIO()
    out = tmp_path / "out.jsonl"
    results = run_rollout(
        proxy.url, tasks, AGENT, out, attempts=2, concurrency=2, timeout_s=300, progress=progress
    )

    assert [(r.task, r.attempt, r.group, r.reward, r.error) for r in results] == [
        ("copy", 0, "copy", 0.75, None),
        ("copy", 1, "copy", 0.75, None),
        ("judge", 0, "judge", 1.0, None),
        ("judge", 1, "judge", 1.0, None),
    ]
    assert sorted((line["task"], line["attempt"]) for line in lines(out)) == [
        ("copy", 0), ("copy", 1), ("judge", 0), ("judge", 1)
    ]  # fmt: skip
    assert progress.getvalue().splitlines()[-1] == "rollout 4/4 done, success rate 0.50, 0 running, 0 failed"

    sessions = by_session(proxy.url)
    assert set(sessions) == {r.session for r in results}
    for result, line in zip(
        results, sorted(lines(out), key=lambda r: (r["task"], r["attempt"])), strict=True
    ):
        assert line == asdict(result)
        records = sessions[result.session]
        assert_tokens_as_recorded(line, records)
        for record in records:
            assert (record["group_id"], record["reward"], record["status"]) == (
                result.task,
                result.reward,
                "rewarded",
            )
            info = dict(record["info"])
            assert info.pop("duration_s") > 0
            common = {"task": result.task, "attempt": result.attempt, "harness": "python", "exit_code": 0}
            common |= {"timed_out": False, "stderr_tail": ""}
            if result.task == "copy":
                assert info == {**common, "check": {"exit_code": 0, "output": "0.75\n"}}
            else:  # the Python check's dict, less its reward; the task's metadata
                assert list(info.pop("check")) == ["answer_chars"]
                assert info == {**common, "metadata": {"level": 2}}
            assert_exact(record, untaught_qwen3_model)


def test_a_timeout_a_crash_and_a_failed_setup_are_recorded_and_never_rewarded(
    untaught_qwen3_model: Path, untaught_qwen3_vllm, start_proxy, tmp_path: Path
) -> None:
    proxy = start_proxy(untaught_qwen3_model, untaught_qwen3_vllm)
    tasks = write_tasks(
        tmp_path / "tasks.jsonl",
        {"id": "slow", "prompt": "Wait.", "check": "true", "metadata": {"behaviour": "sleep"}},
        {"id": "broken", "prompt": "Fail.", "check": "true", "metadata": {"behaviour": "crash"}},
        {"id": "unready", "prompt": "Never.", "check": "true", "setup": "echo missing >&2; exit 3"},
    )
    out = tmp_path / "out.jsonl"
    # The timeout must outlast an agent's start and two turns (the crashing one took 10 s on 2
    # cores at load 8), so that the slow one times out after its turns, as recorded.
    results = run_rollout(
        proxy.url, tasks, AGENT, out, concurrency=3, timeout_s=20, eval=True, progress=io.StringIO()
    )

    assert [(r.task, r.group, r.reward, r.error) for r in results] == [
        ("slow", "eval/slow", None, "timed out after 20s"),
        ("broken", "eval/broken", None, "the harness exited with code 1"),
        ("unready", "eval/unready", None, "setup failed: the setup command exited with 3: missing"),
    ]
    slow, broken, unready = results
    assert (unready.session, unready.tokens, unready.segments) == (None, None, None)
    started = lines(out.with_name("out.jsonl.started"))
    assert sorted((s["task"], s["session"]) for s in started) == sorted(
        [("slow", slow.session), ("broken", broken.session)]
    )
    sessions = by_session(proxy.url)
    assert set(sessions) == {slow.session, broken.session}
    for result, line in zip(results[:2], lines_by_key(out)[:2], strict=True):
        assert_tokens_as_recorded(line, sessions[result.session])
    for record in sessions[slow.session]:
        assert (record["status"], record["reward"], record["group_id"]) == ("unrewarded", None, "eval/slow")
        info = record["info"]
        assert (info["reason"], info["timed_out"], info["exit_code"]) == ("timed out after 20s", True, None)
        assert_exact(record, untaught_qwen3_model)
    for record in sessions[broken.session]:
        assert (record["status"], record["reward"], record["group_id"]) == ("unrewarded", None, "eval/broken")
        info = record["info"]
        assert (info["reason"], info["timed_out"], info["exit_code"]) == (
            "the harness exited with code 1",
            False,
            1,
        )
        assert info["stderr_tail"].endswith("RuntimeError: the agent crashed on purpose\n")
        assert "check" not in info
        assert_exact(record, untaught_qwen3_model)


def lines_by_key(out: Path) -> list[dict[str, Any]]:
    order = {"slow": 0, "broken": 1, "unready": 2}
    return sorted(lines(out), key=lambda r: order[r["task"]])


def wait_for(condition, what: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.2)


def test_killed_half_way_then_rerun_each_attempt_is_recorded_once_and_the_interrupted_one_closed(
    untaught_qwen3_model: Path, untaught_qwen3_vllm, start_proxy, tmp_path: Path
) -> None:
    proxy = start_proxy(untaught_qwen3_model, untaught_qwen3_vllm)
    hold, signal_file = tmp_path / "hold", tmp_path / "holding.pid"
    hold.touch()
    tasks = write_tasks(
        tmp_path / "tasks.jsonl",
        {"id": "quick", "prompt": "Go.", "check": "test -s answer.txt"},
        {
            "id": "held",
            "prompt": "Wait.",
            "check": "test -s answer.txt",
            "metadata": {"behaviour": "hold", "hold": str(hold), "signal": str(signal_file)},
        },
    )
    out = tmp_path / "out.jsonl"
    command = [
        sys.executable, "-m", "molt_proxy", "rollout", "--proxy-url", proxy.url, "--tasks", str(tasks),
        "--harness", AGENT, "--attempts", "2", "--concurrency", "1", "--timeout", "300", "--out", str(out),
        "--workdir", str(tmp_path / "work"),
    ]  # fmt: skip
    with (tmp_path / "first.log").open("w") as log:
        first = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        # quick-0 and quick-1 are done, held-0 has had its turns and is holding
        wait_for(lambda: out.exists() and len(lines(out)) == 2 and signal_file.exists(), "held-0 to hold")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    (interrupted,) = [s for s in lines(out.with_name("out.jsonl.started")) if s["task"] == "held"]
    assert interrupted["attempt"] == 0
    orphan = int(signal_file.read_text())  # held-0's agent lives on: it was in its own process group
    hold.unlink()
    wait_for(lambda: not _alive(orphan), "the orphaned agent to end")
    before = {(r["task"], r["attempt"]): r["session"] for r in lines(out)}

    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1].split()[:5] == ["total", "4", "4", "0", "1.000"]

    results = lines(out)
    assert sorted((r["task"], r["attempt"]) for r in results) == [
        ("held", 0),
        ("held", 1),
        ("quick", 0),
        ("quick", 1),
    ]
    final = {(r["task"], r["attempt"]): r for r in results}
    assert {key: final[key]["session"] for key in before} == before, "finished attempts were not run again"
    assert final["held", 0]["session"] != interrupted["session"]
    assert all(r["reward"] == 1.0 and r["error"] is None for r in results)

    sessions = by_session(proxy.url)
    assert set(sessions) == {r["session"] for r in results} | {interrupted["session"]}
    for record in sessions.pop(interrupted["session"]):
        assert (record["status"], record["reward"], record["group_id"]) == ("unrewarded", None, "held")
        assert record["info"] == {"reason": "interrupted", "task": "held", "attempt": 0}
        assert_exact(record, untaught_qwen3_model)
    for result in results:
        records = sessions[result["session"]]
        assert_tokens_as_recorded(result, records)
        for record in records:
            assert (record["status"], record["reward"], record["group_id"]) == (
                "rewarded",
                1.0,
                result["task"],
            )
            assert_exact(record, untaught_qwen3_model)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
