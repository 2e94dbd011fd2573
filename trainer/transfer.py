"""Refresh vLLM without reading files: the trainer sends its parameters with vLLM's own
weight-transfer engine (`vllm.distributed.weight_transfer`, vLLM 0.32), NCCL between GPUs or
CUDA IPC on a GPU it shares with vLLM, through the proxy's `POST /v1/admin/weights/transfer`
(`molt_proxy/transfer.py` fans each phase out to the replicas).

vLLM's `TrainerWeightTransferEngine` drives the exchange through a client of four calls; here
that client is `ProxyClient`, which turns each into one phase posted to the proxy:

    trainer_init: init_weight_transfer_engine → phase "init" (NCCL: on a side thread, while
                  the trainer opens rank 0 of the group; every replica joins at its rank)
    send_weights: start_weight_update → "start" (version and folder; replicas pause)
                  update_weights → "update" (on a side thread, during the NCCL broadcast)
                  finish_weight_update → "finish" (replicas load, relabel, resume)

The folder is still written (`Policy.save_weights`) before each transfer: the proxy records
it for replicas that come back later outside the group, and for proxy restarts.

Used only where it can work (`choose`): CUDA in the trainer, one trainer process (the
FSDP workers send files), vLLM importable. Anything else, or a group the proxy refuses (a
replica left it: 409 at "start"), refreshes through files. NCCL needs the trainer and every
replica on distinct GPUs (NCCL refuses two ranks on one device); one GPU shared with vLLM
takes "ipc", which vLLM accepts over HTTP only with `VLLM_ALLOW_INSECURE_SERIALIZATION=1`.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

import httpx
import ray
from torch import nn

from trainer.config import Transport

log = logging.getLogger(__name__)


class GroupRefused(Exception):
    """The proxy refused the transfer group (a replica left it): refresh through files."""


def choose(requested: Transport, *, cuda: bool, num_workers: int, has_vllm: bool) -> tuple[Transport, str]:
    """The transport a refresh uses, and why, for `--weight-transfer requested`."""
    if requested == "files":
        return "files", "asked for"
    if not cuda:
        return "files", f"{requested} needs CUDA in the trainer; it has none"
    if num_workers > 1:
        return "files", f"{requested} is for one trainer process; the {num_workers} FSDP workers send files"
    if not has_vllm:
        return "files", f"{requested} needs vLLM's weight-transfer engine importable in the trainer"
    return requested, "asked for, and CUDA and vLLM are here"


class ProxyClient:
    """vLLM's `VLLMWeightSyncClient` over the proxy: each call is one phase (module doc)."""

    def __init__(self, proxy_url: str, headers: dict[str, str], timeout_s: float = 600):
        self.url = f"{proxy_url.rstrip('/')}/v1/admin/weights/transfer"
        self.headers, self.timeout_s = headers, timeout_s
        self.weights: tuple[str, int] | None = None
        """The (folder, version) the next `start_weight_update` announces."""

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        response = httpx.post(self.url, json=body, headers=self.headers, timeout=self.timeout_s)
        if response.status_code == 409 and body["phase"] == "start":
            raise GroupRefused(response.json()["error"]["message"])
        response.raise_for_status()
        return response.json()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._post({"phase": "init", "init_info": init_info})

    def start_weight_update(self) -> None:
        assert self.weights is not None, "set `weights` before a transfer"
        folder, version = self.weights
        self._post({"phase": "start", "path": folder, "version": version})

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        infos = update_info if isinstance(update_info, list) else [update_info]
        if any("ipc_handles" in info for info in infos):
            # pickled for JSON, as vLLM's own HTTP client does (NCCL's metadata is JSON already)
            from vllm.distributed.weight_transfer.clients import _json_safe_update_payload

            update_info = _json_safe_update_payload(update_info)
        self._post({"phase": "update", "update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._post({"phase": "finish"})

    def shutdown_weight_transfer_engine(self) -> None:
        """The proxy keeps no per-group resources beyond the replicas' own; nothing to do."""


def init_info(transport: Transport, replicas: int) -> Any:
    """vLLM's trainer-side init info: NCCL's rendezvous on this host (the trainer is rank 0 of
    1 + `replicas`, one rank per replica: tensor parallelism is not counted), or IPC's."""
    if transport == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return NCCLTrainerInitInfo(
            master_address=ray.util.get_node_ip_address(),  # where every replica's node reaches it
            master_port=port,
            world_size=1 + replicas,
            rank=0,
        )
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

    return IPCTrainerInitInfo(rank=0)


class EngineRefresh:
    """The trainer's end of one transfer group, formed with the replicas up now."""

    def __init__(self, transport: Transport, proxy_url: str, headers: dict[str, str], model: nn.Module):
        from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

        health = httpx.get(f"{proxy_url.rstrip('/')}/health", headers=headers, timeout=30).json()
        replicas = sum(r["healthy"] for r in health["replicas"])
        self.client = ProxyClient(proxy_url, headers)
        self.engine = WeightTransferTrainerFactory.trainer_init(
            init_info(transport, replicas), client=self.client, source=ModuleSource(model)
        )
        log.info("weights go to %d vLLM replicas over %s", replicas, transport)

    def send(self, folder: str, version: int) -> bool:
        """Send the model's weights as `version` (also in `folder`); False: the proxy refused
        the group, refresh through files."""
        self.client.weights = (folder, version)
        try:
            self.engine.send_weights()
        except GroupRefused as exc:
            log.warning("weights v%d go through files: %s", version, exc)
            return False
        return True
