"""Shared fixtures: tiny taught models, one real vLLM server per model, proxy processes.

Everything here is real: vLLM runs on CPU (DESIGN §9), the proxy runs as its own process
(`python -m molt_proxy serve --upstream ...`) so tests can kill it, and clients speak HTTP.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from molt_proxy.launcher import VLLMServer, free_port, wait_healthy
from molt_proxy.tinymodel import build_tiny_model, tokenizer_source

MAX_MODEL_LEN = 2048


def _model(tmp_path_factory: pytest.TempPathFactory, arch: str) -> Path:
    if tokenizer_source(arch) is None:
        pytest.skip(f"the real {arch} tokenizer is not in ../shared/tokenizers")
    return build_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch)


@pytest.fixture(scope="session")
def qwen3_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _model(tmp_path_factory, "qwen3")


@pytest.fixture(scope="session")
def llama_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _model(tmp_path_factory, "llama")


def _vllm(model: Path, log_dir: Path) -> Iterator[VLLMServer]:
    server = VLLMServer(str(model), max_model_len=MAX_MODEL_LEN, log_path=log_dir / "vllm.log")
    with server:
        yield server


@pytest.fixture(scope="session")
def qwen3_vllm(qwen3_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    yield from _vllm(qwen3_model, tmp_path_factory.mktemp("vllm-qwen3"))


@pytest.fixture(scope="session")
def llama_vllm(llama_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    yield from _vllm(llama_model, tmp_path_factory.mktemp("vllm-llama"))


class ProxyProcess:
    """`molt-proxy serve --upstream ...` as a child process that a test may kill -9.
    `upstream` is one vLLM URL or a list of them (replicas); an empty list: `serve` launches
    vLLM itself (give `start` the minutes that takes)."""

    def __init__(self, model: Path, upstream: str | list[str], db: Path, args: list[str]):
        self.model, self.upstream, self.db, self.args = model, upstream, db, args
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 120) -> ProxyProcess:
        urls = [self.upstream] if isinstance(self.upstream, str) else self.upstream
        command = [
            sys.executable, "-m", "molt_proxy", "serve", "--model", str(self.model),
            *[arg for url in urls for arg in ("--upstream", url)],
            "--port", str(self.port), "--db", str(self.db), "--verify-prompt-ids", *self.args,
        ]  # fmt: skip
        log = open(self.db.with_suffix(".log"), "ab")
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        what = f"molt-proxy (log: {self.db.with_suffix('.log')})"
        wait_healthy(self.url, self.process, timeout_s, what=what)
        return self

    def kill9(self) -> None:
        assert self.process is not None
        os.killpg(os.getpgid(self.process.pid), signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(os.getpgid(self.process.pid), signal.SIGTERM)
            self.process.wait(timeout=30)

    def base_url(self, session: str | None = None) -> str:
        return f"{self.url}/s/{session}/v1" if session else f"{self.url}/v1"


@pytest.fixture
def start_proxy(tmp_path: Path) -> Iterator:
    """Start a proxy in front of a vLLM server: `start_proxy(model, vllm, *flags)`."""
    started: list[ProxyProcess] = []

    def start(model: Path, vllm: VLLMServer | list[str], *args: str) -> ProxyProcess:
        """`vllm` is the server, or a list of vLLM URLs for a proxy over several replicas."""
        upstream = vllm if isinstance(vllm, list) else vllm.url
        proxy = ProxyProcess(model, upstream, tmp_path / f"proxy{len(started)}.db", list(args)).start()
        started.append(proxy)
        return proxy

    yield start
    for proxy in started:
        proxy.stop()


@pytest.fixture(scope="session")
def digits_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny model with the small self-trained byte-level tokenizer (fast to train)."""
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny-digits"), "qwen3", fallback_tokenizer=True, teach=False
    )


@pytest.fixture(scope="session")
def digits_vllm(digits_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    server = VLLMServer(
        str(digits_model), max_model_len=256, log_path=tmp_path_factory.mktemp("vllm-digits") / "vllm.log"
    )
    with server:
        yield server
