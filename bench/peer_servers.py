"""The peers `bench/peers.py` measures: each installed, pinned, into a venv of its own
(bench/.<name>-venv; never the project's) and started as its docs start it, as a child process.

Agent Lightning's proxy runs through `bench/peer_agentlightning.py` under its venv's Python;
rLLM's gateway through its own console script.
"""

from __future__ import annotations

import secrets
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.common import HOME, PYTHON, ROOT, Child
from molt_proxy.launcher import free_port


@dataclass(frozen=True, slots=True)
class Peer:
    name: str
    package: str
    version: str
    pins: tuple[str, ...] = ()
    """More requirements installed with it, pinned."""

    @property
    def venv(self) -> Path:
        return HOME / "bench" / f".{self.name}-venv"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"


OTEL = ("api", "sdk", "exporter-otlp", "exporter-otlp-proto-http", "exporter-otlp-proto-grpc")
OTEL += ("exporter-otlp-proto-common", "proto")
AGENTLIGHTNING = Peer(
    "agentlightning",
    "agentlightning",
    "0.3.0",
    (
        "litellm[proxy]==1.80.11",
        *(f"opentelemetry-{name}==1.39.1" for name in OTEL),
        "opentelemetry-semantic-conventions==0.60b1",
        "opentelemetry-instrumentation==0.60b1",
    ),
)
"""Agent Lightning 0.3.0 leaves LiteLLM and OpenTelemetry unpinned, and their newest releases
here break it (measured): LiteLLM 1.108.7 records no request headers on its spans, so the proxy
drops every span ("No headers found ... Cannot log to store"), and OpenTelemetry's exporter 1.45
no longer reads the `_endpoint` the proxy points at its store, so spans go to localhost:4318.
Pinned to older releases (Agent Lightning 0.3.0 was tagged 2025-12-24), with which its store
receives the spans."""
RLLM = Peer("rllm", "rllm-model-gateway", "0.1.0")
PEERS = (AGENTLIGHTNING, RLLM)


def ensure(peer: Peer) -> None:
    """Install `peer`, pinned, into its venv unless it is there (minutes, once)."""
    if installed(peer, peer.package) == peer.version:
        return
    subprocess.run([PYTHON, "-m", "venv", str(peer.venv)], check=True)
    pip = [str(peer.python), "-m", "pip", "install", "-q", f"{peer.package}=={peer.version}", *peer.pins]
    subprocess.run(pip, check=True, timeout=1800)


def installed(peer: Peer, package: str) -> str | None:
    """The version of `package` in the peer's venv, or None."""
    if not peer.python.exists():
        return None
    code = f"from importlib.metadata import version; print(version({package!r}))"
    done = subprocess.run([str(peer.python), "-c", code], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


AGENTLIGHTNING_KEY = "sk-" + secrets.token_hex(24)
"""The LiteLLM proxy under Agent Lightning refuses to start without a master key (LiteLLM's
`UnsafeMasterKeyError`); agents send this one."""


def agentlightning_child(upstream: str, model: str) -> tuple[Child, str]:
    """Agent Lightning's proxy and its store server in front of `upstream`, as its example
    starts them (`bench/peer_agentlightning.py serve`); also returns the store's URL."""
    port, store_port = free_port(), free_port()
    command = [str(AGENTLIGHTNING.python), str(ROOT / "bench" / "peer_agentlightning.py"), "serve"]
    command += ["--port", str(port), "--store-port", str(store_port)]
    command += ["--upstream", upstream, "--model", model]
    env = {
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # else LiteLLM fetches its cost map from the internet
        "LITELLM_MASTER_KEY": AGENTLIGHTNING_KEY,
    }
    child = Child("agentlightning", command, f"http://127.0.0.1:{port}", env=env)
    return child, f"http://127.0.0.1:{store_port}"


def rllm_child(upstream: str, db: Path) -> Child:
    """rLLM's gateway in front of `upstream`, as its README starts it:
    `rllm-model-gateway --port P --worker URL/v1 --db-path DB` (SQLite store, the default)."""
    port = free_port()
    for path in db.parent.glob(db.name + "*"):
        path.unlink()
    command = [str(RLLM.venv / "bin" / "rllm-model-gateway"), "--host", "127.0.0.1", "--port", str(port)]
    command += ["--worker", f"{upstream}/v1", "--db-path", str(db), "--log-level", "warning"]
    return Child("rllm", command, f"http://127.0.0.1:{port}")


def new_rollout(store: str) -> str:
    """A rollout in Agent Lightning's store; the path prefix its proxy files spans under."""
    rollout = httpx.post(f"{store}/v1/agl/rollouts", json={"input": {"bench": "peers"}}, timeout=30).json()
    return f"/rollout/{rollout['rollout_id']}/attempt/{rollout['attempt']['attempt_id']}"
