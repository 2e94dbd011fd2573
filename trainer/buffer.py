"""Wait for complete groups before training on them.

Group baselines (GRPO, RLOO) compare the episodes of one task, so a group is released when it
has `group_size` distinct sessions (all segments of a session travel together), or when its
first episode has waited `timeout_s` (stragglers: the group trains with what it has). A
trajectory without a reward (a session closed unrewarded) is never trained on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Group:
    group_id: str
    trajectories: list[dict[str, Any]] = field(default_factory=list)
    opened: float = 0.0

    @property
    def sessions(self) -> list[str]:
        return list(dict.fromkeys(t["session_id"] for t in self.trajectories))


class GroupBuffer:
    def __init__(self, group_size: int, timeout_s: float, clock: Callable[[], float] = time.monotonic):
        if group_size < 1:
            raise ValueError("group_size must be at least 1")
        self.group_size = group_size
        self.timeout_s = timeout_s
        self.clock = clock
        self._groups: dict[str, Group] = {}
        self.skipped_unrewarded = 0
        self.timed_out = 0

    def add(self, trajectory: dict[str, Any]) -> None:
        if trajectory.get("reward") is None:
            self.skipped_unrewarded += 1
            return
        group = self._groups.setdefault(
            trajectory["group_id"], Group(trajectory["group_id"], opened=self.clock())
        )
        group.trajectories.append(trajectory)

    def pop_ready(self) -> list[Group]:
        """Complete groups, then timed-out ones, oldest first."""
        now = self.clock()
        ready = []
        for group in sorted(self._groups.values(), key=lambda g: g.opened):
            complete = len(group.sessions) >= self.group_size
            if complete or now - group.opened >= self.timeout_s:
                self.timed_out += not complete
                ready.append(group)
        for group in ready:
            del self._groups[group.group_id]
        return ready

    def pending(self) -> list[dict[str, Any]]:
        """Everything buffered, for the checkpoint (so a restart loses nothing)."""
        return [t for g in sorted(self._groups.values(), key=lambda g: g.opened) for t in g.trajectories]
