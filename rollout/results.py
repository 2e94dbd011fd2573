"""The record of a rollout: what finished (the results JSONL) and what started (`<out>.started`).

    <out>           one line per finished attempt (`Result`), appended and flushed as it finishes
    <out>.started   one line per attempt whose harness was about to start: task, attempt, session

A rerun reads both: an attempt with a results line is done and not run again; one that started
without finishing was interrupted, and its session is closed unrewarded before it runs anew. Each
line is written whole and flushed at once, so a kill -9 loses nothing that finished; a line it
cut short (the process died inside a write) is dropped when the file is read again.
"""

from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar


@dataclass(frozen=True, slots=True)
class Result:
    """One finished attempt: a line of the results file."""

    task: str
    attempt: int
    session: str | None
    """None: the attempt failed before its session was created (its setup failed)."""
    group: str
    reward: float | None
    """None: no reward was posted (the harness crashed or timed out, or the check failed);
    the session was closed unrewarded, with the reason in `info`."""
    tokens: dict[str, int] | None
    """`{"prompt": P, "completion": C}` over the session's segments: C sampled ids, P the others
    (prompts, tool results); None where the proxy was not asked (no session)."""
    segments: int | None
    """How many trajectories (chains) the session recorded."""
    duration_s: float
    """From the workspace's setup to the reward, seconds."""
    error: str | None

    @property
    def key(self) -> tuple[str, int]:
        return (self.task, self.attempt)


@dataclass(frozen=True, slots=True)
class Started:
    """An attempt whose harness was about to start: a line of `<out>.started`."""

    task: str
    attempt: int
    session: str

    @property
    def key(self) -> tuple[str, int]:
        return (self.task, self.attempt)


class Ledger:
    """The results file and its `.started` companion, read once when opened, then appended to
    (thread-safe: attempts finish in worker threads)."""

    def __init__(self, out: Path):
        self.out = out
        self.started_path = out.with_name(out.name + ".started")
        out.parent.mkdir(parents=True, exist_ok=True)
        self.finished: dict[tuple[str, int], Result] = {}
        for result in _records(out, Result):
            self.finished.setdefault(result.key, result)
        self.started = _records(self.started_path, Started)
        self._lock = threading.Lock()
        self._out = out.open("a")
        self._started = self.started_path.open("a")

    def interrupted(self) -> list[Started]:
        """Attempts that started but never finished: their sessions are still open, or were
        closed by a run interrupted after closing them (the proxy then answers 409)."""
        return [entry for entry in self.started if entry.key not in self.finished]

    def start(self, entry: Started) -> None:
        with self._lock:
            _append(self._started, asdict(entry))

    def finish(self, result: Result) -> None:
        with self._lock:
            _append(self._out, asdict(result))
            self.finished.setdefault(result.key, result)

    def close(self) -> None:
        self._out.close()
        self._started.close()


def _append(file: Any, record: dict[str, Any]) -> None:
    file.write(json.dumps(record) + "\n")
    file.flush()


R = TypeVar("R", "Result", "Started")


class ResultsFileError(ValueError):
    """An output file that is not a rollout's record (another file given as `--out`?)."""


def _records(path: Path, kind: type[R]) -> list[R]:
    records = []
    for number, line in enumerate(_lines(path), start=1):
        try:
            records.append(kind(**json.loads(line)))
        except (ValueError, TypeError) as exc:
            raise ResultsFileError(
                f"{path}:{number}: not a line this runner wrote ({exc}); give another --out"
            ) from None
    return records


def _lines(path: Path) -> list[str]:
    """The file's records; a last line without its newline (cut short by a kill) is cut off the
    file, so that the next append starts on a line of its own."""
    if not path.exists():
        return []
    data = path.read_bytes()
    whole = data[: data.rfind(b"\n") + 1]
    if len(whole) != len(data):
        with path.open("r+b") as file:
            file.truncate(len(whole))
    return [line for line in whole.decode(errors="replace").splitlines() if line.strip()]
