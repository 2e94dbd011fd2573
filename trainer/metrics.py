"""Training metrics: one JSON line per step, optionally the same as TensorBoard scalars, a
progress line, and the reward curve."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class MetricsLog:
    """`metrics.jsonl` at `path`, and with `tensorboard` every numeric field of each record as a
    TensorBoard scalar in that folder too, under its own name (nested fields as `a/b`), at the
    record's `step` and `time`. Generic over the fields: a new metric shows up in both."""

    def __init__(self, path: Path, tensorboard: Path | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.board = None
        if tensorboard is not None:
            from torch.utils.tensorboard import SummaryWriter  # only for runs that ask

            self.board = SummaryWriter(str(tensorboard))

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.board is not None:
            step, walltime = record.get("step"), record.get("time")
            for name, value in scalars(record):
                if name not in ("step", "time"):
                    self.board.add_scalar(name, value, global_step=step, walltime=walltime)
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
    done = record["step"] / max_steps
    bar = "█" * int(done * 20) + "·" * (20 - int(done * 20))
    return (
        f"step {record['step']:>4}/{max_steps} {bar} reward {record['reward_mean']:+.3f} "
        f"| {record['tokens_per_s']:,.0f} tok/s | kl {record.get('approx_kl', 0.0):.4f} "
        f"| entropy {record.get('entropy', 0.0):.3f} | staleness {record['staleness_mean']:.2f} "
        f"| refresh {record.get('refresh_s', 0.0):.2f}s"
    )


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
    evaluated = sorted((int(v), r) for record in records for v, r in record.get("eval_reward", {}).items())
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
