"""mini-swe-agent, OpenCode and Qwen Code, the real ones (`scripts/setup.sh` installs them under
`.tools/`), run by their adapters against a real proxy in front of the untaught tiny Qwen3 on
CPU, offline. The model was never taught these harnesses, so it solves nothing: what is checked
is the plumbing. Each harness talks to a recording pass-through in front of the proxy (the
session's base URL points there), so the test re-renders exactly what it sent and compares
that with the ids the proxy recorded."""

from __future__ import annotations

import importlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from devtools.recording import recording_server
from integrations.session import MoltSession, create_session
from molt_proxy.tokenizer import Tokenizer
from molt_proxy.wire.openai import decode_chat_request
from rollout import harnesses
from rollout.harness import Attempt, CommandHarness
from rollout.harnesses import mini_swe_agent, opencode, qwen_code
from rollout.runner import run_rollout
from rollout.tasks import Task
from tests.helpers import assert_exact, trajectories

MAX_TOKENS = 16
TASK = Task(id="hi", prompt="Write hi to hi.txt", check="test -f hi.txt")


@dataclass(frozen=True)
class Case:
    harness: Callable[[], CommandHarness]
    """The adapter with small replies (and few steps where it takes a limit)."""
    requests: int
    """How many requests its episode sends on the untaught model."""
    tools: list[str]
    """The tools each request declares (measured with the pinned version)."""
    stream: bool


CASES = {
    # Two format errors (no tool call), then its step limit: two requests, each a new segment.
    "mini-swe-agent": Case(
        lambda: mini_swe_agent.MiniSweAgent(max_tokens=MAX_TOKENS, step_limit=2),
        2,
        ["bash"],
        False,
    ),
    "opencode": Case(
        lambda: opencode.OpenCode(max_tokens=MAX_TOKENS),
        1,
        ["bash", "edit", "glob", "grep", "read", "skill", "task", "todowrite", "webfetch", "write"],
        True,
    ),
    "qwen-code": Case(
        lambda: qwen_code.QwenCode(max_tokens=MAX_TOKENS),
        1,
        (
            "agent edit get_goal glob grep_search list_agents notebook_edit read_file run_shell_command skill"
            " tool_call tool_search update_goal write_file"
        ).split(),
        True,
    ),
}
INSTALLED = {
    "mini-swe-agent": mini_swe_agent.installed(),
    "opencode": opencode.installed(),
    "qwen-code": qwen_code.installed(),
}


def _installed(name: str) -> pytest.MarkDecorator:
    reason = f"{name} is not installed (scripts/setup.sh installs it under .tools/)"
    return pytest.mark.skipif(not INSTALLED[name], reason=reason)


NAMES = [pytest.param(name, marks=_installed(name)) for name in CASES]


def _attempt(proxy_url: str, via: str, root: Path, timeout_s: float) -> Attempt:
    """An attempt in a session created on the proxy, its base URL pointing at `via` (the
    recording pass-through, which forwards to the proxy)."""
    created = create_session(proxy_url, group_id=TASK.id)
    session = MoltSession(
        proxy_url=created.proxy_url,
        session_id=created.session_id,
        group_id=created.group_id,
        api_key=created.api_key,
        base_url=f"{via}/s/{created.session_id}/v1",
    )
    workspace, home = root / "workspace", root / "home"
    workspace.mkdir()
    home.mkdir()
    return Attempt(task=TASK, index=0, session=session, workspace=workspace, home=home, timeout_s=timeout_s)


def _open_sessions(proxy_url: str) -> list[str]:
    return [s["session_id"] for s in httpx.get(f"{proxy_url}/ui/api/sessions").json()["data"]]


def _processes_with_home(home: Path) -> list[int]:
    """The live processes whose environment names `home` as HOME: whatever the harness started."""
    entry = f"HOME={home}".encode()
    found = []
    for process in Path("/proc").iterdir():
        try:
            if process.name.isdigit() and entry in (process / "environ").read_bytes().split(b"\0"):
                found.append(int(process.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


@pytest.mark.parametrize("name", NAMES)
def test_each_adapter_is_registered_under_its_name(name):
    module, _, attribute = harnesses.HARNESSES[name].partition(":")
    assert getattr(importlib.import_module(module), attribute)().name == name


@pytest.mark.parametrize("name", list(CASES))
def test_an_adapter_refuses_a_cli_that_is_not_there_when_it_is_made(name, tmp_path):
    module, _, attribute = harnesses.HARNESSES[name].partition(":")
    with pytest.raises(FileNotFoundError) as refused:
        getattr(importlib.import_module(module), attribute)(cli=tmp_path / "absent")
    assert str(refused.value).endswith(f": {tmp_path / 'absent'} is not an executable file")


@pytest.mark.parametrize("name", NAMES)
def test_the_harness_sends_its_episode_through_the_attempts_session_and_every_trajectory_is_exact(
    name, untaught_qwen3_model, untaught_qwen3_vllm, start_proxy, tmp_path
):
    """Every request lands in the attempt's session (none outside it), names the served model,
    and is, up to each reply, the proxy's tokenizer on the request re-rendered; logprobs are the
    model's own; the answer is the model's last reply."""
    case = CASES[name]
    proxy = start_proxy(untaught_qwen3_model, untaught_qwen3_vllm, "--served-model-name", "tiny")
    with recording_server(lambda body: [], proxy.url) as (url, bodies):
        attempt = _attempt(proxy.url, url, tmp_path, timeout_s=300)
        outcome = case.harness().run(attempt)
    assert (outcome.exit_code, outcome.timed_out, outcome.error) == (0, False, None), outcome.stderr_tail
    assert len(bodies) == case.requests
    assert [(b["model"], sorted(t["function"]["name"] for t in b["tools"])) for b in bodies] == [
        ("tiny", case.tools)
    ] * case.requests
    assert all(b.get("stream", False) == case.stream and b["max_tokens"] == MAX_TOKENS for b in bodies)
    assert _open_sessions(proxy.url) == [attempt.session.session_id]
    attempt.session.reward(0.0)
    records = trajectories(proxy.url)
    assert {r["session_id"] for r in records} == {attempt.session.session_id}
    tokenizer = Tokenizer.load(str(untaught_qwen3_model))
    prompts = sorted(r["token_ids"][: t["completion_start"]] for r in records for t in r["turns"])
    sent = []
    for body in bodies:
        conversation = decode_chat_request(json.dumps(body).encode()).conversation
        sent.append(tokenizer.encode(tokenizer.render(conversation.messages, conversation.tools, {})))
    assert prompts == sorted(sent)
    for record in records:
        assert_exact(record, untaught_qwen3_model)
    assert Path(outcome.extra["transcript_file"]).is_file()
    if name == "mini-swe-agent":  # it keeps no reply without a tool call in its history: no answer
        assert (outcome.transcript, outcome.extra["exit_status"]) == ("", "LimitsExceeded")
    else:
        [record] = records
        [turn] = record["turns"]
        reply = tokenizer.ids_bytes(record["token_ids"][turn["completion_start"] : turn["completion_end"]])
        assert outcome.transcript == reply.decode(errors="replace")


@contextmanager
def stalled_session() -> Iterator[MoltSession]:
    """A session on a server that lists the model and never answers a turn: a harness pointed
    at it waits for its first reply until it is killed, however fast it starts."""
    release = threading.Event()

    class Stalled(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # the adapters' `served_model`
            body = json.dumps({"object": "list", "data": [{"id": "tiny", "max_model_len": 32768}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            release.wait()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Stalled)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        yield MoltSession(url, "stalled", TASK.id, "sk-stalled", f"{url}/s/stalled/v1")
    finally:
        release.set()
        server.shutdown()


@pytest.mark.parametrize("name", NAMES)
def test_a_timed_out_harness_is_killed_with_everything_it_started(name, tmp_path):
    """Its first turn never answered, the run ends as timed out after 5 s, and no process with
    the attempt's HOME is left."""
    (tmp_path / "work").mkdir()
    (tmp_path / "home").mkdir()
    with stalled_session() as session:
        attempt = Attempt(TASK, 0, session, tmp_path / "work", tmp_path / "home", timeout_s=5)
        outcome = CASES[name].harness().run(attempt)
    assert (outcome.exit_code, outcome.timed_out) == (None, True)
    deadline = time.monotonic() + 30  # SIGKILL reaches the group's other members asynchronously
    while _processes_with_home(attempt.home) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_with_home(attempt.home) == []


@pytest.mark.parametrize("name", NAMES)
def test_a_rollout_runs_two_tasks_twice_each_through_the_harness_grouped_checked_and_exact(
    name, untaught_qwen3_model, untaught_qwen3_vllm, start_proxy, tmp_path
):
    """`run_rollout` with the adapter, 2 tasks × 2 attempts, 2 at once. The untaught model writes
    no file: one task's check wants one (reward 0), the other's prints 0.25 whatever happened;
    every attempt is its own session in its task's group, and every segment of it exact."""
    proxy = start_proxy(untaught_qwen3_model, untaught_qwen3_vllm, "--served-model-name", "tiny")
    tasks = tmp_path / "tasks.jsonl"
    wanted = {"id": "hi", "prompt": TASK.prompt, "check": TASK.check}
    anything = {"id": "any", "prompt": "Say something.", "check": "echo 0.25"}
    tasks.write_text(json.dumps(wanted) + "\n" + json.dumps(anything) + "\n")
    out = tmp_path / "results.jsonl"
    adapter = CASES[name].harness()
    results = run_rollout(proxy.url, tasks, adapter, out, attempts=2, concurrency=2, timeout_s=300)
    assert [(r.task, r.attempt, r.group, r.reward, r.error) for r in results] == [
        ("hi", 0, "hi", 0.0, None),
        ("hi", 1, "hi", 0.0, None),
        ("any", 0, "any", 0.25, None),
        ("any", 1, "any", 0.25, None),
    ]
    assert sorted(json.loads(line)["session"] for line in out.read_text().splitlines()) == sorted(
        r.session for r in results
    )
    records = trajectories(proxy.url)
    by_session = {r.session: r for r in results}
    assert {record["session_id"] for record in records} == set(by_session)
    for record in records:
        result = by_session[record["session_id"]]
        assert (record["group_id"], record["reward"], record["info"]["harness"]) == (
            result.task,
            result.reward,
            name,
        )
        assert_exact(record, untaught_qwen3_model)
    for result in results:
        assert result.segments == sum(1 for r in records if r["session_id"] == result.session)
