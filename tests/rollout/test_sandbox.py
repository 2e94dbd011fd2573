"""`--sandbox`: what a harness can touch inside bwrap (the workspace, its HOME, the proxy's one
port) and what it cannot (the rest of the file system, the host's /tmp, any other port or
address, outliving its timeout); the command line of the container sandbox, which cannot run
here (a docker client without a daemon, no registry); and the relays' lifeline that ends a
container whose client was killed, run without a container."""

from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from devtools import codex
from integrations.session import MoltSession, create_session
from rollout import harness
from rollout.harness import Attempt, CommandHarness
from rollout.harnesses.codex import Codex
from rollout.sandbox import DEFAULT_IMAGE, RELAY, Bubblewrap, Container, Sandbox, SandboxUnavailable, sandbox
from rollout.tasks import Task
from tests.helpers import assert_exact, trajectories
from tests.rollout.timeouts import timing_out_when

CHECKOUT = Path(__file__).resolve().parents[2]
BWRAP_MISSING = Bubblewrap.unavailable()
needs_bwrap = pytest.mark.skipif(BWRAP_MISSING is not None, reason=f"no bwrap sandbox here: {BWRAP_MISSING}")


class Shell(CommandHarness):
    """A harness that is one shell script, run in the workspace."""

    name = "shell"

    def __init__(self, script: str) -> None:
        self.script = script

    def command(self, attempt: Attempt) -> list[str]:
        return ["sh", "-c", self.script]


def attempt(
    tmp_path: Path, base_url: str, box: Sandbox | None, timeout_s: float = 120.0, prompt: str = "p"
) -> Attempt:
    """An attempt with a workspace and a HOME of its own under `tmp_path`, its session's
    base URL `base_url`."""
    (tmp_path / "workspace").mkdir(parents=True)
    (tmp_path / "home").mkdir()
    session = MoltSession(base_url.split("/s/")[0].removesuffix("/v1"), "s1", "sandboxed", "key-s1", base_url)
    task = Task(id="sandboxed", prompt=prompt, check="true")
    return Attempt(task, 0, session, tmp_path / "workspace", tmp_path / "home", timeout_s, box)


@contextmanager
def http_server(body: bytes) -> Iterator[str]:
    """A tiny HTTP server on 127.0.0.1 that answers every GET with `body`: its URL."""

    class Answer(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def processes(*argv: str) -> list[int]:
    """The machine's processes whose command line is exactly `argv`."""
    wanted = ("\0".join(argv) + "\0").encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "cmdline").read_bytes() == wanted:
                found.append(int(entry.name))
        except OSError:
            continue  # it ended while we looked
    return found


def wait_for(condition, what: str, within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {within_s} s")
        time.sleep(0.05)


# 1. Choosing a sandbox ----------------------------------------------------------------------


def test_an_unknown_sandbox_is_refused_with_the_names_it_takes():
    expected = "expected bwrap, docker, podman, docker:IMAGE, podman:IMAGE or auto"
    for name in ("firejail", "docker:", "bwrap:debian", "auto:x"):
        with pytest.raises(SandboxUnavailable) as raised:
            sandbox(name)
        assert str(raised.value) == f"unknown sandbox {name!r}: {expected}"


def test_auto_without_any_sandbox_says_what_each_one_lacks(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing to find
    with pytest.raises(SandboxUnavailable) as raised:
        sandbox("auto")
    assert str(raised.value) == (
        "no sandbox works here: bwrap: not installed (apt-get install bubblewrap); "
        "podman: not installed; docker: not installed"
    )


def test_a_docker_client_without_a_daemon_is_not_a_sandbox(monkeypatch, tmp_path):
    """A client that cannot reach its daemon (as here) names the engine and what it said."""
    client = tmp_path / "docker"
    client.write_text("#!/bin/sh\necho 'Cannot connect to the Docker daemon. Is it running?' >&2\nexit 1\n")
    client.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SandboxUnavailable) as raised:
        sandbox("docker:debian:bookworm")
    assert str(raised.value) == (
        "docker: no daemon answers `docker info` (Cannot connect to the Docker daemon. Is it running?)"
    )


def test_a_proxy_off_loopback_cannot_be_reached_from_a_sandbox(tmp_path):
    job = attempt(tmp_path, "http://10.1.2.3:8000/s/a/v1", None)
    with pytest.raises(SandboxUnavailable) as raised:
        Bubblewrap().wrap(["true"], {}, job)
    assert str(raised.value) == (
        "a sandboxed harness reaches the proxy through its own loopback only, so the proxy must be on "
        "a loopback address (127.0.0.1, localhost, ::1), not '10.1.2.3'"
    )


def test_a_proxy_on_a_privileged_port_cannot_be_relayed_into_a_sandbox(tmp_path):
    job = attempt(tmp_path, "http://localhost/s/a/v1", None)
    with pytest.raises(SandboxUnavailable) as raised:
        Container().wrap(["true"], {}, job)
    assert str(raised.value) == (
        "the relay inside the sandbox takes the proxy's port without privileges, so the proxy must be "
        "on a port of 1024 or more, not 80"
    )


# 2. The container sandbox: its command line (it cannot run here) ----------------------------


def test_the_container_command_line_mounts_the_attempt_and_the_machine_and_bridges_the_proxy(tmp_path):
    job = attempt(tmp_path, "http://127.0.0.1:8123/s/a1/v1", None)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(job.home), "OPENAI_API_KEY": "key-a1"}
    command, client_env = Container("docker", DEFAULT_IMAGE).wrap(["codex", "exec", "hi"], env, job)
    python, relay = sys.executable, str(RELAY)
    socket = command[command.index("--listen") + 1]
    folder = socket.removeprefix("unix:").removesuffix("/proxy.sock")
    assert socket.startswith("unix:/") and Path(folder).is_dir()
    venv, tools = (CHECKOUT / ".venv").resolve(), (CHECKOUT / ".tools").resolve()
    machine = sorted({CHECKOUT, venv, tools, Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve()})
    machine = [p for p in machine if not any(p != q and p.is_relative_to(q) for q in machine)]
    ws, home = str(job.workspace), str(job.home)
    assert command == [
        python, "-I", relay, "--listen", socket, "--connect", "tcp:127.0.0.1:8123", "--hold-stdin", "--",
        shutil.which("docker") or "docker", "run", "--rm", "-i", "--init", "--network", "none",
        "--read-only", "--tmpfs", "/tmp", "--tmpfs", "/run",
        "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
        "--user", f"{os.getuid()}:{os.getgid()}", "--workdir", ws,
        "--volume", f"{ws}:{ws}", "--volume", f"{home}:{home}", "--volume", f"{folder}:{folder}",
        *(part for path in machine for part in ("--volume", f"{path}:{path}:ro")),
        "--env", "PATH=/usr/bin:/bin", "--env", f"HOME={home}", "--env", "OPENAI_API_KEY=key-a1",
        "node:20-bookworm-slim",
        python, "-I", relay, "--listen", "tcp:127.0.0.1:8123", "--connect", socket, "--lifeline", "--",
        "codex", "exec", "hi",
    ]  # fmt: skip
    assert client_env["HOME"] == os.environ["HOME"]  # the client's own (rootless podman's storage)
    assert "OPENAI_API_KEY" not in client_env


def test_a_container_run_is_skipped_here_for_want_of_a_daemon_and_an_image():
    reason = Container.unavailable("docker") or Container.unavailable("podman")
    if reason is not None:
        pytest.skip(f"no container can run here: {reason}; the command line is tested above")
    pytest.skip(f"a daemon answers, but {DEFAULT_IMAGE} cannot be pulled without a registry; not run")


# 3. The relays' lifeline (what ends a container whose client was killed) ---------------------


def test_the_inner_relay_ends_its_command_when_the_outer_relay_dies(tmp_path):
    """As in a container: the outer relay (`docker run`'s parent) holds the inner one's stdin;
    killed, it closes it, and the inner relay kills its command and exits."""
    marker = f"{secrets.randbelow(10**6)}.5"
    inner = [sys.executable, "-I", str(RELAY), "--listen", "tcp:127.0.0.1:0", "--connect", "tcp:127.0.0.1:9"]
    outer = [
        sys.executable,
        "-I",
        str(RELAY),
        "--listen",
        f"unix:{tmp_path}/s",
        "--connect",
        "tcp:127.0.0.1:9",
    ]
    command = [*outer, "--hold-stdin", "--", *inner, "--lifeline", "--", "sleep", marker]
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    wait_for(lambda: processes("sleep", marker), "the command started")
    process.send_signal(signal.SIGKILL)  # the outer relay alone: its child the inner relay lives on
    assert process.wait() == -signal.SIGKILL
    wait_for(lambda: not processes("sleep", marker), "the command ended with the inner relay")


def test_a_relay_exits_with_its_commands_exit_code(tmp_path):
    listen, connect = f"unix:{tmp_path}/s", "tcp:127.0.0.1:9"
    relay = [sys.executable, str(RELAY), "--listen", listen, "--connect", connect, "--"]
    assert subprocess.run([*relay, "sh", "-c", "exit 3"]).returncode == 3
    assert subprocess.run([*relay, "sh", "-c", "kill -9 $$"]).returncode == 128 + 9
    assert not (tmp_path / "s").exists()  # its socket removed
    missing = subprocess.run([*relay, "no-such-harness"], capture_output=True, text=True)
    assert (missing.returncode, missing.stderr) == (
        127,
        "relay: cannot run no-such-harness: No such file or directory\n",
    )
    refused = subprocess.run([*relay[:-1], "true"], capture_output=True, text=True)
    assert (refused.returncode, refused.stderr) == (1, "relay: the command to run goes after `--`\n")


# 4. bwrap: the file system, the network, the timeout ---------------------------------------


@needs_bwrap
def test_inside_bwrap_the_workspace_and_home_are_writable_and_nothing_else(tmp_path):
    job = attempt(tmp_path, "http://127.0.0.1:1024/s/fs/v1", sandbox("bwrap"))
    marker = f"molt-sandbox-test-{secrets.token_hex(4)}"
    script = f"""
        echo work > answer.txt && echo workspace: written
        echo config > "$HOME/.harnessrc" && echo home: written
        echo mine > /tmp/{marker} && echo tmp: $(cat /tmp/{marker})
        touch {CHECKOUT}/{marker} || echo checkout: refused
        touch /etc/{marker} || echo etc: refused
        echo run: $(ls -A /run | wc -l) entries
    """
    outcome = Shell(script).run(job)
    assert outcome.transcript == (
        "workspace: written\nhome: written\ntmp: mine\ncheckout: refused\netc: refused\nrun: 0 entries\n"
    )
    assert outcome.stderr_tail == (
        f"touch: cannot touch '{CHECKOUT}/{marker}': Read-only file system\n"
        f"touch: cannot touch '/etc/{marker}': Read-only file system\n"
    )
    assert (outcome.exit_code, outcome.timed_out) == (0, False)
    assert (job.workspace / "answer.txt").read_text() == "work\n"
    assert (job.home / ".harnessrc").read_text() == "config\n"
    assert not Path(f"/tmp/{marker}").exists()  # the sandbox's /tmp was its own


@needs_bwrap
def test_a_harness_installed_under_tmp_runs_inside_bwrap_though_its_tmp_is_empty(tmp_path, monkeypatch):
    """A checkout cloned under /tmp keeps its .venv and .tools there: the sandbox's empty /tmp
    must still show them (read-only), or the harness is not found at all."""
    tools = tmp_path / "checkout" / ".tools"
    tools.mkdir(parents=True)
    (tools / "harness").write_text("#!/bin/sh\necho ran from $0\ntouch $0.written || echo tools: refused\n")
    (tools / "harness").chmod(0o755)
    monkeypatch.setattr("rollout.sandbox._machine_paths", lambda: [tools.parent])
    job = attempt(tmp_path / "attempt", "http://127.0.0.1:1024/s/tmp/v1", sandbox("bwrap"))
    outcome = Shell(str(tools / "harness")).run(job)
    assert outcome.transcript == f"ran from {tools / 'harness'}\ntools: refused\n"
    assert outcome.exit_code == 0
    assert not (tools / "harness.written").exists()


REACH = """
import errno, socket, sys, urllib.request
print(urllib.request.urlopen(sys.argv[1]).read().decode())
for host, port in zip(sys.argv[2::2], map(int, sys.argv[3::2])):
    try:
        socket.create_connection((host, port), timeout=5).close()
        print(host, "connected")
    except OSError as exc:
        print(host, errno.errorcode[exc.errno])
"""


class Reach(CommandHarness):
    """Fetches the session's proxy root, then tries to connect to each (host, port)."""

    name = "reach"

    def __init__(self, *addresses: tuple[str, int]) -> None:
        self.addresses = [str(part) for address in addresses for part in address]

    def command(self, attempt: Attempt) -> list[str]:
        return [sys.executable, "-c", REACH, attempt.session.proxy_url, *self.addresses]


@needs_bwrap
def test_inside_bwrap_the_proxy_is_reachable_at_its_url_and_nothing_else_is(tmp_path):
    with http_server(b"the proxy") as proxy, http_server(b"another server") as other:
        other_port = int(other.rsplit(":", 1)[1])
        free = attempt(tmp_path / "free", f"{proxy}/s/net/v1", None)
        assert Reach(("127.0.0.1", other_port)).run(free).transcript == "the proxy\n127.0.0.1 connected\n"
        boxed = attempt(tmp_path / "boxed", f"{proxy}/s/net/v1", sandbox("bwrap"))
        outcome = Reach(("127.0.0.1", other_port), ("192.0.2.1", 80)).run(boxed)
    assert outcome.transcript == "the proxy\n127.0.0.1 ECONNREFUSED\n192.0.2.1 ENETUNREACH\n"
    assert outcome.exit_code == 0


@needs_bwrap
def test_a_timeout_kills_everything_inside_bwrap_even_what_left_the_process_group(tmp_path):
    """`setsid` escapes the process group a timeout kills; not the sandbox's pid namespace. The
    attempt times out as soon as the escaped process runs (`tests/rollout/timeouts.py`)."""
    marker = f"{secrets.randbelow(10**6)}.25"
    job = attempt(tmp_path, "http://127.0.0.1:1024/s/late/v1", sandbox("bwrap"), timeout_s=120)
    escaping = Shell(f"setsid sleep {marker} & sleep 1000")
    outcome = timing_out_when(escaping, lambda: processes("sleep", marker)).run(job)
    assert (outcome.exit_code, outcome.timed_out) == (None, True)
    wait_for(lambda: not processes("sleep", marker), "the escaped process ended")


def test_without_a_sandbox_a_timeout_returns_though_an_escaped_child_holds_the_output(tmp_path, monkeypatch):
    """Unsandboxed, the `setsid` child outlives the kill and keeps the output pipes open: the
    harness returns after the grace period anyway (here 0.5 s), its output closed unread."""
    monkeypatch.setattr(harness, "KILLED_GRACE_S", 0.5)
    marker = f"{secrets.randbelow(10**6)}.5"
    job = attempt(tmp_path, "http://127.0.0.1:1024/s/late/v1", None, timeout_s=120)
    try:
        escaping = Shell(f"setsid sleep {marker} & sleep 1000")
        outcome = timing_out_when(escaping, lambda: processes("sleep", marker)).run(job)
        assert (outcome.exit_code, outcome.timed_out, outcome.transcript) == (None, True, "")
        assert processes("sleep", marker)  # it escaped: only a sandbox ends it
    finally:
        subprocess.run(["pkill", "-f", f"sleep {marker}"], check=False)


# 5. A real harness on a real proxy ---------------------------------------------------------


class Curl(CommandHarness):
    """One chat completion with curl at the session's own URL and key; the reply in reply.json."""

    name = "curl"

    def command(self, attempt: Attempt) -> list[str]:
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": attempt.task.prompt}],
            "max_tokens": 6,
        }
        return [
            "curl", "-sS", "--fail-with-body", "-o", "reply.json",
            "-H", f"Authorization: Bearer {attempt.session.api_key}", "-H", "Content-Type: application/json",
            "-d", json.dumps(body), f"{attempt.session.base_url}/chat/completions",
        ]  # fmt: skip


@needs_bwrap
def test_a_harness_in_bwrap_records_one_exact_turn_on_a_real_proxy(
    untaught_qwen3_model, untaught_qwen3_vllm, start_proxy, tmp_path
):
    proxy = start_proxy(untaught_qwen3_model, untaught_qwen3_vllm)
    session = create_session(proxy.url, group_id="sandboxed")
    (tmp_path / "workspace").mkdir()
    (tmp_path / "home").mkdir()
    task = Task(id="sandboxed", prompt="Say hi from the sandbox.", check="true")
    job = Attempt(task, 0, session, tmp_path / "workspace", tmp_path / "home", 120.0, sandbox("bwrap"))
    outcome = Curl().run(job)
    assert (outcome.exit_code, outcome.stderr_tail) == (0, ""), shlex.join(Curl().command(job))
    reply = json.loads((job.workspace / "reply.json").read_text())
    session.reward(1.0)
    [record] = [t for t in trajectories(proxy.url) if t["session_id"] == session.session_id]
    assert (record["group_id"], record["reward"], len(record["turns"])) == ("sandboxed", 1.0, 1)
    [turn] = record["turns"]
    assert turn["completion_end"] - turn["completion_start"] == reply["usage"]["completion_tokens"]
    assert turn["finish_reason"] == reply["choices"][0]["finish_reason"]
    assert_exact(record, untaught_qwen3_model)


@needs_bwrap
@pytest.mark.skipif(not codex.installed(), reason="Codex's CLI is not installed (scripts/setup.sh)")
def test_codex_in_bwrap_runs_its_command_in_its_own_sandbox_and_writes_the_workspace(tmp_path):
    """The real CLI, by its rollout adapter, against `devtools.codex`'s scripted Responses
    server (no model: this is about the sandbox): it streams through the relays, runs
    `echo hi | tee hi.txt` under its own bwrap inside ours, and the file lands in the workspace."""
    with codex.recording_server() as (url, bodies):
        job = attempt(tmp_path, url, sandbox("bwrap"), timeout_s=240, prompt=codex.TASK)
        outcome = Codex(model=codex.MODEL).run(job)  # the adapter, as a rollout runs it
    assert (outcome.exit_code, outcome.transcript) == (0, f"{codex.ANSWER}\n"), outcome.stderr_tail
    assert codex.tool_output(bodies[-1]).endswith(
        "\nProcess exited with code 0\nOriginal token count: 1\nOutput:\nhi\n"
    )
    assert (job.workspace / "hi.txt").read_text() == "hi\n"
