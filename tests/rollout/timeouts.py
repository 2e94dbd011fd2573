"""A harness's timeout on an event instead of a clock, for the tests of what a timeout does.

`timing_out_when(harness, condition)` keeps the harness and its whole kill path as they are
(`CommandHarness.run` kills the process group, `_killed` reads what is left) and only ends its
wait early: the run counts as timed out the moment `condition()` holds (the CLI sent its first
turn, the escaped child started), rather than after a fixed number of seconds chosen to be
long enough on a busy machine. The attempt's own `timeout_s` still ends the wait at the latest,
and a command that exits first is waited for as usual.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from typing import TypeVar

from rollout.harness import Attempt, CommandHarness

H = TypeVar("H", bound=CommandHarness)

POLL_S = 0.05


def timing_out_when(harness: H, condition: Callable[[], object]) -> H:
    """`harness`, whose runs time out once `condition()` is true (or at the attempt's timeout)."""

    def wait(process: subprocess.Popen[str], attempt: Attempt) -> tuple[str, str]:
        deadline = time.monotonic() + attempt.timeout_s
        while not condition() and time.monotonic() < deadline:
            if process.poll() is not None:  # it ended by itself: no timeout to cause
                return process.communicate()
            time.sleep(POLL_S)
        raise subprocess.TimeoutExpired(process.args, attempt.timeout_s)

    harness.wait = wait  # type: ignore[method-assign]
    return harness
