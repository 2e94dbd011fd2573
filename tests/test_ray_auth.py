"""Joining a Ray cluster that has token authentication on (issue 26, item 18), on a real
`ray start --head` on this machine: Ray 2.60 turns token auth on when the head has a token
(here written by `ray get-auth-token --generate`, as any earlier local `ray.init()` would), and
`serve --ray-address` / the trainer's `--ray-address`, joining by address, were refused with
only "Failed to connect to Ray cluster". Now the error names the fix, and the fix works.

The head runs with a private HOME (its own ~/.ray/auth_token, none of this user's) and a
short temp dir (Ray's socket paths are long), every port it listens on free, in its own
process group, which the test ends (`ray stop` would end every Ray node of this machine).
The joins run in subprocesses side by side, each with Ray's GCS connect retries cut to 2 s
(20 s by default) by `RAY_gcs_server_port_wait_time_s`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from molt_proxy.launcher import RayNode, free_port

RAY = str(Path(sys.executable).with_name("ray"))


def ray_head(folder: Path, home: Path) -> tuple[RayNode, int]:
    """`ray start --head` on free ports with `home` as HOME, and its port."""
    port = free_port()
    args = ["--head", "--port", str(port), "--temp-dir", str(folder), "--include-dashboard", "false"]
    args += ["--num-cpus", "1", "--disable-usage-stats", "--object-store-memory", str(100 * 2**20)]
    for flag in ("--ray-client-server-port", "--dashboard-port", "--dashboard-agent-listen-port"):
        args += [flag, str(free_port())]
    return RayNode(args, folder / "head.log", {"HOME": str(home)}), port


def python(code: str, home: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh interpreter with HOME `home`, RAY_AUTH_MODE as `env` says (unset by
    default), and 2 s of GCS connect retries."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    environment |= {"HOME": str(home), "RAY_gcs_server_port_wait_time_s": "2", **env}
    return subprocess.run(
        [sys.executable, "-c", code], env=environment, capture_output=True, text=True, timeout=120
    )


@pytest.mark.timeout(300)
def test_a_cluster_with_token_auth_is_named_with_its_fix_for_serve_and_the_trainer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    folder = Path(tempfile.mkdtemp(prefix="rta", dir="/tmp"))
    home = folder / "home"
    home.mkdir()
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    made = subprocess.run(
        [RAY, "get-auth-token", "--generate"],
        env={**os.environ, "HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    token = made.stdout.strip()
    assert made.returncode == 0 and (home / ".ray" / "auth_token").read_text() == token
    head, port = ray_head(folder, home)
    head.start()
    try:
        assert "Token authentication is enabled for this Ray cluster" in head.log_path.read_text()
        address = f"127.0.0.1:{port}"
        join = f"from molt_proxy.ray_replicas import join_cluster; join_cluster({address!r})"
        argv = ["trainer", "--proxy-url", "http://127.0.0.1:9", "--model", str(folder / "none")]
        argv += ["--train-out", str(folder / "train"), "--ray-address", address]
        elsewhere = folder / "elsewhere"
        elsewhere.mkdir()
        check = f"{join}; print('joined')"
        run_trainer = (
            f"import sys, runpy; sys.argv = {argv!r}; runpy.run_module('trainer', run_name='__main__')"
        )
        # Five fresh interpreters, each its imports and 2 s of connect retries: side by side.
        with ThreadPoolExecutor(max_workers=5) as pool:
            runs = [
                pool.submit(python, join, home),
                pool.submit(python, run_trainer, home),
                pool.submit(python, check, home, RAY_AUTH_MODE="token"),
                pool.submit(python, check, elsewhere, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token),
                pool.submit(python, check, elsewhere, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * len(token)),
            ]
            serve, trainer, joined_here, joined, wrong = (run.result() for run in runs)

        assert serve.returncode == 1
        last = serve.stderr.strip().splitlines()[-1]
        assert last.startswith(f"molt_proxy.ray_replicas.RayTokenAuthError: the Ray cluster at {address} ")
        assert "(RAY_AUTH_MODE unset)" in last and "run this with RAY_AUTH_MODE=token" in last
        assert "`ray get-auth-token` on the head" in last and "RAY_AUTH_MODE=disabled" in last
        # what Ray itself said, further up: the chain is kept
        assert "Failed to connect to Ray cluster" in serve.stderr and "InvalidAuthToken" in serve.stderr

        # the trainer's --ray-address joins the same way, before it loads anything
        assert trainer.returncode == 1
        assert (
            trainer.stderr.strip()
            .splitlines()[-1]
            .startswith(f"molt_proxy.ray_replicas.RayTokenAuthError: the Ray cluster at {address} ")
        )

        # the fix named works: RAY_AUTH_MODE=token and the token from this HOME's ~/.ray, or in
        # RAY_AUTH_TOKEN from anywhere (another HOME, as on another machine)
        assert joined_here.stdout.strip() == "joined"
        assert joined.stdout.strip() == "joined"
        # a wrong token is named the same way, with the mode it ran under
        assert "RayTokenAuthError" in wrong.stderr and "(RAY_AUTH_MODE=token)" in wrong.stderr
    finally:
        head.stop()
        shutil.rmtree(folder, ignore_errors=True)
