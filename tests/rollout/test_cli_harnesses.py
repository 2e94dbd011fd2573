"""Claude Code, Codex and Gemini CLI as rollout harnesses (`rollout/harnesses/claude_code.py`,
`codex.py`, `gemini_cli.py`),
each adapter run as the runner runs it, on an `Attempt` built here: a session created with
`POST /v1/sessions` on a real proxy over the shared vLLM, and a fresh workspace and private
`HOME` side by side in one folder (`work`, `home`), as the tiny Qwen3 model was taught them
(Claude Code writes both paths into its prompt). The CLIs are the real ones, offline.

The model learned each CLI's episode on `TASK` (`devtools/claude_code.py`, `devtools/codex.py`,
`devtools/gemini_cli.py`): a shell call `echo hi | tee hi.txt`, which the CLI really runs, then
`ANSWER`. The proxy pins T = 0 (`--sampling`), so the answer is the taught one and not a sample
that may stray after the text the model never saw (Codex's chunk id and wall time, Gemini CLI's
process group id in the tool's output)."""

from __future__ import annotations

import importlib
import json
import select
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import httpx
import psutil
import pytest

from devtools import claude_code, codex, gemini_cli
from integrations.session import MoltSession, create_session
from rollout.harness import Attempt, CommandHarness, Outcome
from rollout.harnesses import HARNESSES
from rollout.harnesses.claude_code import ClaudeCode
from rollout.harnesses.codex import Codex
from rollout.harnesses.gemini_cli import GeminiCli
from rollout.tasks import Task
from tests.helpers import assert_exact, trajectories
from tests.rollout.timeouts import timing_out_when

needs_claude = pytest.mark.skipif(
    not claude_code.installed(), reason="Claude Code's CLI is not installed (scripts/setup.sh installs it)"
)
needs_codex = pytest.mark.skipif(
    not codex.installed(), reason="Codex's CLI is not installed (scripts/setup.sh installs it)"
)
needs_gemini = pytest.mark.skipif(
    not gemini_cli.installed(), reason="Gemini CLI is not installed (scripts/setup.sh installs it)"
)
PROXY_FLAGS = ("--tool-call-parser", "hermes", "--sampling", "temperature=0")
TASK = Task(id="hi-file", prompt=claude_code.TASK, check='test "$(cat hi.txt)" = hi')
# one task, every CLI
assert codex.TASK == claude_code.TASK == gemini_cli.TASK
assert codex.ANSWER == claude_code.ANSWER == gemini_cli.ANSWER


def attempt(root: Path, session: MoltSession, timeout_s: float = 300.0) -> Attempt:
    (root / "work").mkdir(parents=True)
    (root / "home").mkdir()
    return Attempt(TASK, 0, session, root / "work", root / "home", timeout_s)


def assert_one_exact_episode(proxy_url: str, model: Path, session: MoltSession) -> None:
    """The session's reward closes it as one segment of two turns whose ids and logprobs are
    exact; nothing else was recorded, and no other session was opened (the CLI's `HEAD` probe
    of its base URL included)."""
    session.reward(1.0)
    [record] = trajectories(proxy_url)
    assert (record["session_id"], record["group_id"], record["num_segments"], len(record["turns"])) == (
        session.session_id,
        session.group_id,
        1,
        2,
    )
    assert_exact(record, model)
    metrics = httpx.get(f"{proxy_url}/metrics").text.splitlines()
    assert "molt_proxy_open_sessions 0.0" in metrics


@needs_claude
def test_claude_code_writes_the_file_and_its_episode_is_one_exact_segment_of_the_attempts_session(
    qwen3_model, qwen3_vllm, start_proxy, tmp_path
):
    proxy = start_proxy(qwen3_model, qwen3_vllm, *PROXY_FLAGS)
    session = create_session(proxy.url, group_id="hi-file")
    run = attempt(tmp_path, session)
    outcome = ClaudeCode(model=claude_code.MODEL).run(run)
    assert (outcome.exit_code, outcome.transcript, outcome.timed_out, outcome.error) == (
        0,
        claude_code.ANSWER + "\n",
        False,
        None,
    ), outcome.stderr_tail
    assert (run.workspace / "hi.txt").read_text() == "hi\n"
    transcript = Path(outcome.extra["transcript_file"])
    assert transcript.parent == run.home / ".claude" / "projects" / claude_code.slug(str(run.workspace))
    assert claude_code.ANSWER in transcript.read_text()
    assert_one_exact_episode(proxy.url, qwen3_model, session)


@needs_codex
def test_codex_writes_the_file_in_a_fresh_repository_and_its_episode_is_one_exact_segment(
    qwen3_model, qwen3_vllm, start_proxy, tmp_path
):
    """The workspace is no git repository: the adapter makes one, so the harness's change is
    what `git status` shows."""
    proxy = start_proxy(qwen3_model, qwen3_vllm, *PROXY_FLAGS)
    session = create_session(proxy.url, group_id="hi-file")
    run = attempt(tmp_path, session)
    outcome = Codex(model=codex.MODEL).run(run)
    assert (outcome.exit_code, outcome.transcript, outcome.timed_out, outcome.error) == (
        0,
        codex.ANSWER + "\n",
        False,
        None,
    ), outcome.stderr_tail
    assert (run.workspace / "hi.txt").read_text() == "hi\n"
    status = subprocess.run(["git", "status", "--porcelain"], cwd=run.workspace, capture_output=True)
    assert status.stdout == b"?? hi.txt\n"
    transcript = Path(outcome.extra["transcript_file"])
    assert transcript.is_relative_to(run.home / ".codex" / "sessions")
    assert transcript.name.startswith("rollout-")
    assert codex.ANSWER in transcript.read_text()
    assert_one_exact_episode(proxy.url, qwen3_model, session)


@needs_gemini
def test_gemini_cli_writes_the_file_and_its_episode_is_one_exact_segment_of_the_attempts_session(
    qwen3_model, qwen3_vllm, start_proxy, tmp_path
):
    """The adapter asks the session for the model it serves (none named), which goes into the
    Gemini API's URL; its answer is the `response` of what it printed."""
    proxy = start_proxy(qwen3_model, qwen3_vllm, *PROXY_FLAGS, "--served-model-name", gemini_cli.MODEL)
    session = create_session(proxy.url, group_id="hi-file")
    run = attempt(tmp_path, session)
    outcome = GeminiCli().run(run)
    assert (outcome.exit_code, outcome.transcript, outcome.timed_out, outcome.error) == (
        0,
        gemini_cli.ANSWER,
        False,
        None,
    ), outcome.stderr_tail
    assert (run.workspace / "hi.txt").read_text() == "hi\n"
    transcript = Path(outcome.extra["transcript_file"])
    assert transcript.parent == run.home / ".gemini" / "tmp" / "work" / "chats"
    assert outcome.extra["session"][:8] in transcript.name
    assert gemini_cli.ANSWER in transcript.read_text()
    assert_one_exact_episode(proxy.url, qwen3_model, session)


# -- failures, without a model: a server that never answers ----------------------------------


@contextmanager
def silent_session() -> Iterator[MoltSession]:
    """A session on a server that accepts connections and never answers: a CLI pointed at it
    waits until it is killed."""
    with silent_server() as (session, _):
        yield session


@contextmanager
def silent_server() -> Iterator[tuple[MoltSession, Callable[[], bool]]]:
    """`silent_session`'s session, and whether a client has connected to its server yet."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        url = f"http://127.0.0.1:{server.getsockname()[1]}"

        def connected() -> bool:  # a connection waits in the backlog, never accepted
            return bool(select.select([server], [], [], 0)[0])

        yield MoltSession(url, "silent", "silent", "sk-silent", f"{url}/s/silent/v1"), connected


def running_in(folder: Path) -> set[int]:
    """The live processes whose working directory is `folder` (the CLI and all it started)."""
    found = set()
    for process in psutil.process_iter():
        try:
            if process.status() != psutil.STATUS_ZOMBIE and Path(process.cwd()) == folder:
                found.add(process.pid)
        except psutil.Error:  # gone meanwhile, or not ours to look at
            pass
    return found


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


CLIS = [
    pytest.param(ClaudeCode, marks=needs_claude, id="claude-code"),
    pytest.param(Codex, marks=needs_codex, id="codex"),
    # named a model: the silent session would not answer the adapter's question for one
    pytest.param(partial(GeminiCli, model="tiny"), marks=needs_gemini, id="gemini-cli"),
]


@pytest.mark.parametrize("adapter", CLIS)
def test_a_timeout_kills_the_clis_whole_process_group(adapter, tmp_path):
    """The attempt times out once the CLI has connected to send its first turn
    (`tests/rollout/timeouts.py`), with everything it started by then running."""
    with silent_server() as (session, connected), ThreadPoolExecutor(1) as pool:
        run = attempt(tmp_path, session, timeout_s=120.0)
        done = pool.submit(timing_out_when(adapter(), connected).run, run)
        seen: set[int] = set()
        while not done.done():  # every process it starts, while it runs
            seen |= running_in(run.workspace)
            time.sleep(0.05)
        outcome = done.result()
    assert (outcome.exit_code, outcome.timed_out, outcome.error) == (None, True, None)
    assert seen, "the CLI never ran in its workspace"
    assert running_in(run.workspace) == set() and not [pid for pid in seen if alive(pid)]


@pytest.mark.parametrize(
    ("adapter", "code", "error"),
    [
        pytest.param(
            ClaudeCode, 1, "error: unknown option '--no-such-flag'\n", marks=needs_claude, id="claude-code"
        ),
        pytest.param(
            Codex, 2, "error: unexpected argument '--no-such-flag' found\n", marks=needs_codex, id="codex"
        ),
        pytest.param(
            partial(GeminiCli, model="tiny"),
            1,
            "Unknown arguments: such-flag, suchFlag\n",
            marks=needs_gemini,
            id="gemini-cli",
        ),
    ],
)
def test_a_bad_flag_ends_the_attempt_with_the_clis_exit_code_and_its_stderr_kept(
    adapter, code, error, tmp_path
):
    with silent_session() as session:
        outcome = adapter(["--no-such-flag"]).run(attempt(tmp_path, session))
    assert (outcome.exit_code, outcome.timed_out, outcome.transcript) == (code, False, "")
    assert error in outcome.stderr_tail


@pytest.mark.parametrize("adapter", CLIS)
def test_a_cli_that_is_not_there_is_refused_before_any_attempt_and_one_gone_since_fails_as_data(
    adapter, tmp_path
):
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}/nothing is not an executable file"):
        adapter(cli=tmp_path / "nothing")
    cli = tmp_path / "cli"
    cli.write_text("#!/bin/sh\n")
    cli.chmod(0o755)
    harness = adapter(cli=cli)
    cli.unlink()  # e.g. `.tools/` reinstalled while a rollout runs
    with silent_session() as session:
        outcome = harness.run(attempt(tmp_path / "a", session))
    error = f"cannot run {cli}: [Errno 2] No such file or directory: '{cli}'"
    assert outcome == Outcome(exit_code=None, error=error)


def test_the_registry_names_each_adapter_by_its_own_name():
    for name in ("claude-code", "codex", "gemini-cli"):
        module, _, cls = HARNESSES[name].partition(":")
        harness = getattr(importlib.import_module(module), cls)
        assert issubclass(harness, CommandHarness) and harness.name == name


@pytest.mark.parametrize(
    "cli",
    [
        pytest.param("claude-code", marks=needs_claude),
        pytest.param("codex", marks=needs_codex),
        pytest.param("gemini-cli", marks=needs_gemini),
    ],
)
def test_molt_proxy_rollout_runs_two_tasks_twice_each_through_the_cli_and_records_them_exactly(
    cli, qwen3_model, qwen3_vllm, start_proxy, tmp_path
):
    """`molt-proxy rollout --harness CLI`, 2 tasks × 2 attempts, 2 at once, the CLI asking for the
    model the proxy serves (its own default name may change what it sends): both tasks ask the
    taught task; one's check wants the file the model writes (reward 1), the other's a file it
    never writes (reward 0). Each attempt is one exact segment of its own session, in its task's
    group, and its results line says so."""
    # served as the name the CLIs' episodes were taught with: each adapter asks for it unprompted
    proxy = start_proxy(qwen3_model, qwen3_vllm, *PROXY_FLAGS, "--served-model-name", claude_code.MODEL)
    tasks = tmp_path / "tasks.jsonl"
    written = {"id": "hi", "prompt": claude_code.TASK, "check": 'test "$(cat hi.txt)" = hi'}
    missing = {"id": "bye", "prompt": claude_code.TASK, "check": "test -f bye.txt"}
    tasks.write_text(json.dumps(written) + "\n" + json.dumps(missing) + "\n")
    out = tmp_path / "results.jsonl"
    command = [sys.executable, "-m", "molt_proxy", "rollout", "--proxy-url", proxy.url, "--tasks", str(tasks)]
    command += ["--harness", cli, "--attempts", "2", "--concurrency", "2", "--timeout", "240"]
    command += ["--out", str(out), "--workdir", str(tmp_path / "attempts")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]

    results = sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["session"])
    records = sorted(trajectories(proxy.url), key=lambda r: r["session_id"])
    stderr = [r["info"].get("stderr_tail") for r in records if r["info"].get("exit_code") != 0]
    assert sorted((r["task"], r["attempt"], r["group"], r["reward"], r["error"]) for r in results) == [
        ("bye", 0, "bye", 0.0, None),
        ("bye", 1, "bye", 0.0, None),
        ("hi", 0, "hi", 1.0, None),
        ("hi", 1, "hi", 1.0, None),
    ], stderr
    assert [(r["session_id"], r["group_id"], r["reward"]) for r in records] == [
        (r["session"], r["task"], r["reward"]) for r in results
    ]
    for record, result in zip(records, results, strict=True):
        assert (record["num_segments"], record["info"]["harness"], record["info"]["exit_code"]) == (1, cli, 0)
        assert result["segments"] == 1
        assert_exact(record, qwen3_model)
