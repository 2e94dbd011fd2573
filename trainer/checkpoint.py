"""Checkpoint and resume: model, optimizer, stream cursor, weight version, buffered work.

Exactly once across restarts: the cursor is the seq of the last trajectory the trainer took
from the stream, and everything it took but has not trained on yet (the group buffer) is
saved with it. The list of seqs each step trained on is kept too, so a run can prove it.
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


@dataclass(slots=True)
class TrainerState:
    step: int = 0
    version: int = 0
    """Weight version of the policy being trained (= optimizer steps taken)."""
    cursor: int = 0
    pending: list[dict[str, Any]] = field(default_factory=list)
    trained: list[list[int]] = field(default_factory=list)
    """[steps] the seqs each step trained on."""
    baseline: float | None = None
    """Running baseline of REINFORCE with baseline."""


def save(folder: Path, state: TrainerState, policy_state: dict[str, Any]) -> None:
    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.save(policy_state, tmp / "policy.pt")
    (tmp / "state.json").write_text(json.dumps(asdict(state)))
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
    state = TrainerState(**json.loads((folder / "state.json").read_text()))
    return state, torch.load(folder / "policy.pt", weights_only=False)
