"""Shared fixtures: tiny taught models, one real vLLM server per model, proxy processes.

Everything here is real: vLLM runs on CPU (DESIGN §9), the proxy runs as its own process
(`launcher.ProxyServer`: `python -m molt_proxy serve --upstream ...`) so tests can kill it,
and clients speak HTTP.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools import build_tiny_model, tokenizer_source
from molt_proxy.launcher import ProxyServer, VLLMServer

MAX_MODEL_LEN = 2048


def _model(tmp_path_factory: pytest.TempPathFactory, arch: str) -> Path:
    if tokenizer_source(arch) is None:
        pytest.skip(f"the real {arch} tokenizer is not in $MOLT_PROXY_TOKENIZERS or ../shared/tokenizers")
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


class ProxyProcess(ProxyServer):
    """`molt-proxy serve --upstream ... --verify-prompt-ids` that a test may kill -9, its output
    in `db`'s `.log`. `upstream` is one vLLM URL or a list of them (replicas); an empty list:
    `serve` launches vLLM itself (give `start` the minutes that takes)."""

    def __init__(self, model: Path, upstream: str | list[str], db: Path, args: list[str]):
        urls = [upstream] if isinstance(upstream, str) else upstream
        super().__init__(
            model, upstreams=urls, db=db, args=["--verify-prompt-ids", *args], log_path=db.with_suffix(".log")
        )
        self.model, self.db = model, db

    def kill9(self) -> None:
        """kill -9 the proxy (and only it: vLLM servers it launched run in their own groups)."""
        self.kill()


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
