"""Where an attempt's harness runs: directly in its workspace (the default), or isolated
(`--sandbox`): the workspace mounted, the rest of the file system read-only, and no network but
the proxy.

A `Sandbox` rewrites a `CommandHarness`'s command line and environment; the harness and the
runner know nothing else about it. Two kinds:

- `Bubblewrap` (`--sandbox bwrap`): the machine's own file system, read-only, in new
  namespaces (user, pid, network, ipc, uts, cgroup), every capability dropped, never as root
  (`SANDBOX_UID`); the workspace and the attempt's HOME read-write at their own paths; /tmp
  and /run empty and private (but for the checkout, .venv, .tools or Python where they lie
  there, shown through read-only); minimal /dev and /proc. A timeout that kills the command kills
  everything inside (the pid namespace dies with it), even what left the process group.
- `Container` (`--sandbox docker`, `podman`, `docker:IMAGE`): `run --rm --network none` with a
  read-only root, the same mounts, and the checkout, its .venv, .tools and Python bind-mounted
  read-only at their own paths. Built but not run here (no daemon, no registry): see its
  docstring.

No network but the proxy: the sandbox has only its own loopback, and two relays
(`rollout/relay.py`) carry the proxy's one port in through a unix socket, so the harness's
configured URL (`http://127.0.0.1:PORT/s/<id>/v1`) works unchanged inside, and any other
port or address fails. The proxy must therefore be on a loopback address and an unprivileged
port (1024 or more).

This isolates side effects (files, processes, network), it does not hide the machine: the
harness can read what the runner's user can (other workspaces, the task file). Run the
runner as a user that can read only what attempts may see where that matters.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Protocol
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from rollout.harness import Attempt

RELAY = Path(__file__).with_name("relay.py")
CHECKOUT = Path(__file__).resolve().parents[1]
PROBE_TIMEOUT_S = 30.0
PRIVILEGED_PORTS = 1024


class Sandbox(Protocol):
    name: str

    def wrap(
        self, command: list[str], env: dict[str, str], attempt: Attempt
    ) -> tuple[list[str], dict[str, str]]:
        """The command line and environment that run `command` inside the sandbox."""
        ...


class SandboxUnavailable(RuntimeError):
    """A sandbox that cannot run on this machine: the message says what is missing."""


# 1. The bridge to the proxy ---------------------------------------------------------------


def _proxy_address(attempt: Attempt) -> tuple[str, int]:
    """The proxy's host and port, from the session's URL: the one address the sandbox reaches."""
    url = urlsplit(attempt.session.base_url)
    host = url.hostname or ""
    port = url.port or (443 if url.scheme == "https" else 80)
    if host != "localhost" and not (_is_ip(host) and ipaddress.ip_address(host).is_loopback):
        raise SandboxUnavailable(
            f"a sandboxed harness reaches the proxy through its own loopback only, so the proxy must "
            f"be on a loopback address (127.0.0.1, localhost, ::1), not {host!r}"
        )
    if port < PRIVILEGED_PORTS:
        raise SandboxUnavailable(
            f"the relay inside the sandbox takes the proxy's port without privileges, so the proxy "
            f"must be on a port of {PRIVILEGED_PORTS} or more, not {port}"
        )
    return host, port


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _socket_folder() -> Path:
    """A folder for the relays' unix socket, short enough for a socket's path (108 bytes), and
    removed when the runner exits (a killed attempt's relay cannot remove its socket)."""
    folder = Path(tempfile.mkdtemp(prefix="molt-sandbox-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def _bridge(attempt: Attempt) -> tuple[str, str, str]:
    """The relays' two ends, the proxy's address and a fresh unix socket's, and the socket's folder."""
    host, port = _proxy_address(attempt)
    folder = _socket_folder()
    return _tcp(host, port), f"unix:{folder}/proxy.sock", str(folder)


def _relay(listen: str, connect: str, *flags: str) -> list[str]:
    # -I: the relay is standard library only, and nothing of the harness's environment
    # (PYTHONPATH, a user site) changes how it runs.
    return [sys.executable, "-I", str(RELAY), "--listen", listen, "--connect", connect, *flags, "--"]


def _tcp(host: str, port: int) -> str:
    return f"tcp:[{host}]:{port}" if ":" in host else f"tcp:{host}:{port}"


# 2. What of the machine a harness needs --------------------------------------------------


def _machine_paths() -> list[Path]:
    """What a harness needs of the machine inside a container, outermost only: the checkout
    (the relay, Python agents' code), its .venv and .tools (the pinned CLIs) wherever their
    links point, and the Python the .venv runs on."""
    candidates = {
        CHECKOUT,
        (CHECKOUT / ".venv").resolve(),
        (CHECKOUT / ".tools").resolve(),
        Path(sys.prefix).resolve(),
        Path(sys.base_prefix).resolve(),
    }
    kept: list[Path] = []
    for path in sorted(candidates):
        if path.exists() and not any(path.is_relative_to(outer) for outer in kept):
            kept.append(path)
    return kept


PRIVATE_TMPFS = (Path("/tmp"), Path("/run"))
"""The folders bwrap empties for the attempt."""


def _shown_through_tmpfs(paths: list[Path]) -> list[str]:
    """Read-only binds for the machine's paths that an empty /tmp or /run would hide: a checkout
    cloned under /tmp runs its harnesses from its .venv and .tools there, which the sandbox
    would otherwise not find ("bwrap: execvp ...: No such file or directory")."""
    hidden = [path for path in paths if any(path.is_relative_to(tmpfs) for tmpfs in PRIVATE_TMPFS)]
    return [part for path in hidden for part in ("--ro-bind", str(path), str(path))]


# 3. Bubblewrap ----------------------------------------------------------------------------


SANDBOX_UID = 1000
"""Who a root runner's harness is inside bwrap (root outside: what it writes is the runner's).
Not root: a harness that nests a sandbox of its own (Codex runs its commands under bwrap)
can set a user namespace up only as a user, and some CLIs refuse to run as root."""


def _isolation() -> list[str]:
    """Every namespace of its own and no capability (so no port below 1024 either, the proxy's
    included: `_proxy_address`), as `SANDBOX_UID` where the runner is root."""
    user = ["--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)] if os.getuid() == 0 else []
    return ["--unshare-all", "--cap-drop", "ALL", *user]


class Bubblewrap:
    """bwrap (`apt-get install bubblewrap`): no daemon, no image, the machine's own binaries.

    Needs user namespaces (or root); `unavailable()` tries one."""

    name = "bwrap"

    def __init__(self, executable: str = "bwrap") -> None:
        self.executable = shutil.which(executable) or executable  # the harness's PATH may lack it

    @staticmethod
    def unavailable(executable: str = "bwrap") -> str | None:
        """Why bwrap cannot sandbox here, or None where it can."""
        path = shutil.which(executable)
        if path is None:
            return f"{executable}: not installed (apt-get install bubblewrap)"
        probe = [path, "--ro-bind", "/", "/", *_isolation(), "--", "true"]
        return _probe(probe, f"{executable}: cannot make a sandbox here")

    def wrap(
        self, command: list[str], env: dict[str, str], attempt: Attempt
    ) -> tuple[list[str], dict[str, str]]:
        proxy, socket, sockets = _bridge(attempt)
        workspace, home = str(attempt.workspace.absolute()), str(attempt.home.absolute())
        bwrap = [
            self.executable,
            "--ro-bind", "/", "/",
            "--dev", "/dev",
            "--proc", "/proc",
            "--tmpfs", "/tmp",
            "--tmpfs", "/run",  # the host's daemons' sockets (docker's among them) stay out
            # After the empty /tmp and /run: what of theirs the attempt needs shows through.
            *_shown_through_tmpfs(_machine_paths()),
            "--bind", workspace, workspace,
            "--bind", home, home,
            "--bind", sockets, sockets,
            "--chdir", workspace,
            *_isolation(),
            "--die-with-parent",
            "--",
        ]  # fmt: skip
        inside = _relay(proxy, socket)
        outside = _relay(socket, proxy)
        return [*outside, *bwrap, *inside, *command], env


# 4. Containers ----------------------------------------------------------------------------

DEFAULT_IMAGE = "node:20-bookworm-slim"
"""Debian 12's glibc (2.36), as the machine the runner's Python and .venv were built on, and
Node 20 for the npm CLIs of .tools; Python, the .venv and .tools come from the machine,
bind-mounted. Another image: `--sandbox docker:IMAGE` (its glibc no older than the machine's)."""

CLIENT_ENV = ("DOCKER_HOST", "DOCKER_CONTEXT", "DOCKER_CONFIG", "CONTAINER_HOST", "XDG_RUNTIME_DIR")
"""What the engine's client needs of the runner's environment to find its daemon (rootless
podman its storage: hence HOME stays the runner's too)."""


class Container:
    """`docker run` or `podman run`, `--network none`, with the relays for the proxy.

    Built and its command line tested, but never run here: this machine has the docker client
    without a daemon and no registry to pull an image from. The container's end is tied to its
    client's: the client holds the container's stdin open (`-i`) and the relay inside ends when
    it closes (`--lifeline`), since killing `docker run` on a timeout does not stop the container.
    Environment values go on the client's command line (`-e NAME=VALUE`): the session key is
    visible to the machine's `ps` for the attempt's length."""

    def __init__(self, engine: str = "docker", image: str = DEFAULT_IMAGE) -> None:
        self.name = engine
        self.engine = shutil.which(engine) or engine
        self.image = image

    @staticmethod
    def unavailable(engine: str) -> str | None:
        """Why `engine` cannot run containers here, or None where it can."""
        path = shutil.which(engine)
        if path is None:
            return f"{engine}: not installed"
        return _probe([path, "info"], f"{engine}: no daemon answers `{engine} info`")

    def wrap(
        self, command: list[str], env: dict[str, str], attempt: Attempt
    ) -> tuple[list[str], dict[str, str]]:
        proxy, socket, sockets = _bridge(attempt)
        workspace, home = str(attempt.workspace.absolute()), str(attempt.home.absolute())
        mounts = [f"{workspace}:{workspace}", f"{home}:{home}", f"{sockets}:{sockets}"]
        mounts += [f"{path}:{path}:ro" for path in _machine_paths()]
        run = [
            self.engine, "run", "--rm", "-i", "--init",
            "--network", "none",
            "--read-only", "--tmpfs", "/tmp", "--tmpfs", "/run",
            "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
            "--user", f"{os.getuid()}:{os.getgid()}",
            "--workdir", workspace,
            *(part for mount in mounts for part in ("--volume", mount)),
            *(part for name, value in env.items() for part in ("--env", f"{name}={value}")),
            self.image,
        ]  # fmt: skip
        inside = _relay(proxy, socket, "--lifeline")
        outside = _relay(socket, proxy, "--hold-stdin")
        client_env = {name: os.environ[name] for name in ("PATH", "HOME", *CLIENT_ENV) if name in os.environ}
        return [*outside, *run, *inside, *command], client_env


# 5. By name -------------------------------------------------------------------------------

ENGINES = ("bwrap", "podman", "docker")
"""`auto`'s order: bwrap needs neither a daemon nor an image."""


def sandbox(name: str) -> Sandbox:
    """The sandbox `--sandbox NAME` names: `bwrap`, `docker`, `podman` (`docker:IMAGE`,
    `podman:IMAGE` for another image than `DEFAULT_IMAGE`), or `auto`: the first of `ENGINES`
    that works here. Raises `SandboxUnavailable` saying what is missing."""
    engine, colon, image = name.partition(":")
    if colon and not image:
        engine = ""  # `docker:` names no image
    if engine == "auto" and not colon:
        reasons = []
        for candidate in ENGINES:
            try:
                return sandbox(candidate)
            except SandboxUnavailable as exc:
                reasons.append(str(exc))
        raise SandboxUnavailable("no sandbox works here: " + "; ".join(reasons))
    if engine == "bwrap" and not colon:
        reason = Bubblewrap.unavailable()
        built: Sandbox = Bubblewrap()
    elif engine in ("docker", "podman"):
        reason = Container.unavailable(engine)
        built = Container(engine, image or DEFAULT_IMAGE)
    else:
        raise SandboxUnavailable(
            f"unknown sandbox {name!r}: expected bwrap, docker, podman, docker:IMAGE, podman:IMAGE or auto"
        )
    if reason is not None:
        raise SandboxUnavailable(reason)
    return built


def _probe(command: list[str], failure: str) -> str | None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{failure} ({exc})"
    if done.returncode == 0:
        return None
    said = (done.stderr.strip() or done.stdout.strip()).splitlines()
    return f"{failure} ({said[-1] if said else f'exit code {done.returncode}'})"
