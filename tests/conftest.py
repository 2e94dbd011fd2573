"""Shared fixtures: tiny taught models, one real vLLM server per model, proxies.

Everything here is real: vLLM runs on CPU (DESIGN §9); the proxy is the real app built from
`serve`'s flags, served by uvicorn in a thread of the test process (`start_proxy`), or its
own process (`ProxyProcess`: `python -m molt_proxy serve --upstream ...`) where a test kills
it; clients speak HTTP. (The app in memory, in front of the stand-in vLLM: `tests/inprocess.py`.)
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from filelock import FileLock

from molt_proxy import lora
from molt_proxy.auth import load_keys
from molt_proxy.cli import parser, settings_from_args
from molt_proxy.launcher import ProxyServer, VLLMServer

if TYPE_CHECKING:
    from devtools import Arch

# The app (and the vLLM parsers it imports) and `devtools` (torch) are imported where they are
# used, not here: pytest-xdist's controller loads this file too, and runs no test.

MAX_MODEL_LEN = 2048
"""The context of the Llama server and of the stand-in vLLM in the in-process tests."""
QWEN3_MAX_MODEL_LEN = 32768
"""The shared Qwen3 server's: Claude Code's default prompt alone is about 19k tokens (the
proxy lowers its `max_tokens`, 32,000, to what is left). The tiny model's KV cache takes
512 bytes per token."""


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object]) -> Path:
    """The folder `build` fills, built once per test run: under xdist by whichever worker asks
    first, in the run's shared temporary folder, while the others wait for it."""
    shared = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        shared = shared.parent
    folder, done = shared / name, shared / f"{name}.built"
    with FileLock(f"{folder}.lock"):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # a build that died half-way
            folder.mkdir()
            build(folder)
            done.touch()
    return folder


@pytest.fixture(autouse=True)
def _root_logging_restored() -> Iterator[None]:
    """Undo what a test's in-process `molt-proxy` command did to the root logger: its handler
    writes to that test's captured stderr, which pytest closes, and a server thread of a later
    test logging through it printed "--- Logging error --- I/O operation on closed file"."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def only_for_slow_tests(request: pytest.FixtureRequest) -> None:
    """Fail a test not marked `vllm` (`pytest_collection_modifyitems`) that needs a tiny model
    built (minutes), whether it asked for one by name (`request.getfixturevalue`, which
    collection cannot see) or through a fixture of its own, instead of costing the fast tier
    (`-m "not vllm"`) minutes. A session fixture's request names the test that set it up."""
    item = getattr(request, "_pyfuncitem", None)
    if item is not None and item.get_closest_marker("vllm") is None:
        pytest.fail(
            f"{item.nodeid} builds a tiny model ({request.fixturename}) but is not marked vllm: "
            "add it to SLOW_TESTS in tests/conftest.py",
            pytrace=False,
        )


def _model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, arch: Arch) -> Path:
    from devtools import build_tiny_model, tokenizer_source

    only_for_slow_tests(request)
    if tokenizer_source(arch) is None:
        pytest.skip(f"the real {arch} tokenizer is not in $MOLT_PROXY_TOKENIZERS or ../shared/tokenizers")
    return built_once(tmp_path_factory, f"tiny-{arch}", lambda folder: build_tiny_model(folder, arch))


@pytest.fixture(scope="session")
def qwen3_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _model(request, tmp_path_factory, "qwen3")


@pytest.fixture(scope="session")
def untaught_qwen3_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Qwen3 with the real tokenizer, never taught: a weak policy, as RL starts
    from, for the paths a grammar forces (tool calls, JSON) that it would never take itself."""
    from devtools import build_tiny_model, tokenizer_source

    only_for_slow_tests(request)
    if tokenizer_source("qwen3") is None:
        pytest.skip("the real qwen3 tokenizer is not in $MOLT_PROXY_TOKENIZERS or ../shared/tokenizers")
    return built_once(
        tmp_path_factory, "tiny-qwen3-untaught", lambda folder: build_tiny_model(folder, "qwen3", teach=False)
    )


@pytest.fixture(scope="session")
def untaught_qwen3_vllm(
    untaught_qwen3_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VLLMServer]:
    """With the taught server's context: OpenCode's and Qwen Code's prompts are 7k and 17k tokens
    (`tests/rollout/test_more_harnesses.py`)."""
    log_dir = tmp_path_factory.mktemp("vllm-qwen3-untaught")
    yield from _vllm(untaught_qwen3_model, log_dir, QWEN3_MAX_MODEL_LEN)


@pytest.fixture(scope="session")
def llama_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _model(request, tmp_path_factory, "llama")


def _vllm(model: Path, log_dir: Path, max_model_len: int = MAX_MODEL_LEN) -> Iterator[VLLMServer]:
    server = VLLMServer(str(model), max_model_len=max_model_len, log_path=log_dir / "vllm.log")
    with server:
        yield server


@pytest.fixture(scope="session")
def qwen3_vllm(qwen3_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    yield from _vllm(qwen3_model, tmp_path_factory.mktemp("vllm-qwen3"), QWEN3_MAX_MODEL_LEN)


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


@dataclass
class AppProxy:
    """The real proxy app (`serve`'s flags, settings and `create_app`) served by uvicorn in a
    thread of the test process: no interpreter to boot per test. Tests that kill -9 the
    proxy or check `serve` itself use `ProxyProcess`."""

    url: str
    model: Path
    db: Path

    def base_url(self, session: str | None = None) -> str:
        return f"{self.url}/s/{session}/v1" if session else f"{self.url}/v1"


@contextmanager
def app_proxy(
    model: Path, upstream: str | list[str], db: Path, args: Sequence[str] = ()
) -> Iterator[AppProxy]:
    """`molt-proxy serve --upstream ... --verify-prompt-ids *args`, in this process."""
    from tests.inprocess import serve_app

    urls = [upstream] if isinstance(upstream, str) else upstream
    argv = ["serve", "--model", str(model), "--db", str(db), "--verify-prompt-ids", *args]
    flags = parser().parse_args(argv + [flag for url in urls for flag in ("--upstream", url)])
    keys = load_keys(flags.admin_key, flags.admin_key_file, flags.agent_key or [], flags.agent_keys_file, {})
    with serve_app(settings_from_args(flags, *keys)) as url:
        yield AppProxy(url, model, db)


@pytest.fixture
def start_proxy(tmp_path: Path) -> Iterator:
    """Start a proxy in front of a vLLM server: `start_proxy(model, vllm, *flags)`."""
    numbers = itertools.count()
    with ExitStack() as started:

        def start(model: Path, vllm: VLLMServer | list[str], *args: str) -> AppProxy:
            """`vllm` is the server, or a list of vLLM URLs for a proxy over several replicas."""
            upstream = vllm if isinstance(vllm, list) else vllm.url
            db = tmp_path / f"proxy{next(numbers)}.db"
            return started.enter_context(app_proxy(model, upstream, db, args))

        yield start


@pytest.fixture(scope="session")
def digits_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny model with the small self-trained byte-level tokenizer (fast to train)."""
    from devtools import build_tiny_model

    only_for_slow_tests(request)
    return built_once(
        tmp_path_factory,
        "tiny-digits",
        lambda folder: build_tiny_model(folder, "qwen3", fallback_tokenizer=True, teach=False),
    )


@pytest.fixture(scope="session")
def digits_vllm(digits_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """With LoRA on (adapters of rank up to 8), which leaves base-model requests and
    `reload_weights` as they were: the trainer's LoRA tests share this server."""
    server = VLLMServer(
        str(digits_model),
        max_model_len=256,
        extra_args=lora.vllm_args(8),
        log_path=tmp_path_factory.mktemp("vllm-digits") / "vllm.log",
    )
    with server:
        yield server


# The files that boot vLLM servers, teach models or train, slowest first (measured with
# `--durations`), so the quick in-process files fill the gaps at the end and both workers
# finish together. With `--dist loadfile --no-loadscope-reorder` the workers take files in this
# order: each starts with one, and takes the next whenever at most two of its tests are left
# to run. One worker spends its first minutes teaching the Qwen3 model most files need
# (`test_supervision.py`'s fourth test asks first), so the other's first files must not need
# it: the line-count learning example (the longest file, about 8 min on a model of its own),
# the README example (one test, so that worker takes the next file at once), the live trainer
# on the same small model, then the Llama model's build and server.
SLOW_FIRST = (
    "test_supervision.py",
    "rollout/test_learn_line_count.py",
    "trainer/test_end_to_end.py",
    "trainer/test_live_vllm.py",
    "test_integrations.py",
    "test_llama_vllm.py",
    "test_ray_replicas.py",
    "trainer/test_workers.py",
    "test_agent_libraries.py",
    "test_exactness.py",
    "test_replicas_vllm.py",
    "test_zero_config.py",
    "trainer/test_sampling_agreement.py",
    "test_durability.py",
    "test_tinymodel.py",
    "test_echo.py",
    "test_streaming.py",
    "test_constrained.py",
    "test_anthropic_vllm.py",
    "test_responses_vllm.py",
    "test_gemini_vllm.py",
    "test_claude_code.py",
    "test_codex.py",
    "rollout/test_cli_harnesses.py",
    "rollout/test_more_harnesses.py",
    "rollout/test_runner.py",
    "test_side_requests.py",
    "rollout/test_sandbox.py",
    "test_agent_logprobs.py",
    "test_errors.py",
)


SLOW_FIXTURES = {
    "qwen3_model", "untaught_qwen3_model", "llama_model", "digits_model",
    "qwen3_vllm", "untaught_qwen3_vllm", "llama_vllm", "digits_vllm",
}  # fmt: skip
"""Fixtures that build (or teach) a tiny model or boot vLLM: minutes on a fresh machine."""
SLOW_FILES = {
    "test_launcher.py", "test_ray_auth.py", "trainer/test_workers.py", "trainer/test_lora.py",
    "trainer/test_end_to_end.py", "rollout/test_learn_line_count.py",
}  # fmt: skip
"""Files that start vLLM, Ray or a trainer themselves, without those fixtures."""
SLOW_TESTS = {"test_tinymodel.py::test_taught_model_greedily_writes_each_scripted_reply_and_vllm_parses_it"}
"""Tests that ask for a slow fixture by name (`request.getfixturevalue`), which collection
cannot see; `only_for_slow_tests` fails any other such test that is not marked."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "vllm: needs a real vLLM server, a taught model, Ray or a trainer (minutes); "
        "`pytest -m 'not vllm'` runs the rest, the in-process tier",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the slow tests `vllm`; order the files `SLOW_FIRST`, then any other file with a
    slow test (one added since the list was measured), then the in-process ones."""
    tests = Path(__file__).parent
    slow_files = set()
    for item in items:
        name = item.path.relative_to(tests).as_posix()
        fixtures = set(getattr(item, "fixturenames", ()))
        test = f"{name}::{getattr(item, 'originalname', item.name)}"
        if name in SLOW_FILES or test in SLOW_TESTS or SLOW_FIXTURES & fixtures:
            item.add_marker(pytest.mark.vllm)
            slow_files.add(name)
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}

    def order(item: pytest.Item) -> int:
        name = item.path.relative_to(tests).as_posix()
        return rank.get(name, len(SLOW_FIRST) + (name not in slow_files))

    items.sort(key=order)
