"""Wait for whole sessions and complete groups before training on them.

Group baselines (GRPO, RLOO) compare the episodes of one task, so a session counts only once
every one of its segments has arrived (`Trajectory.num_segments`: the store finalizes a
session's segments together, at consecutive seqs), and a group is released when it has
`group_size` whole sessions, or when its first whole session has waited `timeout_s`
(stragglers: the group trains with what it has). A trajectory without a reward (a session
closed unrewarded) is never trained on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from molt_proxy.types import Trajectory


def final_reward(trajectory: Trajectory) -> float:
    """The session's reward of a trajectory in a group: groups hold rewarded sessions only."""
    if trajectory.reward is None:
        raise ValueError(f"trajectory {trajectory.trajectory_id} is unrewarded: it belongs in no group")
    return trajectory.reward


@dataclass(slots=True)
class Group:
    group_id: str
    trajectories: list[Trajectory] = field(default_factory=list)
    """Every segment of each of its sessions, a session's segments together and in order."""
    opened: float = 0.0

    @property
    def sessions(self) -> list[str]:
        return list(dict.fromkeys(t.session_id for t in self.trajectories))


class GroupBuffer:
    def __init__(self, group_size: int, timeout_s: float, clock: Callable[[], float] = time.monotonic):
        if group_size < 1:
            raise ValueError("group_size must be at least 1")
        self.group_size = group_size
        self.timeout_s = timeout_s
        self.clock = clock
        self._arriving: dict[str, list[Trajectory]] = {}
        """Segments of sessions not yet whole, by session id."""
        self._groups: dict[str, Group] = {}
        self.skipped_unrewarded = 0
        self.timed_out = 0

    def add(self, trajectory: Trajectory) -> None:
        if trajectory.reward is None:
            self.skipped_unrewarded += 1
            return
        segments = self._arriving.setdefault(trajectory.session_id, [])
        segments.append(trajectory)
        if len(segments) < trajectory.num_segments:
            return
        del self._arriving[trajectory.session_id]
        group = self._groups.setdefault(trajectory.group_id, Group(trajectory.group_id, opened=self.clock()))
        group.trajectories += sorted(segments, key=lambda t: t.segment)

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

    def pop_all(self) -> list[Group]:
        """Every group, oldest first, complete or not: nothing more will come (offline, at the
        end of the file), so each is released as a timed-out one would be."""
        ready = sorted(self._groups.values(), key=lambda g: g.opened)
        self.timed_out += sum(len(g.sessions) < self.group_size for g in ready)
        self._groups.clear()
        return ready

    def pending(self) -> list[Trajectory]:
        """Everything buffered, in seq order, for the checkpoint (so a restart loses nothing)."""
        grouped = [t for g in self._groups.values() for t in g.trajectories]
        arriving = [t for segments in self._arriving.values() for t in segments]
        return sorted(grouped + arriving, key=lambda t: t.seq)
