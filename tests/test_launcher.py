"""Servers as child processes (`molt_proxy.launcher`): the command `ProxyServer` runs, a
server that dies before it is healthy, and no log file left open in this process."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from molt_proxy.launcher import ProxyServer, ServerProcess, free_port


def _open_files() -> set[str]:
    """What this process holds open (a descriptor may close while we look: skip it)."""
    names = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            names.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return names


def test_a_proxy_server_runs_serve_with_its_upstreams_port_store_and_flags(tmp_path):
    proxy = ProxyServer(
        "tiny",
        upstreams=["http://a", "http://b"],
        port=8123,
        db=tmp_path / "p.db",
        args=["--sampling", "top_k=1"],
    )
    assert proxy.command == [
        sys.executable, "-m", "molt_proxy", "serve", "--model", "tiny",
        "--upstream", "http://a", "--upstream", "http://b",
        "--port", "8123", "--db", str(tmp_path / "p.db"), "--sampling", "top_k=1",
    ]  # fmt: skip
    assert (proxy.url, proxy.base_url(), proxy.base_url("s1")) == (
        "http://127.0.0.1:8123",
        "http://127.0.0.1:8123/v1",
        "http://127.0.0.1:8123/s/s1/v1",
    )


def test_a_server_that_exits_before_it_is_healthy_fails_its_start_and_keeps_no_log_open(tmp_path):
    log = tmp_path / "server.log"
    code = "print('no model here', flush=True); raise SystemExit(3)"
    server = ServerProcess([sys.executable, "-c", code], f"http://127.0.0.1:{free_port()}", log_path=log)
    with pytest.raises(RuntimeError, match=f"{log}.* exited with code 3"):
        server.start(timeout_s=60)
    assert server.returncode == 3
    assert "no model here" in log.read_text()
    assert str(log) not in _open_files(), "the child has its own copy; ours must be closed"


def test_stop_ends_the_whole_process_group(tmp_path):
    pid_file = tmp_path / "worker.pid"
    code = (
        "import subprocess, sys, time\n"
        "worker = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(worker.pid))\n"
        "time.sleep(600)"
    )
    server = ServerProcess([sys.executable, "-c", code], "http://unused", log_path=tmp_path / "log").spawn()
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.monotonic() < deadline and server.returncode is None
        time.sleep(0.05)
    worker = int(pid_file.read_text())
    server.stop()
    assert server.returncode is not None
    while _running(worker):  # killed with its group; init reaps it
        assert time.monotonic() < deadline, "the server's worker outlived it"
        time.sleep(0.05)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False
