"""The runner: every task of a task set, `attempts` times each, through one harness, recorded.

For each attempt, in a worker thread (the harness itself is a subprocess, so threads suffice):

    1. lay the task into a fresh workspace with a private HOME (`workspace.py`); a setup that
       fails is that attempt's error, recorded, and it gets no session
    2. create its session on the proxy (`POST /v1/sessions`, group = the task id, `eval/<id>`
       for an evaluation run) and note it in `<out>.started` before the harness starts
    3. run the harness with the per-attempt timeout
    4. read the session's token counts, then either
       - the harness ended well (exit code 0): run the task's check (`checks.py`) and post its
         reward with what happened in `info`, or
       - it crashed, timed out or raised (or the check could not say): close the session
         unrewarded with the reason in `info`, never a reward
    5. append its results line (`results.py`)

A rerun with the same `out` skips attempts with a results line, and closes the sessions of the
ones that started without finishing as unrewarded (`reason: "interrupted"`) before running them
anew. Errors of the proxy itself (unreachable, a 5xx) stop the run instead of being recorded:
the attempts they hit did not fail, and a rerun runs them.

Ctrl-C starts no new attempt and lets the running ones finish (each within its timeout); a
kill -9 stops at once, leaving its harness processes to end by themselves (their sessions are
closed by the rerun, so their further requests are refused).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO, TypeVar

import httpx

from integrations.session import create_session
from rollout.checks import CheckError, run_check
from rollout.harness import Attempt, Harness, Outcome
from rollout.harnesses import harness as harness_named
from rollout.progress import DEFAULT_SUCCESS_THRESHOLD, Progress
from rollout.results import Ledger, Result, Started
from rollout.sandbox import Sandbox
from rollout.tasks import Task, load_tasks
from rollout.workspace import SetupError, prepare

T = TypeVar("T")

MAX_METADATA_BYTES = 16 * 1024
"""A task's `metadata` goes into each attempt's `info`, which the proxy takes up to 64 KiB of."""


class RolloutError(RuntimeError):
    """The run cannot go on: a bad input found before anything ran, or the proxy failed."""


class _SessionGone(Exception):
    """The proxy no longer has the attempt's session open (its TTL closed it, or the agent
    posted a reward itself): an error of that attempt."""


@dataclass(frozen=True)
class _Run:
    proxy_url: str
    harness: Harness
    timeout_s: float
    eval: bool
    admin_key: str | None
    sandbox: Sandbox | None
    workdir: Path
    keep_workspaces: bool
    ledger: Ledger
    model: str | None


def run_rollout(
    proxy_url: str,
    tasks: Path | list[Task],
    harness: str | Harness,
    out: Path,
    *,
    attempts: int = 1,
    concurrency: int = 1,
    timeout_s: float = 600.0,
    eval: bool = False,
    admin_key: str | None = None,
    sandbox: Sandbox | None = None,
    workdir: Path | None = None,
    success_threshold: float = DEFAULT_SUCCESS_THRESHOLD,
    progress: TextIO = sys.stderr,
) -> list[Result]:
    """Run (or resume) the rollout and return its results, one per task and attempt, in task
    order. `harness` is a name of `rollout.harnesses.HARNESSES`, a Python agent
    (`module:function`, `file.py:function`) or an adapter object; `workdir` keeps every
    attempt's workspace and HOME under it (default: a temporary folder, each attempt's removed
    once it is checked). Bad inputs raise before anything runs."""
    if attempts < 1 or concurrency < 1 or timeout_s <= 0:
        raise RolloutError("attempts and concurrency must be at least 1, and the timeout above 0")
    task_list = load_tasks(tasks) if isinstance(tasks, Path) else tasks
    _check_metadata(task_list)
    adapter = harness_named(harness) if isinstance(harness, str) else harness
    proxy_url = proxy_url.rstrip("/")
    _check_proxy(proxy_url)
    model = _served_model(proxy_url, admin_key)
    ledger = Ledger(out)
    root = workdir or Path(tempfile.mkdtemp(prefix="molt-rollout-"))
    run = _Run(
        proxy_url, adapter, timeout_s, eval, admin_key, sandbox, root, workdir is not None, ledger, model
    )
    try:
        for entry in ledger.interrupted():
            _close(
                run, entry.session, {"reason": "interrupted", "task": entry.task, "attempt": entry.attempt}
            )
        keys = [(task, index) for task in task_list for index in range(attempts)]
        todo = [(task, index) for task, index in keys if (task.id, index) not in ledger.finished]
        done = [
            ledger.finished[task.id, index] for task, index in keys if (task.id, index) in ledger.finished
        ]
        shown = Progress(len(keys), done, success_threshold, progress)
        _run_all(run, todo, concurrency, shown)
        return [ledger.finished[task.id, index] for task, index in keys]
    finally:
        ledger.close()
        if workdir is None:
            shutil.rmtree(root, ignore_errors=True)


def _run_all(run: _Run, todo: list[tuple[Task, int]], concurrency: int, shown: Progress) -> None:
    """Every attempt of `todo`, at most `concurrency` at once, each recorded by its worker as it
    finishes; the first error of the run itself (`RolloutError`) or a Ctrl-C starts no more,
    and is raised once the running attempts are done."""
    executor = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="attempt")
    futures = {executor.submit(_recorded, run, task, index, shown) for task, index in todo}
    stopped: BaseException | None = None
    try:
        while futures:
            try:
                for future in as_completed(futures):
                    futures.discard(future)
                    error = None if future.cancelled() else future.exception()
                    if stopped is None and error is not None:
                        stopped = error
                        executor.shutdown(wait=False, cancel_futures=True)
            except KeyboardInterrupt as exc:
                if stopped is not None:
                    raise
                stopped = exc
                executor.shutdown(wait=False, cancel_futures=True)
                shown.stream.write(
                    "\ninterrupted: no new attempts; the running ones finish (a rerun resumes)\n"
                )
    finally:
        executor.shutdown(wait=True, cancel_futures=True)
        shown.end()
    if stopped is not None:
        raise stopped


def _recorded(run: _Run, task: Task, index: int, shown: Progress) -> None:
    shown.started()
    result = None
    try:
        result = _attempt(run, task, index)
        run.ledger.finish(result)
    finally:
        shown.finished(result)


# -- one attempt -----------------------------------------------------------------------------


def _attempt(run: _Run, task: Task, index: int) -> Result:
    begun = time.monotonic()
    group = f"eval/{task.id}" if run.eval else task.id
    root = run.workdir / f"{task.id.replace('/', '_')}-{index}"

    def result(session: str | None, reward: float | None, record: dict | None, error: str | None) -> Result:
        tokens, segments = _tokens(record) if record is not None else (None, None)
        return Result(
            task.id, index, session, group, reward, tokens, segments, time.monotonic() - begun, error
        )

    try:
        try:
            workspace, home = prepare(task, root, run.timeout_s)
        except (SetupError, OSError) as exc:
            return result(None, None, None, f"setup failed: {exc}")
        session = _proxy_call(lambda: create_session(run.proxy_url, group_id=group, admin_key=run.admin_key))
        run.ledger.start(Started(task.id, index, session.session_id))
        attempt = Attempt(task, index, session, workspace, home, run.timeout_s, run.sandbox, run.model)
        outcome = _run_harness(run.harness, attempt)
        info = _info(run, attempt, outcome)
        try:
            record = _proxy_call(session.describe)
            reward, error = _finish(run, attempt, outcome, info)
        except _SessionGone as exc:
            return result(session.session_id, None, None, str(exc))
        return result(session.session_id, reward, record, error)
    finally:
        if not run.keep_workspaces:
            shutil.rmtree(root, ignore_errors=True)


def _run_harness(harness: Harness, attempt: Attempt) -> Outcome:
    started = time.monotonic()
    try:
        return harness.run(attempt)
    except Exception as exc:  # an adapter's bug is that attempt's error, not the run's end
        return Outcome(exit_code=None, duration_s=time.monotonic() - started, error=repr(exc))


def _finish(
    run: _Run, attempt: Attempt, outcome: Outcome, info: dict[str, Any]
) -> tuple[float | None, str | None]:
    """Post the reward, or close the session unrewarded: `(reward, error)`."""
    failure = _failure(outcome, attempt.timeout_s)
    if failure is None:
        try:
            checked = run_check(
                attempt.task, attempt.workspace, attempt.home, outcome.transcript, run.timeout_s
            )
        except CheckError as exc:
            failure = f"check failed: {exc}"
        else:
            _proxy_call(lambda: attempt.session.reward(checked.reward, {**info, "check": checked.info}))
            return checked.reward, None
    _proxy_call(lambda: attempt.session.close({**info, "reason": failure}))
    return None, failure


def _failure(outcome: Outcome, timeout_s: float) -> str | None:
    if outcome.error is not None:
        return f"the harness raised: {outcome.error}"
    if outcome.timed_out:
        return f"timed out after {timeout_s:g}s"
    if outcome.exit_code != 0:
        return f"the harness exited with code {outcome.exit_code}"
    return None


def _info(run: _Run, attempt: Attempt, outcome: Outcome) -> dict[str, Any]:
    """What the reward (or the close) says about the attempt; the trainer gets it with each of
    the session's trajectories."""
    info: dict[str, Any] = {
        "task": attempt.task.id,
        "attempt": attempt.index,
        "harness": run.harness.name,
        "exit_code": outcome.exit_code,
        "duration_s": round(outcome.duration_s, 3),
        "timed_out": outcome.timed_out,
        "stderr_tail": outcome.stderr_tail,
        **outcome.extra,
    }
    if attempt.task.metadata:
        info["metadata"] = attempt.task.metadata
    return info


def _tokens(record: dict[str, Any]) -> tuple[dict[str, int], int]:
    segments = record["segments"]
    completion = sum(s["num_sampled"] for s in segments)
    prompt = sum(s["num_tokens"] for s in segments) - completion
    return {"prompt": prompt, "completion": completion}, len(segments)


# -- the proxy -------------------------------------------------------------------------------


def _proxy_call(call: Callable[[], T]) -> T:
    """`call()`, a request to the proxy: 404 and 409 (the session is gone) are the attempt's
    error; anything else the proxy or the network does wrong stops the run."""
    try:
        return call()
    except httpx.HTTPStatusError as exc:
        if exc.response.status_code in (404, 409):
            raise _SessionGone(
                f"the proxy closed the session before the runner did: {_message(exc.response)}"
            ) from exc
        raise RolloutError(
            f"the proxy answered {exc.response.status_code}: {_message(exc.response)}"
        ) from exc
    except httpx.HTTPError as exc:
        raise RolloutError(f"the proxy failed: {exc!r}") from exc


def _close(run: _Run, session_id: str, info: dict[str, Any]) -> None:
    """Close a session the runner no longer holds the key of (an interrupted run's): with the
    runner's own key, which created it. One already closed (404, 409) is left as it is."""
    headers = {"Authorization": f"Bearer {run.admin_key}"} if run.admin_key else {}
    url = f"{run.proxy_url}/v1/sessions/{session_id}/close"
    try:
        response = httpx.post(url, json={"info": info}, headers=headers, timeout=60.0)
    except httpx.HTTPError as exc:
        raise RolloutError(f"the proxy failed: {exc!r}") from exc
    if response.status_code not in (200, 404, 409):
        raise RolloutError(
            f"closing interrupted session {session_id}: {response.status_code} {_message(response)}"
        )


def _message(response: httpx.Response) -> str:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text[:300]


def _check_proxy(proxy_url: str) -> None:
    try:
        response = httpx.get(f"{proxy_url}/health", timeout=30.0)
    except httpx.HTTPError as exc:
        raise RolloutError(f"cannot reach the proxy at {proxy_url}: {exc}") from None
    if response.status_code != 200 or "replicas" not in _json(response):
        raise RolloutError(
            f"{proxy_url} does not answer /health as molt-proxy does ({response.status_code});"
            " give the proxy's root URL, e.g. http://127.0.0.1:8000"
        )


def _served_model(proxy_url: str, key: str | None) -> str | None:
    """The first name the proxy serves (its `/v1/models`): what a CLI harness asks for unless
    told another (a CLI's own default, e.g. a GPT or Claude name, may change what it sends)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        models = _json(httpx.get(f"{proxy_url}/v1/models", headers=headers, timeout=30.0)).get("data")
    except httpx.HTTPError:
        return None
    first = models[0] if isinstance(models, list) and models else None
    return first.get("id") if isinstance(first, dict) else None


def _json(response: httpx.Response) -> dict[str, Any]:
    try:
        data = response.json()
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _check_metadata(tasks: list[Task]) -> None:
    for task in tasks:
        size = len(json.dumps(task.metadata))
        if size > MAX_METADATA_BYTES:
            raise RolloutError(
                f"task {task.id!r}: its metadata is {size} bytes as JSON; at most {MAX_METADATA_BYTES}"
                " go into each attempt's info"
            )
