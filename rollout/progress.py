"""What a rollout shows while it runs and when it ends.

While it runs: one line on stderr, rewritten in place on a terminal (a line per finished attempt
elsewhere, e.g. in a log): attempts done of all, the running success rate, how many run now, how
many failed. At the end: a table per task (attempts, successes, mean reward, mean duration) and
the total. An attempt succeeds when its reward is at least the threshold (`--success-threshold`,
1.0 by default: a check's exit code 0 and a printed 1 both are); a failed attempt (crashed, timed
out, its setup or check failed) has no reward and counts as no success.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable
from statistics import fmean
from typing import TextIO

from rollout.results import Result

DEFAULT_SUCCESS_THRESHOLD = 1.0


def succeeded(result: Result, threshold: float) -> bool:
    return result.reward is not None and result.reward >= threshold


class Progress:
    def __init__(self, total: int, done: Iterable[Result], threshold: float, stream: TextIO = sys.stderr):
        self.total, self.threshold, self.stream = total, threshold, stream
        self.done = self.successes = self.failed = self.running = 0
        self._lock = threading.Lock()
        self._live = stream.isatty()
        for result in done:
            self._count(result)

    def started(self) -> None:
        with self._lock:
            self.running += 1
            self._show()

    def finished(self, result: Result | None) -> None:
        """An attempt ended: with its result, or None if an error of the run stopped it."""
        with self._lock:
            self.running -= 1
            if result is not None:
                self._count(result)
            self._show()

    def line(self) -> str:
        rate = f"{self.successes / self.done:.2f}" if self.done else "-"
        return (
            f"rollout {self.done}/{self.total} done, success rate {rate},"
            f" {self.running} running, {self.failed} failed"
        )

    def end(self) -> None:
        if self._live:
            self.stream.write("\n")
            self.stream.flush()

    def _count(self, result: Result) -> None:
        self.done += 1
        self.successes += succeeded(result, self.threshold)
        self.failed += result.error is not None

    def _show(self) -> None:
        if self._live:
            self.stream.write(f"\r{self.line()}\x1b[K")
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()


def summary(results: list[Result], threshold: float) -> str:
    """The table: one row per task, in the order of `results`, then the total."""
    by_task: dict[str, list[Result]] = {}
    for result in results:
        by_task.setdefault(result.task, []).append(result)
    header = ("task", "attempts", "successes", "failed", "mean reward", "mean duration (s)")
    rows = [_row(task, group, threshold) for task, group in by_task.items()]
    rows.append(_row("total", results, threshold))
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def render(row: tuple[str, ...]) -> str:
        return "  ".join(
            cell.ljust(width) if i == 0 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        )

    return "\n".join(render(row) for row in [header, *rows])


def _row(name: str, results: list[Result], threshold: float) -> tuple[str, ...]:
    rewards = [r.reward for r in results if r.reward is not None]
    return (
        name,
        str(len(results)),
        str(sum(succeeded(r, threshold) for r in results)),
        str(sum(r.error is not None for r in results)),
        f"{fmean(rewards):.3f}" if rewards else "-",
        f"{fmean(r.duration_s for r in results):.1f}" if results else "-",
    )
