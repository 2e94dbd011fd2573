"""The rollout's record: finished attempts are read back once each, started-but-unfinished ones
are the interrupted ones, a line a kill cut short is dropped, a foreign file is refused; and
what the progress line and the summary table say."""

from __future__ import annotations

import io
import json
from dataclasses import asdict
from pathlib import Path

import pytest

from rollout.progress import Progress, summary
from rollout.results import Ledger, Result, ResultsFileError, Started


def result(
    task: str, attempt: int, reward: float | None, error: str | None = None, duration: float = 2.0
) -> Result:
    tokens = {"prompt": 10, "completion": 4} if reward is not None else None
    return Result(task, attempt, f"s-{task}-{attempt}", task, reward, tokens, 1, duration, error)


def test_a_reopened_ledger_knows_what_finished_and_what_was_interrupted(tmp_path: Path) -> None:
    out = tmp_path / "runs" / "out.jsonl"
    ledger = Ledger(out)
    for entry in (Started("a", 0, "s1"), Started("a", 1, "s2"), Started("b", 0, "s3")):
        ledger.start(entry)
    ledger.finish(result("a", 0, 1.0))
    ledger.finish(result("b", 0, None, "timed out after 5s"))
    ledger.close()
    assert out.with_name("out.jsonl.started").exists()

    again = Ledger(out)
    assert again.finished == {
        ("a", 0): result("a", 0, 1.0),
        ("b", 0): result("b", 0, None, "timed out after 5s"),
    }
    assert again.interrupted() == [Started("a", 1, "s2")]
    again.start(Started("a", 1, "s4"))  # rerun, and finished this time
    again.finish(result("a", 1, 0.0))
    again.close()
    third = Ledger(out)
    assert third.interrupted() == [] and len(third.finished) == 3
    assert [json.loads(line)["attempt"] for line in out.read_text().splitlines()] == [0, 0, 1]


def test_a_line_cut_short_by_a_kill_is_dropped_and_the_next_one_starts_on_its_own_line(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out.jsonl"
    whole = json.dumps(asdict(result("a", 0, 1.0)))
    out.write_text(whole + "\n" + whole[:20])
    ledger = Ledger(out)
    assert list(ledger.finished) == [("a", 0)]
    ledger.finish(result("a", 1, 0.5))
    ledger.close()
    assert [json.loads(line)["attempt"] for line in out.read_text().splitlines()] == [0, 1]


def test_an_output_file_that_is_not_a_rollouts_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "trajectories.jsonl"
    out.write_text('{"seq": 1, "token_ids": [1, 2]}\n')
    with pytest.raises(
        ResultsFileError, match=rf"^{out}:1: not a line this runner wrote \(.*\); give another --out$"
    ):
        Ledger(out)


def test_the_progress_line_counts_done_successes_running_and_failed() -> None:
    stream = io.StringIO()
    progress = Progress(4, [result("a", 0, 1.0)], threshold=1.0, stream=stream)
    progress.started()
    progress.started()
    progress.finished(result("a", 1, 0.5))
    progress.finished(result("b", 0, None, "the harness exited with code 1"))
    progress.end()
    assert stream.getvalue().splitlines() == [
        "rollout 1/4 done, success rate 1.00, 1 running, 0 failed",
        "rollout 1/4 done, success rate 1.00, 2 running, 0 failed",
        "rollout 2/4 done, success rate 0.50, 1 running, 0 failed",
        "rollout 3/4 done, success rate 0.33, 0 running, 1 failed",
    ]
    assert Progress(4, [result("a", 1, 0.5)], threshold=0.5, stream=stream).line() == (
        "rollout 1/4 done, success rate 1.00, 0 running, 0 failed"
    )


def test_the_summary_has_a_row_per_task_in_order_and_the_total() -> None:
    results = [
        result("count-3", 0, 1.0, duration=10.0),
        result("count-3", 1, 0.0, duration=20.0),
        result("grep", 0, None, "timed out after 5s", duration=5.0),
        result("grep", 1, 1.0, duration=7.0),
    ]
    assert summary(results, 1.0).splitlines() == [
        "task     attempts  successes  failed  mean reward  mean duration (s)",
        "count-3         2          1       0        0.500               15.0",
        "grep            2          1       1        1.000                6.0",
        "total           4          2       1        0.667               10.5",
    ]
