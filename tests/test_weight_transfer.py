"""Weights sent GPU to GPU with vLLM's weight-transfer engine (`trainer/transfer.py`,
`molt_proxy/transfer.py`): what of it runs without a GPU.

The transfer itself (vLLM's NCCL or CUDA IPC engines) needs CUDA and is exercised only by
`scripts/gpu_check.sh`. Here: which transport a trainer picks, and the exact message sequence
the trainer's client (`ProxyClient`, called in the order vLLM's `TrainerWeightTransferEngine`
calls it) makes the proxy send to each replica, on two stand-in vLLMs that record every call:
ranks per replica, pause before the update, the version on finish, resume, the refresh timed
from start to finish in `molt_proxy_refresh_seconds` as for files; a group a replica left
refused before anything is paused; phases out of order refused.
"""

from __future__ import annotations

import inspect
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from molt_proxy import transfer
from molt_proxy.config import Settings
from molt_proxy.transfer import TransferClient
from molt_proxy.upstream import Upstream
from tests.helpers import write_checkpoint
from tests.inprocess import mock_vllm, qwen3_tokenizer_dir, serve_app
from trainer.transfer import GroupRefused, ProxyClient, choose

NCCL_INIT = {
    "master_address": "10.0.0.1",
    "master_port": 29500,
    "rank_offset": 1,
    "world_size": 3,
    "packed": True,
}
"""What vLLM's NCCL trainer engine sends (`worker_init_payload`): workers from rank 1."""
NCCL_UPDATE = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]]}


def test_the_transport_is_the_one_asked_for_only_where_it_can_work():
    assert choose("files", cuda=True, num_workers=1, has_vllm=True) == ("files", "asked for")
    assert choose("nccl", cuda=True, num_workers=1, has_vllm=True)[0] == "nccl"
    assert choose("ipc", cuda=True, num_workers=1, has_vllm=True)[0] == "ipc"
    assert choose("nccl", cuda=False, num_workers=1, has_vllm=True) == (
        "files", "nccl needs CUDA in the trainer; it has none",
    )  # fmt: skip
    assert choose("ipc", cuda=True, num_workers=2, has_vllm=True) == (
        "files", "ipc is for one trainer process; the 2 FSDP workers send files",
    )  # fmt: skip
    assert choose("nccl", cuda=True, num_workers=1, has_vllm=False)[0] == "files"


def test_upstream_speaks_the_transfer_routes():
    for name, declared in vars(TransferClient).items():
        if inspect.isfunction(declared) and declared.__qualname__.startswith("TransferClient."):
            spoken = getattr(Upstream, name)
            assert inspect.iscoroutinefunction(spoken), name
            assert (
                inspect.signature(spoken).parameters.keys() == inspect.signature(declared).parameters.keys()
            )


def calls(url: str) -> list[list]:
    return httpx.get(f"{url}/_calls", timeout=10).json()


def refresh_seconds(url: str) -> tuple[float, float]:
    """The count and sum of the proxy's `molt_proxy_refresh_seconds` histogram."""
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text)
    samples = {s.name: s.value for f in families if f.name == "molt_proxy_refresh_seconds" for s in f.samples}
    return samples["molt_proxy_refresh_seconds_count"], samples["molt_proxy_refresh_seconds_sum"]


def wait_until(check, what: str) -> None:
    deadline = time.monotonic() + 20
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


class Clock:
    """`molt_proxy.transfer`'s `time`: monotonic seconds that the test sets."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


def test_each_phase_reaches_every_replica_in_order_with_its_own_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    clock = Clock()
    monkeypatch.setattr(transfer, "time", clock)
    model = qwen3_tokenizer_dir()
    with mock_vllm(model) as first, mock_vllm(model) as second:
        settings = Settings(model=str(model), upstreams=[first, second], db_path=tmp_path / "p.db")
        with serve_app(settings) as url:
            client = ProxyClient(url, {})
            with pytest.raises(httpx.HTTPStatusError) as wrong:
                client.init_weight_transfer_engine({**NCCL_INIT, "world_size": 2})
            assert wrong.value.response.status_code == 409
            assert wrong.value.response.json()["error"] == {
                "message": "'world_size' is 2, but the trainer and 2 healthy replicas make 3",
                "type": "conflict_error",
                "param": "init_info.world_size",
                "code": None,
            }
            with pytest.raises(httpx.HTTPStatusError) as early:  # no group yet
                client.update_weights(NCCL_UPDATE)
            assert early.value.response.json()["error"]["message"] == "'update' must follow start, not 'none'"

            client.init_weight_transfer_engine(NCCL_INIT)  # the group forms at 100 s
            client.weights = (str(write_checkpoint(tmp_path / "v1")), 1)
            clock.now = 160.0
            client.start_weight_update()
            clock.now = 162.5
            client.update_weights(NCCL_UPDATE)
            assert refresh_seconds(url) == (0, 0.0)  # not before `finish`
            clock.now = 163.25
            client.finish_weight_update("1")
            assert refresh_seconds(url) == (1, 3.25)  # timed from `start`, not from the group's forming
            for upstream, rank in ((first, 1), (second, 2)):
                assert calls(upstream) == [
                    ["/init_weight_transfer_engine", {"init_info": {**NCCL_INIT, "rank_offset": rank}}],
                    ["/pause?mode=keep", None],
                    ["/start_weight_update", None],
                    ["/update_weights", {"update_info": NCCL_UPDATE}],
                    ["/finish_weight_update", {"weight_version": "1"}],
                    ["/resume", None],
                ]
            health = httpx.get(f"{url}/health", timeout=10).json()["replicas"]
            assert [r["weight_version"] for r in health] == [1, 1]
            # The store has the folder and version: a lower version is refused, as for files.
            stale = httpx.post(f"{url}/v1/admin/weights", json={"path": client.weights[0], "version": 0})
            assert stale.status_code == 400, stale.text


def test_a_group_that_a_replica_left_is_refused_before_anything_is_paused(tmp_path: Path):
    model = qwen3_tokenizer_dir()
    with ExitStack() as stack:
        first = stack.enter_context(mock_vllm(model))
        second_stack = stack.enter_context(ExitStack())
        second = second_stack.enter_context(mock_vllm(model))
        settings = Settings(
            model=str(model), upstreams=[first, second], db_path=tmp_path / "p.db", health_interval_s=0.1
        )
        url = stack.enter_context(serve_app(settings))
        client = ProxyClient(url, {})
        client.init_weight_transfer_engine(NCCL_INIT)
        second_stack.close()  # the second replica goes away: the watcher takes it out
        wait_until(
            lambda: not httpx.get(f"{url}/health", timeout=10).json()["replicas"][1]["healthy"],
            "the second replica is taken out",
        )
        client.weights = (str(write_checkpoint(tmp_path / "v1")), 1)
        with pytest.raises(GroupRefused) as refused:
            client.start_weight_update()
        assert str(refused.value) == (
            f"replicas {second} left the weight-transfer group: refresh through files"
        )
        assert [path for path, _ in calls(first)] == ["/init_weight_transfer_engine"]  # not paused
