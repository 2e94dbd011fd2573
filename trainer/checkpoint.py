"""Checkpoint and resume: model, optimizer, stream cursor, weight version, buffered work.

Exactly once across restarts: for each proxy the trainer follows, its cursor is the seq of
the last trajectory the trainer took from that proxy's stream, and everything it took but has
not trained on yet (the group buffer) is saved with them (as the stream's JSON, read back as
`Trajectory`). The trajectory ids each step trained on, and those consumed without a step,
are kept too, so a run can prove it.
A checkpoint is written to a temporary folder and renamed into place: a crash leaves the
previous one whole.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from molt_proxy.types import Trajectory


@dataclass(slots=True)
class TrainerState:
    step: int = 0
    """Trainer steps taken: steps that changed the weights (`loop.py`)."""
    version: int = 0
    """Weight version of the policy being trained (= trainer steps taken)."""
    optimizer_steps: int = 0
    """Optimizer steps taken: ppo_epochs x mini_batches per trainer step, less any whose
    gradient was zero."""
    cursors: list[int] = field(default_factory=list)
    """Per followed proxy, in `--proxy-url` order: the seq of the last trajectory taken from it."""
    pending: list[Trajectory] = field(default_factory=list)
    """Taken from the stream, not yet trained on (the group buffer), in seq order."""
    trained: list[list[str]] = field(default_factory=list)
    """[steps] the trajectory ids each step trained on (seqs in checkpoints older than
    several proxies: seqs are per proxy, ids are not)."""
    consumed: list[str] = field(default_factory=list)
    """Trajectory ids taken and let go without a step: dropped groups, the trajectories of
    skipped steps, and evaluation episodes."""
    skipped_steps: dict[str, int] = field(default_factory=dict)
    """Steps skipped (no optimizer step, no version) by reason (`loop.py`): zero_advantage,
    untrainable, stale, masked."""
    dropped_stale_groups: int = 0
    """Groups whose every sampled token was past `max_staleness` when they became ready or
    while they waited for a step."""
    dropped_flat_groups: int = 0
    """Groups whose episodes all had the same outcome, dropped by `drop_flat_groups`."""
    dropped_filtered_groups: int = 0
    """Groups the `--group-filter` plug-in refused. The plug-ins themselves are not saved:
    a run resumed with another algorithm goes on from the same cursors."""
    evaluations: list[tuple[int, float]] = field(default_factory=list)
    """(weight version, reward) of the evaluation episodes not yet in a metrics record."""
    baseline: float | None = None
    """Running baseline of REINFORCE with baseline."""

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "pending": [t.to_json() for t in self.pending]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrainerState:
        """Older checkpoints lack newer counters: they start at their defaults. One from
        before several proxies has a single `cursor`: the first proxy's."""
        data = dict(data)
        if "cursor" in data:
            data["cursors"] = [data.pop("cursor")]
        evaluations = [(int(v), float(r)) for v, r in data.get("evaluations", [])]
        pending = [Trajectory.from_json(t) for t in data["pending"]]
        return cls(**{**data, "pending": pending, "evaluations": evaluations})

    def follow(self, proxies: int) -> None:
        """Fit the cursors to the `proxies` followed now: one appended at the end is new and
        is read from its start; one fewer would drop a cursor (and with it, where that
        proxy's stream was left), so it is refused."""
        if proxies < len(self.cursors):
            raise ValueError(
                f"the checkpoint follows {len(self.cursors)} proxies and this run {proxies}: "
                "give every --proxy-url it followed, in the same order (new ones at the end)"
            )
        self.cursors += [0] * (proxies - len(self.cursors))


def save(folder: Path, state: TrainerState, policy_state: dict[str, Any]) -> None:
    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.save(policy_state, tmp / "policy.pt")
    (tmp / "state.json").write_text(json.dumps(state.to_json()))
    old = folder.with_name(folder.name + ".old")
    if folder.exists():
        shutil.rmtree(old, ignore_errors=True)
        folder.rename(old)
    tmp.rename(folder)
    shutil.rmtree(old, ignore_errors=True)


def load(folder: Path) -> tuple[TrainerState, dict[str, Any]] | None:
    folder = Path(folder)
    if not (folder / "state.json").exists():
        old = folder.with_name(folder.name + ".old")  # a crash between the two renames
        if not (old / "state.json").exists():
            return None
        folder = old
    state = TrainerState.from_json(json.loads((folder / "state.json").read_text()))
    return state, torch.load(folder / "policy.pt", weights_only=False)
