"""The async training loop: stream → whole sessions, complete groups → advantages
(`credit.py`) → step → checkpoint → refresh vLLM → the advantages posted to the proxies for
their viewers (`report.py`). Runs as a Ray actor; agents keep running against the proxy all
the while.

Steps and versions: a trainer step takes `groups_per_step` groups and runs PPO's schedule on
them (`Policy.ppo_step`: pi_old once, then `ppo_epochs` x `mini_batches` optimizer steps).
The policy after k trainer steps is version k; each refresh labels vLLM's weights with it, so
every sampled token carries the version that produced it and staleness (trainer version −
token version) counts the trainer steps (weight pushes) the sampler was behind, whatever the
number of optimizer steps in each. `max_staleness` bounds that, vLLM is refreshed once per
step (or every `refresh_every`), and `TrainerState.optimizer_steps` counts the optimizer steps
separately. With the defaults (one epoch, one mini-batch) versions equal optimizer steps.

Steps that would change nothing are skipped, counted (`TrainerState.skipped_steps`, in every
metrics record) and logged: their trajectories are consumed (the cursor moves on, they are
not trained on later) but no optimizer step runs, the step and version stay, and vLLM is not
refreshed. A step is skipped when every advantage is 0 and the loss has no other term
("zero_advantage"; with `--entropy-coef` or `--kl-coef` in the loss above 0 the step still
runs for those terms: the entropy bonus and the pull towards the reference act on every kept
token whatever its advantage), every sampled token is left out by how it was sampled
("untrainable", `sampling.py`), every one left is past `max_staleness` ("stale"), or every
update's gradient was exactly 0, i.e. every kept token was masked by its importance weight
("masked"). Groups are dropped and counted before a step
instead (`_admit`): a group whose every sampled token is past `max_staleness` when it becomes
ready, or while it waits for a step; and with `drop_flat_groups` (DAPO's dynamic sampling) a
group whose episodes all had the same outcome, which group-relative estimators give advantage
0 everywhere: the step waits for `groups_per_step` groups with something to learn.
`max_steps` counts steps taken and skipped alike, and every `groups_per_step` flat groups
dropped as one more: a solved task (every reward equal, so every advantage 0) skips or drops
everything, and the run must still end.
"""

from __future__ import annotations

import importlib.util
import logging
import random
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from molt_proxy.types import Trajectory
from trainer import checkpoint, credit, evaluation, plugins, transfer
from trainer.advantage import Estimator, update_baseline
from trainer.batch import Batch, collate
from trainer.buffer import Group, GroupBuffer
from trainer.config import TrainerConfig
from trainer.credit import is_flat, reward_kl
from trainer.loss import count_loss_tokens
from trainer.metrics import MetricsLog, plot_reward_curve, read
from trainer.plugins import Plugin
from trainer.report import AdvantageReport
from trainer.source import ExportSource, TrajectoryStream

log = logging.getLogger(__name__)
_BASELINE_DECAY = 0.9


def replicas_behind(proxy_url: str, version: int, headers: dict[str, str]) -> list[str]:
    """The vLLM replicas (URLs) not serving weight `version`, from the proxy's `/health`. The
    proxy answers a refresh some replicas failed with 200 and the ones loaded; it takes a
    failed one out of routing and gives it the current weights before it serves again (when
    it passes a health check), so a trainer only has to notice and report it."""
    health = httpx.get(f"{proxy_url.rstrip('/')}/health", headers=headers, timeout=30)
    health.raise_for_status()
    return [r["url"] for r in health.json()["replicas"] if r["weight_version"] != version]


def session_rewards(trajectories: list[Trajectory]) -> list[float]:
    """One reward per rewarded session, in order of first appearance: a session's segments
    share its reward, and a mean over segments would weigh a session by its segment count
    (a session of 2 segments rewarded 1 beside one of 1 segment rewarded 0: 0.667, not 0.5).
    `reward_mean` and the running baseline average these."""
    rewards: dict[str, float] = {}
    for t in trajectories:
        if t.reward is not None:
            rewards.setdefault(t.session_id, t.reward)
    return list(rewards.values())


def has_fresh_tokens(group: Group, version: int, max_staleness: int | None) -> bool:
    """Whether any sampled token of the group is at most `max_staleness` versions old."""
    return any(
        m and (max_staleness is None or version - v <= max_staleness)
        for t in group.trajectories
        for v, m in zip(t.weight_versions, t.loss_mask, strict=True)
    )


class Trainer:
    def __init__(self, config: TrainerConfig):
        torch.manual_seed(config.seed)
        random.seed(config.seed)
        self.config = config
        self.plugins = resolve_plugins(config)
        """The algorithm's plug-ins, resolved and checked before anything loads: a wrong name
        or signature stops the run here, before its first step."""
        self.transport, why = transfer.choose(
            config.weight_transfer,
            cuda=torch.cuda.is_available(),
            num_workers=config.num_workers,
            has_vllm=importlib.util.find_spec("vllm") is not None,
        )
        (log.info if self.transport == config.weight_transfer else log.warning)(
            "weights go to vLLM through %s (%s)", self.transport, why
        )
        self._engine: transfer.EngineRefresh | None = None
        # The engines send from GPU memory: the one-process policy trains there too.
        self.policy = _make_policy(config, "cpu" if self.transport == "files" else "cuda")
        self.checkpoint_dir = config.out_dir / "checkpoint"
        self.metrics = MetricsLog(config.out_dir / "metrics.jsonl", tensorboard=config.tensorboard)
        self.state = checkpoint.TrainerState()
        self.replicas_behind = 0
        """vLLM replicas that missed the last refresh (`replicas_behind`), in every record."""
        self.report = AdvantageReport(config.proxy_urls, config.admin_key)
        """Posts each step's advantages to the proxies, for their viewers."""
        self.evaluating = False
        """Whether this run has taken evaluation episodes: it then waits for the final weights'."""
        self.recorded_evaluations: list[tuple[int, float]] = []
        """The (version, reward) pairs in the last record's `eval_reward`."""
        restored = checkpoint.load(self.checkpoint_dir)
        if restored is not None:
            self.state, policy_state = restored
            self.policy.load_state_dict(policy_state)
            log.info(
                "resumed at step %d (version %d, cursors %s)",
                self.state.step,
                self.state.version,
                self.state.cursors,
            )
        self.state.follow(len(config.proxy_urls) or 1)  # offline: the file's cursor

    def run(self) -> dict[str, Any]:
        config, state = self.config, self.state
        # Offline, time stands still until the file is read to its end (`ExportSource`).
        clock = (lambda: 0.0) if config.trajectories is not None else time.monotonic
        buffer = GroupBuffer(config.group_size, config.group_timeout_s, clock=clock)
        for trajectory in state.pending:
            buffer.add(trajectory)
        self._refresh()  # vLLM must serve this policy, whatever it served before (a restart)
        if config.trajectories is not None:
            stream: TrajectoryStream | ExportSource = ExportSource(config.trajectories, state.cursors[0])
        else:
            stream = TrajectoryStream(config.proxy_urls, state.cursors, admin_key=config.admin_key)
        stream.start()
        ready: list[Group] = []
        try:
            while self._steps_done() < config.max_steps:
                taken = stream.get(timeout_s=0.2)
                if taken is not None:
                    self._take(*taken, buffer)
                elif isinstance(stream, ExportSource) and stream.exhausted:  # a file: `--trajectories`
                    ready += self._admit(buffer.pop_all())
                    if len(ready) < config.groups_per_step:
                        break  # the file is done; what is left waits in the checkpoint
                ready += self._admit(buffer.pop_ready())
                if len(ready) >= config.groups_per_step:
                    groups, ready = ready[: config.groups_per_step], ready[config.groups_per_step :]
                    self._step(groups, pending=[t for g in ready for t in g.trajectories] + buffer.pending())
                    ready = self._admit(ready)  # the version moved on: a waiting group may be stale now
            self._wind_down(stream, buffer, ready)
        finally:
            stream.stop()
        records = read(self.metrics.path)
        if records:
            plot_reward_curve(records, config.out_dir / "reward_curve.png")
        return {"step": state.step, "version": state.version, "cursors": state.cursors}

    def _take(self, source: int, trajectory: Trajectory, buffer: GroupBuffer) -> bool:
        """Take a trajectory off proxy `source`'s stream: an evaluation episode (`evaluation.py`)
        is logged, never trained on; any other goes to the buffer. True for an evaluation."""
        self.state.cursors[source] = trajectory.seq
        if not evaluation.is_evaluation(trajectory):
            buffer.add(trajectory)
            if self.config.proxy_urls:
                self.report.taken(source, trajectory.trajectory_id)
            return False
        evaluation.take(self.state, trajectory)
        self.evaluating = True
        return True

    def _wind_down(
        self, stream: TrajectoryStream | ExportSource, buffer: GroupBuffer, ready: list[Group]
    ) -> None:
        """After the last step, in a run with evaluation episodes: those of the final weights
        (`evaluation.py`), until none came for `evaluation.WAIT_S` (at most `group_timeout_s` in
        all: an evaluator that never stops must not keep the run alive), added to the last
        record with any left from skipped steps. What else arrives meanwhile is pending work in
        the checkpoint, as after a step: a resumed run trains on it."""
        state = self.state
        if not (self.evaluating or state.evaluations):
            return
        deadline = time.monotonic() + self.config.group_timeout_s
        quiet_until = time.monotonic() + evaluation.WAIT_S
        while self.config.trajectories is None and time.monotonic() < min(quiet_until, deadline):
            taken = stream.get(timeout_s=0.2)
            if taken is not None and self._take(*taken, buffer):
                quiet_until = time.monotonic() + evaluation.WAIT_S
        if state.evaluations:
            self.recorded_evaluations += state.evaluations
            state.evaluations = []
            self.metrics.add_evaluations(evaluation.means(self.recorded_evaluations))
        state.pending = [t for g in ready for t in g.trajectories] + buffer.pending()
        checkpoint.save(self.checkpoint_dir, state, self.policy.state_dict())

    def _admit(self, groups: list[Group]) -> list[Group]:
        """The groups a step can learn from; the others are dropped, their trajectories
        consumed, and counted: every sampled token stale (`dropped_stale_groups`), or, with
        `drop_flat_groups`, every episode's outcome the same (`dropped_flat_groups`), or
        refused by the `--group-filter` plug-in (`dropped_filtered_groups`)."""
        state, kept = self.state, []
        group_filter = self.plugins["group_filter"]
        for group in groups:
            if not has_fresh_tokens(group, state.version, self.config.loss.max_staleness):
                state.dropped_stale_groups += 1
                log.info("dropped group %s: every sampled token is stale", group.group_id)
            elif self.config.drop_flat_groups and is_flat(
                group, by_turn=self.config.turn_discount is not None
            ):
                state.dropped_flat_groups += 1
                log.info("dropped group %s: every episode's outcome is the same", group.group_id)
            elif group_filter is not None and not self._filter_takes(group_filter, group):
                state.dropped_filtered_groups += 1
                log.info("dropped group %s: %s refused it", group.group_id, group_filter)
            else:
                kept.append(group)
                continue
            state.consumed += [t.trajectory_id for t in group.trajectories]
        return kept

    def _filter_takes(self, group_filter: Plugin, group: Group) -> bool:
        where = f"step {self.state.step + 1}, group {group.group_id}"
        taken = plugins.call(group_filter, group.trajectories, where)
        if not isinstance(taken, bool):
            raise plugins.PluginError(f"{group_filter} returned {taken!r} at {where}: True or False")
        return taken

    def _steps_done(self) -> int:
        """Steps taken and skipped, and a step per `groups_per_step` groups dropped as flat or
        by the group filter (a filter that refuses everything must not keep a run alive)."""
        state = self.state
        dropped = (state.dropped_flat_groups + state.dropped_filtered_groups) // self.config.groups_per_step
        return state.step + sum(state.skipped_steps.values()) + dropped

    @property
    def _by_turn(self) -> bool:
        return self.config.turn_discount is not None

    @property
    def _loss_beyond_advantages(self) -> bool:
        """Whether the loss has a term that does not scale with the advantage: an entropy bonus,
        or a KL penalty in the loss (in the reward it is part of the advantages)."""
        loss = self.config.loss
        return loss.entropy_coef > 0 or (loss.kl_coef > 0 and loss.kl_in == "loss")

    def _step(self, groups: list[Group], pending: list[Trajectory]) -> None:
        config, state = self.config, self.state
        started = time.monotonic()
        trajectories = [t for g in groups for t in g.trajectories]
        batch = collate(
            trajectories,
            [0.0] * len(trajectories),
            train_greedy=config.train_greedy,
            train_constrained=config.constrained_turns == "train",
        )
        penalties, reward_metrics = self._reward_kl(batch, trajectories)
        shaped = credit.shape(
            groups,
            self.plugins["reward_shaping"],
            penalties,
            by_turn=config.turn_discount is not None,
            step=state.step + 1,
        )
        advantage = self.plugins["advantage"] or credit.builtin_advantage(
            config.estimator, state.baseline, config.turn_discount
        )
        values = credit.advantages(advantage, shaped, step=state.step + 1)
        batch.advantages = credit.advantage_tensor(values, trajectories, batch.input_ids.shape[1])
        if self.plugins["reward_shaping"] is not None:
            reward_metrics["shaped_reward_mean"] = _mean_by_session([t for g in shaped for t in g])
        state.pending = pending
        if not bool(batch.advantages.any()) and not self._loss_beyond_advantages:
            return self._skip(trajectories, "zero_advantage")
        if not batch.loss_mask.any():
            return self._skip(trajectories, "untrainable")
        if count_loss_tokens(batch.loss_mask, batch.weight_versions, state.version, config.loss) == 0:
            return self._skip(trajectories, "stale")
        step_metrics = self.policy.ppo_step(
            self._mini_batches(batch), state.version, config.loss, epochs=config.ppo_epochs
        )
        if step_metrics["optimizer_steps"] == 0:
            return self._skip(trajectories, "masked")
        compute_s = time.monotonic() - started
        rewards = session_rewards(trajectories)
        if config.advantage is None and config.estimator == Estimator.REINFORCE_BASELINE:
            state.baseline = update_baseline(state.baseline, rewards, _BASELINE_DECAY)
        state.step += 1
        state.version += 1
        state.optimizer_steps += int(step_metrics["optimizer_steps"])
        state.trained.append([t.trajectory_id for t in trajectories])
        evaluations = evaluation.means(state.evaluations)
        self.recorded_evaluations, state.evaluations = state.evaluations, []
        checkpoint.save(self.checkpoint_dir, state, self.policy.state_dict())
        refresh_s = self._refresh() if state.step % config.refresh_every == 0 else 0.0
        if config.proxy_urls:
            self.report.post(trajectories, batch.advantages, state.step, state.version)
        sampled = [
            (state.version - 1) - v
            for t in trajectories
            for v, m in zip(t.weight_versions, t.loss_mask, strict=True)
            if m
        ]
        record = {
            "step": state.step,
            "steps_done": self._steps_done(),  # `max_steps` counts these (`_steps_done`)
            "version": state.version,
            "cursors": state.cursors,
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
            **reward_metrics,
            **batch.sampling.counts(),
            "optimizer_steps_total": state.optimizer_steps,
            "dropped_stale_groups": state.dropped_stale_groups,
            "dropped_flat_groups": state.dropped_flat_groups,
            "dropped_filtered_groups": state.dropped_filtered_groups,
            "replicas_behind": self.replicas_behind,
            "advantage_posts_failed": self.report.failed,
            **({"eval_reward": evaluations} if evaluations else {}),
            **{f"skipped_steps_{reason}": n for reason, n in sorted(state.skipped_steps.items())},
        }
        self.metrics.write(record)

    def _reward_kl(
        self, batch: Batch, trajectories: list[Trajectory]
    ) -> tuple[list[list[float]] | None, dict[str, float]]:
        """With `--kl-in reward`: the KL penalty of each trajectory's turns, and `kl_ref` to log."""
        loss = self.config.loss
        if loss.kl_coef == 0 or loss.kl_in != "reward":
            return None, {}
        penalties, mean = reward_kl(self.policy, batch, trajectories, loss, self.config.micro_batch_size)
        return penalties, {"kl_ref": mean}

    def _mini_batches(self, batch: Batch) -> list[list[Batch]]:
        """`mini_batches` parts of the step's rows (balanced by tokens), each split into
        micro-batches of about `micro_batch_size` rows."""
        parts = batch.split(min(self.config.mini_batches, len(batch)))
        return [part.split(-(-len(part) // self.config.micro_batch_size)) for part in parts]

    def _skip(self, trajectories: list[Trajectory], reason: str) -> None:
        """A step that would change nothing: its trajectories are consumed, the weights, step
        and version stay, vLLM is not refreshed; counted and checkpointed."""
        state = self.state
        state.skipped_steps[reason] = state.skipped_steps.get(reason, 0) + 1
        state.consumed += [t.trajectory_id for t in trajectories]
        checkpoint.save(self.checkpoint_dir, state, self.policy.state_dict())
        log.info(
            "skipped a step (%s): %d trajectories consumed, weights and version %d unchanged",
            reason,
            len(trajectories),
            state.version,
        )

    def _refresh(self) -> float:
        """Save the current weights (or adapter) and have every proxy load them into each of
        its replicas. Offline there is no vLLM: nothing to do."""
        if self.config.trajectories is not None:
            return 0.0
        started = time.monotonic()
        folder = (self.config.out_dir / "weights" / f"v{self.state.version}").resolve()
        self.policy.save_weights(folder)
        headers = {"authorization": f"Bearer {self.config.admin_key}"} if self.config.admin_key else {}
        behind = []
        for url in self.config.proxy_urls:  # the weight-transfer engine's group is the first proxy's
            if url != self.config.proxy_url or not self._sent_by_engine(folder, headers):
                response = httpx.post(
                    f"{url.rstrip('/')}/v1/admin/weights",
                    json={"path": str(folder), "version": self.state.version},
                    headers=headers,
                    timeout=600,
                )
                response.raise_for_status()
            behind += replicas_behind(url, self.state.version, headers)
        # vLLM may reload an adapter it evicted from its cache from the folder (molt_proxy/lora.py)
        _prune_weights(folder.parent, keep=2 if self.config.lora_rank else 1)
        if behind:
            log.warning(
                "weights v%d are not on %s: the proxy keeps them out of routing and reloads them "
                "once they pass a health check",
                self.state.version,
                ", ".join(behind),
            )
        self.replicas_behind = len(behind)
        return time.monotonic() - started

    def _sent_by_engine(self, folder: Path, headers: dict[str, str]) -> bool:
        """Send the weights with vLLM's weight-transfer engine if that is the transport (the
        group formed at the first refresh); False: they go through files."""
        if self.transport == "files":
            return False
        if self._engine is None:
            self._engine = transfer.EngineRefresh(
                self.transport, self.config.proxy_url, headers, self.policy.model
            )
        return self._engine.send(str(folder), self.state.version)


def resolve_plugins(config: TrainerConfig) -> dict[str, Plugin | None]:
    """The run's plug-ins by kind, checked (`plugins.resolve`); None where the built-in
    settings decide (`--estimator`, `--drop-flat-groups`, no shaping). The loss is resolved
    here for its check only: each process resolves it again by name (`policy.loss_plugin`)."""
    plugins.resolve("loss", config.loss.loss)
    return {
        kind: None if getattr(config, kind) is None else plugins.resolve(kind, getattr(config, kind))
        for kind in ("advantage", "group_filter", "reward_shaping")
    }


def _mean_by_session(trajectories: list[Trajectory]) -> float:
    rewards = session_rewards(trajectories)
    return sum(rewards) / len(rewards)


def _prune_weights(folder: Path, keep: int) -> None:
    """vLLM has loaded the newest; all but the newest `keep` pushed folders are no longer needed."""
    import shutil

    pushed = sorted((p for p in folder.iterdir() if p.name.startswith("v")), key=lambda p: int(p.name[1:]))
    for old in pushed[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _make_policy(config: TrainerConfig, device: str):
    if config.num_workers > 1:
        from trainer.workers import DataParallelPolicy

        return DataParallelPolicy(
            config.num_workers, config.model, lr=config.lr, max_grad_norm=config.max_grad_norm
        )
    if config.lora_rank is not None:
        from trainer.lora import LoraPolicy

        return LoraPolicy(
            config.model,
            rank=config.lora_rank,
            alpha=config.lora_alpha,
            targets=config.lora_target_modules,
            lr=config.lr,
            max_grad_norm=config.max_grad_norm,
            reference=config.loss.kl_coef > 0,
        )
    from trainer.policy import Policy

    return Policy(
        config.model,
        lr=config.lr,
        max_grad_norm=config.max_grad_norm,
        reference=config.loss.kl_coef > 0,
        device=device,
        train_only=config.train_only,
    )
