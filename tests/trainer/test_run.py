"""`trainer.run.start_ray`: a local Ray whose node timed out starting is started again.

Ray's own timeout (its raylet not registered within a fixed 30 s) happens only on a machine too
busy to start it, so `ray.init` is stood in for here: these tests check what the trainer does
with each answer, not Ray."""

from __future__ import annotations

import pytest

from trainer import run

TIMED_OUT = Exception(
    "The current node timed out during startup. This could happen because some of the raylet "
    "failed to startup or the GCS has become overloaded."
)


def _ray(monkeypatch: pytest.MonkeyPatch, answers: list[Exception | None]) -> list[str]:
    """Make `ray.init` answer `answers` in turn (an exception is raised); returns the calls made."""
    calls: list[str] = []

    def init(**options: object) -> None:
        calls.append(f"init {options['address']}")
        answer = answers.pop(0)
        if answer is not None:
            raise answer

    monkeypatch.setattr(run.ray, "init", init)
    monkeypatch.setattr(run.ray, "shutdown", lambda: calls.append("shutdown"))
    return calls


def test_a_node_that_timed_out_starting_is_started_again(monkeypatch):
    calls = _ray(monkeypatch, [TIMED_OUT, None])
    run.start_ray()
    assert calls == ["init local", "shutdown", "init local"]


def test_after_three_timeouts_the_last_is_raised(monkeypatch):
    calls = _ray(monkeypatch, [TIMED_OUT, TIMED_OUT, TIMED_OUT])
    with pytest.raises(Exception, match="timed out during startup"):
        run.start_ray()
    assert calls == ["init local", "shutdown", "init local", "shutdown", "init local"]


def test_any_other_failure_is_raised_at_once(monkeypatch):
    calls = _ray(monkeypatch, [ValueError("no such address")])
    with pytest.raises(ValueError, match="no such address"):
        run.start_ray()
    assert calls == ["init local"]
