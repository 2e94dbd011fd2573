"""The scale path: data-parallel training over Ray actors, each rank one FSDP2 shard.

Owns the process group and the split of a step across ranks. `DataParallelPolicy` has the
surface of `Policy` that the loop uses (ppo_step, save_weights, state_dict, load_state_dict),
so the loop does not know which one it drives. Each `TrainWorker` is a Ray actor holding a
`Policy` with `fsdp=True`; the collectives run over gloo on CPU and NCCL on GPU. It does not
choose data, compute the loss or talk to vLLM.

The update equals the single-process one: the driver counts D, the loss's denominator (kept
tokens or sequences) of each mini-batch, before anything runs, and every rank divides its loss
by that global D; FSDP2 is set to sum (not average) the ranks' gradients (`policy._shard`), so
the reduced gradient is the full-batch gradient, and clipping, the zero-gradient skip and
AdamW then see exactly what one process would. Each rank runs the same PPO schedule
(`Policy.ppo_step`: pi_old of its own shards, then epochs x mini-batches updates), so the
collectives line up.

Each micro-batch is split across the ranks balanced by tokens (`Batch.split`); a rank left
without rows gets one masked token, so it still runs every forward, backward and collective
and contributes a zero gradient.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray
import torch
import torch.distributed as dist

from trainer.batch import Batch
from trainer.config import LossConfig
from trainer.loss import loss_denominator
from trainer.policy import Policy, merge_metrics


@ray.remote
class TrainWorker:
    """One rank: joins the process group in `setup`, then runs its shard of every call.

    Every method is collective: the driver calls it on all ranks at once, or the ranks hang.
    """

    def __init__(self, rank: int, world_size: int, model_dir: str, policy_kwargs: dict[str, Any]):
        self.rank, self.world_size = rank, world_size
        self.model_dir, self.policy_kwargs = model_dir, policy_kwargs
        self.policy: Policy | None = None

    def address(self) -> tuple[str, int]:
        """Where rank 0 listens for the rendezvous: this node's IP and a free port on it."""
        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def setup(self, master_addr: str, master_port: int) -> None:
        # Ray gives a GPU actor its own device as cuda:0 (CUDA_VISIBLE_DEVICES), others none.
        on_gpu = torch.cuda.is_available()
        if on_gpu:
            torch.cuda.set_device(0)
        dist.init_process_group(
            "nccl" if on_gpu else "gloo",
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=self.rank,
            world_size=self.world_size,
        )
        device = "cuda" if on_gpu else "cpu"
        self.policy = Policy(self.model_dir, device=device, fsdp=True, **self.policy_kwargs)

    def ppo_step(
        self,
        mini_batches: list[list[Batch]],
        current_version: int,
        loss: LossConfig,
        epochs: int,
        denominators: list[int],
    ) -> dict[str, float]:
        return self._policy.ppo_step(
            mini_batches, current_version, loss, epochs=epochs, denominators=denominators
        )

    def save_weights(self, out_dir: str) -> None:
        self._policy.save_weights(out_dir)

    def state_dict(self) -> dict[str, Any]:
        return self._policy.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._policy.load_state_dict(state)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    @property
    def _policy(self) -> Policy:
        if self.policy is None:
            raise RuntimeError("TrainWorker.setup has not run")
        return self.policy


class DataParallelPolicy:
    """`Policy`'s surface over `num_workers` FSDP2 ranks (Ray actors, one CPU or GPU each).

    Uses the Ray cluster the caller connected to (a local one is started on first use).
    Every micro-batch is split across the ranks by tokens; it may have fewer rows than ranks.
    `policy_kwargs` go to each rank's `Policy` (lr, max_grad_norm, weight_decay, betas).
    """

    def __init__(
        self,
        num_workers: int,
        model_dir: str | Path,
        *,
        use_gpu: bool | None = None,
        **policy_kwargs: Any,
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        use_gpu = torch.cuda.is_available() if use_gpu is None else use_gpu
        # `@ray.remote` made the class an actor class; mypy does not apply class decorators
        worker = TrainWorker.options(num_cpus=1, num_gpus=1 if use_gpu else 0)  # type: ignore[attr-defined]
        self.workers = [
            worker.remote(rank, num_workers, str(model_dir), policy_kwargs) for rank in range(num_workers)
        ]
        master_addr, master_port = ray.get(self.workers[0].address.remote())
        ray.get([w.setup.remote(master_addr, master_port) for w in self.workers])

    def ppo_step(
        self,
        mini_batches: Sequence[Sequence[Batch]],
        current_version: int,
        loss: LossConfig,
        *,
        epochs: int = 1,
    ) -> dict[str, float]:
        """`Policy.ppo_step` over the ranks: rank r trains on shard r of every micro-batch.
        Metrics are merged over the ranks as over micro-batches."""
        denominators = [
            sum(loss_denominator(mb.loss_mask, mb.weight_versions, current_version, loss) for mb in mini)
            for mini in mini_batches
        ]
        shards = [[mb.split(len(self.workers)) for mb in mini] for mini in mini_batches]
        results = ray.get(
            [
                w.ppo_step.remote(
                    [[parts[rank] for parts in mini] for mini in shards],
                    current_version,
                    loss,
                    epochs,
                    denominators,
                )
                for rank, w in enumerate(self.workers)
            ]
        )
        return merge_metrics(results)

    def save_weights(self, out_dir: str | Path) -> None:
        """Gathered from all ranks, written by rank 0: its filesystem must be the one vLLM reads."""
        ray.get([w.save_weights.remote(str(out_dir)) for w in self.workers])

    def state_dict(self) -> dict[str, Any]:
        return ray.get([w.state_dict.remote() for w in self.workers])[0]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ref = ray.put(state)  # stored once, read by every rank
        ray.get([w.load_state_dict.remote(ref) for w in self.workers])

    def close(self) -> None:
        """Leave the process group and stop the actors."""
        ray.get([w.close.remote() for w in self.workers])
        for w in self.workers:
            ray.kill(w)
        self.workers = []
