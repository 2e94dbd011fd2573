"""Training metrics: one JSON line per step, optionally the same as TensorBoard scalars, a
progress line, and the reward curve."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class MetricsLog:
    """`metrics.jsonl` at `path`, and with `tensorboard` every numeric field of each record as a
    TensorBoard scalar in that folder too, under its own name (nested fields as `a/b`), at the
    record's `step` and `time`. Generic over the fields: a new metric shows up in both. The one
    exception is `eval_reward` ({version: mean}): one `eval_reward` curve at step = version."""

    def __init__(self, path: Path, tensorboard: Path | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.board: Any = None  # a SummaryWriter, for runs that ask (checked before each use)
        if tensorboard is not None:
            from torch.utils.tensorboard import SummaryWriter  # only for runs that ask

            self.board = SummaryWriter(str(tensorboard))

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.board is not None:
            step, walltime = record.get("step"), record.get("time")
            for name, value in scalars({k: v for k, v in record.items() if k != "eval_reward"}):
                if name not in ("step", "time"):
                    self.board.add_scalar(name, value, global_step=step, walltime=walltime)
            self._board_evaluations(record.get("eval_reward", {}), walltime)

    def add_evaluations(self, eval_reward: dict[str, float]) -> None:
        """Evaluations that came after the last record (the final weights'): merged into its
        `eval_reward` (a version in both takes these means), so that metrics.jsonl keeps one
        record per step taken. The file is replaced whole: a reader sees it before or after.
        With no record (no step taken) they go to the log instead."""
        records = read(self.path)
        last = records[-1] if records else {}
        earlier = last.get("eval_reward", {})
        if records:
            last["eval_reward"] = {**earlier, **eval_reward}
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
            os.replace(tmp, self.path)
        else:
            log.info("evaluation reward by weight version, no step taken: %s", eval_reward)
        if self.board is not None:
            changed = {v: r for v, r in eval_reward.items() if earlier.get(v) != r}
            self._board_evaluations(changed, walltime=None)  # logged now

    def _board_evaluations(self, eval_reward: dict[str, float], walltime: float | None) -> None:
        for version, reward in eval_reward.items():
            self.board.add_scalar("eval_reward", reward, global_step=int(version), walltime=walltime)
        self.board.flush()  # readable while the run goes on


def scalars(record: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """The numeric fields of a record (booleans as 0/1), nested dicts flattened to `a/b`."""
    for key, value in record.items():
        if isinstance(value, dict):
            yield from scalars(value, f"{prefix}{key}/")
        elif isinstance(value, int | float):
            yield f"{prefix}{key}", float(value)


def read(path: Path) -> list[dict[str, Any]]:
    if not Path(path).exists():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def progress_line(record: dict[str, Any], max_steps: int) -> str:
    """One step's line. Its count is of steps done (`max_steps` counts those): taken, skipped
    (nothing to learn: a solved batch) and dropped; the skipped and dropped ones are named, as
    they write no line of their own."""
    done = record.get("steps_done", record["step"])
    bar = "█" * int(done / max_steps * 20) + "·" * (20 - int(done / max_steps * 20))
    other = f" ({done - record['step']} skipped or dropped)" if done != record["step"] else ""
    return (
        f"step {done:>4}/{max_steps}{other} {bar} reward {record['reward_mean']:+.3f} "
        f"| {record['tokens_per_s']:,.0f} tok/s | kl {record.get('approx_kl', 0.0):.4f} "
        f"| entropy {record.get('entropy', 0.0):.3f} | staleness {record['staleness_mean']:.2f} "
        f"| refresh {record.get('refresh_s', 0.0):.2f}s"
    )


def summary_line(out_dir: Path) -> str:
    """What a finished run did with its steps, from its checkpoint's state (the steps skipped
    after the last metrics line included): read without torch, for any progress display."""
    try:
        state = json.loads((Path(out_dir) / "checkpoint" / "state.json").read_text())
    except FileNotFoundError:
        return "no step taken"
    skipped = state.get("skipped_steps", {})
    line = f"{state['step']} steps taken"
    if skipped:
        reasons = ", ".join(f"{n} {reason.replace('_', ' ')}" for reason, n in sorted(skipped.items()))
        line += f", {sum(skipped.values())} skipped ({reasons}: nothing to learn, weights unchanged)"
    flat, filtered = state.get("dropped_flat_groups", 0), state.get("dropped_filtered_groups", 0)
    if flat or filtered:
        line += f", groups dropped: {flat} flat (every reward equal), {filtered} by the group filter"
    return line


def plot_reward_curve(records: list[dict[str, Any]], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    rewards = [r["reward_mean"] for r in records]
    window = max(1, len(rewards) // 10)
    smooth = [
        sum(rewards[max(0, i - window + 1) : i + 1]) / len(rewards[max(0, i - window + 1) : i + 1])
        for i in range(len(rewards))
    ]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, rewards, alpha=0.35, label="batch mean reward")
    ax.plot(steps, smooth, linewidth=2, label=f"moving average ({window})")
    evaluated = eval_points(records)
    if evaluated:
        # version k is the policy after k steps: evaluations sit on the step axis
        ax.plot(*zip(*evaluated, strict=True), "o", label="evaluation reward (by weight version)")
    ax.set_xlabel("trainer step")
    ax.set_ylabel("reward")
    ax.set_title("molt-proxy: reward during training")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return Path(out)


def eval_points(records: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """(weight version, mean evaluation reward) of every record's `eval_reward`, by version."""
    return sorted((int(v), r) for record in records for v, r in record.get("eval_reward", {}).items())
