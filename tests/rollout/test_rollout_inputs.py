"""Bad inputs to `molt-proxy rollout` stop it with a clear message before anything runs: no
results file is written, no session created."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from molt_proxy.cli import main
from molt_proxy.launcher import free_port
from rollout.harness import CommandHarness
from rollout.harnesses import HARNESSES, HarnessError, harness
from rollout.harnesses.python import PythonAgent

AGENT = str(Path(__file__).resolve().parent / "agent.py") + ":agent"
GOOD = '{"id": "a", "prompt": "p", "check": "true"}\n'


@pytest.fixture(scope="module")
def not_a_proxy() -> Iterator[str]:
    """An HTTP server that answers 404 to everything, as a wrong URL's server would."""

    class NotFound(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_error(404)

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def rollout(tmp_path: Path, capsys: pytest.CaptureFixture[str], tasks: str, *flags: str) -> str:
    (tmp_path / "tasks.jsonl").write_text(tasks)
    argv = ["rollout", "--tasks", str(tmp_path / "tasks.jsonl"), "--out", str(tmp_path / "out.jsonl"), *flags]
    assert main(argv) == 2
    assert not (tmp_path / "out.jsonl").exists(), "nothing ran"
    err = capsys.readouterr().err
    assert err.startswith("molt-proxy rollout: error: ")
    return err.removeprefix("molt-proxy rollout: error: ").strip()


def test_a_bad_task_file_names_its_line_and_what_is_wrong(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tasks = GOOD + '{"id": "b", "prompt": "p"}\n'
    assert (
        rollout(tmp_path, capsys, tasks, "--harness", AGENT)
        == f"{tmp_path}/tasks.jsonl:2: check: Field required"
    )
    assert rollout(tmp_path, capsys, GOOD + "{not json\n", "--harness", AGENT).startswith(
        f"{tmp_path}/tasks.jsonl:2: not JSON: "
    )
    assert rollout(tmp_path, capsys, GOOD + GOOD, "--harness", AGENT) == (
        f"{tmp_path}/tasks.jsonl:2: the id 'a' is used twice"
    )


def test_a_missing_task_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "rollout",
        "--tasks",
        str(tmp_path / "none.jsonl"),
        "--out",
        str(tmp_path / "o"),
        "--harness",
        AGENT,
    ]
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith(
        f"molt-proxy rollout: error: cannot read the task file {tmp_path}/none.jsonl: [Errno 2]"
    )


def test_an_unknown_harness_or_agent_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    message = rollout(tmp_path, capsys, GOOD, "--harness", "clod")
    assert message.startswith("unknown harness 'clod' (harnesses: ")
    assert message.endswith("); a Python agent is module:function or path/to/file.py:function")
    agent_file = AGENT.removesuffix(":agent")
    assert rollout(tmp_path, capsys, GOOD, "--harness", f"{agent_file}:solve") == (
        f"--harness {agent_file}:solve: {agent_file} has no function 'solve'"
    )
    assert rollout(tmp_path, capsys, GOOD, "--harness", "no_such_module:solve") == (
        "--harness no_such_module:solve: cannot load no_such_module: No module named 'no_such_module'"
    )


def test_a_wrong_proxy_url_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], not_a_proxy: str
) -> None:
    nobody = f"http://127.0.0.1:{free_port()}"
    assert rollout(tmp_path, capsys, GOOD, "--harness", AGENT, "--proxy-url", nobody).startswith(
        f"cannot reach the proxy at {nobody}: "
    )
    assert rollout(tmp_path, capsys, GOOD, "--harness", AGENT, "--proxy-url", not_a_proxy + "/v1") == (
        f"{not_a_proxy}/v1 does not answer /health as molt-proxy does (404); give the proxy's root URL,"
        " e.g. http://127.0.0.1:8000"
    )


def test_counts_below_one_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert rollout(tmp_path, capsys, GOOD, "--harness", AGENT, "--attempts", "0") == (
        "attempts and concurrency must be at least 1, and the timeout above 0"
    )


class Plain(CommandHarness):
    """A CLI adapter as the registry makes one: its extra flags first."""

    def __init__(self, args: list[str]) -> None:
        self.args = list(args)


def test_a_registered_harness_is_its_adapter_and_anything_with_a_colon_a_python_agent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(HARNESSES, "plain", f"{__name__}:Plain")
    plain = harness("plain", ["--flag", "value"])
    assert type(plain) is Plain and plain.args == ["--flag", "value"]
    with pytest.raises(HarnessError, match="--harness-arg is for a CLI harness"):
        harness(AGENT, ["--flag"])
    agent = harness(AGENT)
    assert isinstance(agent, PythonAgent) and agent.spec == AGENT and agent.name == "python"
