"""The async training loop: stream → complete groups → advantages → step → checkpoint →
refresh vLLM. Runs as a Ray actor; agents keep running against the proxy all the while.

Versions: the policy after k optimizer steps is version k. Each refresh labels vLLM's weights
with the trainer's version, so every sampled token carries the version that produced it and
staleness (trainer version − token version) is exact.
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from trainer import checkpoint
from trainer.advantage import Estimator, compute_advantages, update_baseline
from trainer.batch import collate
from trainer.buffer import Group, GroupBuffer
from trainer.config import TrainerConfig
from trainer.metrics import MetricsLog, plot_reward_curve, read
from trainer.source import TrajectoryStream

log = logging.getLogger(__name__)
_BASELINE_DECAY = 0.9


def group_advantages(groups: list[Group], estimator: Estimator, baseline: float | None) -> list[float]:
    """One advantage per trajectory: computed over the group's sessions (one reward each) and
    shared by all segments of a session."""
    advantages = []
    for group in groups:
        rewards = {t["session_id"]: t["reward"] for t in group.trajectories}
        sessions = list(rewards)
        values = compute_advantages([rewards[s] for s in sessions], estimator, baseline=baseline or 0.0)
        by_session = dict(zip(sessions, values, strict=True))
        advantages += [by_session[t["session_id"]] for t in group.trajectories]
    return advantages


class Trainer:
    def __init__(self, config: TrainerConfig):
        torch.manual_seed(config.seed)
        random.seed(config.seed)
        self.config = config
        self.policy = _make_policy(config)
        self.checkpoint_dir = config.out_dir / "checkpoint"
        self.metrics = MetricsLog(config.out_dir / "metrics.jsonl")
        self.state = checkpoint.TrainerState()
        restored = checkpoint.load(self.checkpoint_dir)
        if restored is not None:
            self.state, policy_state = restored
            self.policy.load_state_dict(policy_state)
            log.info(
                "resumed at step %d (version %d, cursor %d)",
                self.state.step,
                self.state.version,
                self.state.cursor,
            )

    def run(self) -> dict[str, Any]:
        config, state = self.config, self.state
        buffer = GroupBuffer(config.group_size, config.group_timeout_s)
        for trajectory in state.pending:
            buffer.add(trajectory)
        self._refresh()  # vLLM must serve this policy, whatever it served before (a restart)
        stream = TrajectoryStream(config.proxy_url, state.cursor, admin_key=config.admin_key).start()
        ready: list[Group] = []
        try:
            while state.step < config.max_steps:
                trajectory = stream.get(timeout_s=0.2)
                if trajectory is not None:
                    buffer.add(trajectory)
                    state.cursor = trajectory["seq"]
                ready += buffer.pop_ready()
                if len(ready) >= config.groups_per_step:
                    groups, ready = ready[: config.groups_per_step], ready[config.groups_per_step :]
                    self._step(groups, pending=[t for g in ready for t in g.trajectories] + buffer.pending())
        finally:
            stream.stop()
        records = read(self.metrics.path)
        if records:
            plot_reward_curve(records, config.out_dir / "reward_curve.png")
        return {"step": state.step, "version": state.version, "cursor": state.cursor}

    def _step(self, groups: list[Group], pending: list[dict[str, Any]]) -> None:
        config, state = self.config, self.state
        started = time.monotonic()
        trajectories = [t for g in groups for t in g.trajectories]
        advantages = group_advantages(groups, config.estimator, state.baseline)
        rewards = [t["reward"] for t in trajectories]
        if config.estimator == Estimator.REINFORCE_BASELINE:
            state.baseline = update_baseline(state.baseline, rewards, _BASELINE_DECAY)
        batch = collate(trajectories, advantages)
        micro_batches = batch.split(max(1, -(-len(trajectories) // config.micro_batch_size)))
        step_metrics = self.policy.train_step(micro_batches, state.version, config.loss)
        compute_s = time.monotonic() - started
        state.step += 1
        state.version += 1
        state.trained.append([t["seq"] for t in trajectories])
        state.pending = pending
        checkpoint.save(self.checkpoint_dir, state, self.policy.state_dict())
        refresh_s = self._refresh() if state.step % config.refresh_every == 0 else 0.0
        sampled = [
            (state.version - 1) - v
            for t in trajectories
            for v, m in zip(t["weight_versions"], t["loss_mask"], strict=True)
            if m
        ]
        record = {
            "step": state.step,
            "version": state.version,
            "cursor": state.cursor,
            "trajectories": len(trajectories),
            "reward_mean": sum(rewards) / len(rewards),
            "reward_max": max(rewards),
            "tokens": int(batch.attention_mask.sum()),
            "sampled_tokens": len(sampled),
            "tokens_per_s": float(batch.attention_mask.sum()) / max(compute_s, 1e-9),
            "staleness_mean": sum(sampled) / max(1, len(sampled)),
            "staleness_max": max(sampled, default=0),
            "compute_s": compute_s,
            "refresh_s": refresh_s,
            "step_s": time.monotonic() - started,
            "time": time.time(),
            **step_metrics,
        }
        self.metrics.write(record)

    def _refresh(self) -> float:
        """Save the current weights and have the proxy load them into every replica."""
        started = time.monotonic()
        folder = (self.config.out_dir / "weights" / f"v{self.state.version}").resolve()
        self.policy.save_weights(folder)
        headers = {"authorization": f"Bearer {self.config.admin_key}"} if self.config.admin_key else {}
        response = httpx.post(
            f"{self.config.proxy_url.rstrip('/')}/v1/admin/weights",
            json={"path": str(folder), "version": self.state.version},
            headers=headers,
            timeout=600,
        )
        response.raise_for_status()
        _prune_weights(folder.parent, keep=folder)
        return time.monotonic() - started


def _prune_weights(folder: Path, keep: Path) -> None:
    """vLLM has loaded `keep`; older pushed weights are no longer needed."""
    import shutil

    for old in folder.iterdir():
        if old != keep and old.name.startswith("v"):
            shutil.rmtree(old, ignore_errors=True)


def _make_policy(config: TrainerConfig):
    if config.num_workers > 1:
        from trainer.workers import DataParallelPolicy

        return DataParallelPolicy(
            config.num_workers, config.model, lr=config.lr, max_grad_norm=config.max_grad_norm
        )
    from trainer.policy import Policy

    return Policy(config.model, lr=config.lr, max_grad_norm=config.max_grad_norm)
