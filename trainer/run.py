"""Run the trainer as a Ray actor and show its progress: `python -m trainer` or
`molt-proxy serve --train`. Offline (`python -m trainer --trajectories FILE`) it runs in this
process, without Ray: one model, no proxy to follow, nothing to place; it starts faster and
nothing but the seed decides what it does."""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

import ray

from molt_proxy.flags import add_flags, from_flags
from molt_proxy.ray_replicas import join_cluster
from trainer.config import TrainerConfig
from trainer.loop import Trainer, resolve_plugins
from trainer.metrics import progress_line, read, summary_line
from trainer.plugins import PluginError

log = logging.getLogger(__name__)


def train(config: TrainerConfig, *, show_progress: bool = True) -> dict[str, Any]:
    """Start (or join, with `ray_address`) Ray, run the trainer actor to `max_steps`."""
    # "local" starts a fresh instance: a bare init() may try to join the cluster that a killed
    # earlier run left behind, and wait for its dead head. A cluster that wants Ray's auth
    # token is named as such (`join_cluster`), not left as "Failed to connect".
    if config.ray_address:
        join_cluster(config.ray_address, include_dashboard=False)
    else:
        start_ray()
    # The actor does its own threading; it must not wait for a Ray CPU slot on small machines.
    # Sending weights GPU to GPU (`trainer/transfer.py`), it asks Ray for a GPU of its own if
    # the cluster has one, so that replicas Ray placed (`serve --ray-address`) are on others.
    gpus = 1 if config.weight_transfer != "files" and ray.cluster_resources().get("GPU", 0) >= 1 else 0
    actor = ray.remote(num_cpus=0, num_gpus=gpus)(Trainer).remote(config)
    result_ref = actor.run.remote()
    shown = 0
    try:
        while True:
            done, _ = ray.wait([result_ref], timeout=1.0)
            records = read(config.out_dir / "metrics.jsonl")
            if show_progress:
                for record in records[shown:]:
                    print(progress_line(record, config.max_steps), flush=True)
            shown = len(records)
            if done:
                return ray.get(result_ref)
    finally:
        # On Ctrl-C too: the actor's trajectory stream from `serve --train`'s own proxy would
        # otherwise hold the proxy's graceful shutdown open (30 s, until its thread is given up).
        ray.kill(actor)


_NODE_TIMED_OUT = "timed out during startup"
"""What Ray 2.60's `ray.init` raises when its raylet has not registered within 30 s."""


_RAY_STARTS = 3


def start_ray() -> None:
    """`ray.init` of a fresh local instance, tried again (`_RAY_STARTS` in all) when its node
    timed out starting.

    Ray waits a fixed 30 s (not configurable) for the raylet it just launched to register with
    its GCS; on a small machine busy with vLLM and the agents that wait can run out (seen in CI
    on 2 cores: "The current node timed out during startup"). Any other failure is raised at
    once."""
    for attempt in range(1, _RAY_STARTS + 1):
        try:
            ray.init(address="local", ignore_reinit_error=True, include_dashboard=False)
            return
        except Exception as exc:
            if _NODE_TIMED_OUT not in str(exc) or attempt == _RAY_STARTS:
                raise
            log.warning("Ray's node timed out starting (try %d of %d); starting again", attempt, _RAY_STARTS)
            ray.shutdown()


def train_offline(config: TrainerConfig, *, show_progress: bool = True) -> dict[str, Any]:
    """Run the trainer in this process on `config.trajectories`, to the file's end or `max_steps`."""
    result = Trainer(config).run()
    if show_progress:
        for record in read(config.out_dir / "metrics.jsonl"):
            print(progress_line(record, config.max_steps), flush=True)
    return result


def parser() -> argparse.ArgumentParser:
    """`python -m trainer`'s command line: a flag per `TrainerConfig` field (`molt_proxy/flags.py`)."""
    command = argparse.ArgumentParser(prog="python -m trainer", description="Train from a molt-proxy stream.")
    add_flags(command, TrainerConfig)
    return command


def main(argv: list[str] | None = None) -> int:
    command = parser()
    args = command.parse_args(argv)
    if not args.proxy_url and not args.trajectories:
        command.error("give at least one --proxy-url, or --trajectories FILE")
    if args.proxy_url and args.trajectories:
        command.error("--trajectories trains offline: it follows no --proxy-url")
    started = time.monotonic()
    first, *more = args.proxy_url or [""]
    try:
        config = from_flags(TrainerConfig, args, proxy_url=first, more_proxy_urls=more)
        resolve_plugins(config)  # a wrong name or signature: an error now, not in the actor
    except (ValueError, PluginError) as exc:
        command.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    (train_offline if config.trajectories is not None else train)(config)
    took = time.monotonic() - started
    print(f"done in {took:.0f} s: {summary_line(config.out_dir)}; out: {config.out_dir}")
    return 0
