"""The trainer's unit tests: one small random model per test process, one torch thread each.
torch and devtools are imported inside the fixtures, so a run that collects nothing here pays
nothing for them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Qwen3 with the small self-trained byte-level tokenizer (395 tokens), for
    the tests of what a training step computes, whatever the vocabulary. With the real
    151k-token Qwen3 vocabulary the LM head held 99% of the weights: every forward, backward
    and AdamW step cost seconds, and `tests/trainer/test_policy.py` and `test_loop.py` took
    minutes of the fast tier."""
    from devtools import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("small-qwen3"), "qwen3", fallback_tokenizer=True)


@pytest.fixture(autouse=True)
def one_torch_thread(request: pytest.FixtureRequest) -> Iterator[None]:
    """The fast tier's tests run torch on tiny tensors, too small to split between threads:
    a second one only spins, and under `-n 2` (a worker per core) or on a busy machine it
    takes a core from the other worker. Side by side under load 10, test_policy, test_loop
    and test_reference took 17.4 CPU seconds with torch's default two threads, 5.2 with one.
    The slow tier (`vllm`: a trainer's real run) keeps torch's default."""
    if request.node.get_closest_marker("vllm") is not None:
        yield
        return
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
