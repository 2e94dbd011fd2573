"""Tell each proxy the advantages its trajectories were trained with, for its viewer.

After a step, the trainer posts to the proxy it read each trajectory from (`POST
/v1/admin/advantages`, `molt_proxy/advantages.py`) the advantage the loss took for it, or with
per-turn credit (`--turn-discount`) one per turn, with the step and the version the step made
(those of its metrics record). The values are read back from the step's advantage tensor,
so they are exactly what was trained, float32 as the loss saw them.

This is for people watching the run, not for training: a post that fails (a proxy down, a
timeout, an error answer) is logged and counted (`advantage_posts_failed` in every metrics
record) and training goes on. Which proxy a trajectory came from is remembered from when the
loop took it; a trajectory restored from a checkpoint's pending list is posted to the only
proxy when there is one, and not at all when there are several (its source is not known).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import httpx
from torch import Tensor

from molt_proxy.types import Trajectory

log = logging.getLogger(__name__)
POST_TIMEOUT_S = 10.0
REMEMBERED = 100_000
"""Sources kept for trajectories not yet posted; the oldest are forgotten past this (those of
trajectories dropped before a step, which are never posted)."""


def advantage_entries(trajectories: Sequence[Trajectory], advantages: Tensor) -> list[dict[str, Any]]:
    """The body's `trajectories`: [B] advantages give one per trajectory; [B,T] (per-turn
    credit) one per turn, read at the turn's first sampled token (None: it sampled none)."""
    values = advantages.detach().cpu().tolist()
    if advantages.dim() == 1:
        return [
            {"trajectory_id": t.trajectory_id, "advantage": v}
            for t, v in zip(trajectories, values, strict=True)
        ]
    return [
        {
            "trajectory_id": t.trajectory_id,
            "turn_advantages": [
                row[turn.completion_start] if turn.completion_end > turn.completion_start else None
                for turn in t.turns
            ],
        }
        for t, row in zip(trajectories, values, strict=True)
    ]


class AdvantageReport:
    def __init__(self, proxy_urls: Sequence[str], admin_key: str | None):
        self.proxy_urls = [url.rstrip("/") for url in proxy_urls]
        self.headers = {"authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.failed = 0
        """Posts that failed; each is logged."""
        self._sources: dict[str, int] = {}

    def taken(self, source: int, trajectory_id: str) -> None:
        """The loop took the trajectory from proxy `source` (an index into `proxy_urls`)."""
        self._sources[trajectory_id] = source
        if len(self._sources) > REMEMBERED:
            del self._sources[next(iter(self._sources))]

    def post(self, trajectories: Sequence[Trajectory], advantages: Tensor, step: int, version: int) -> None:
        """Post the step's advantages, one request per proxy; never raises for a failed post."""
        by_source: dict[int, list[dict[str, Any]]] = {}
        default = 0 if len(self.proxy_urls) == 1 else None
        for t, entry in zip(trajectories, advantage_entries(trajectories, advantages), strict=True):
            source = self._sources.pop(t.trajectory_id, default)
            if source is not None:
                by_source.setdefault(source, []).append(entry)
        for source, entries in sorted(by_source.items()):
            url = f"{self.proxy_urls[source]}/v1/admin/advantages"
            body = {"step": step, "version": version, "trajectories": entries}
            try:
                httpx.post(url, json=body, headers=self.headers, timeout=POST_TIMEOUT_S).raise_for_status()
            except httpx.HTTPError as exc:
                self.failed += 1
                log.warning("step %d's advantages not posted to %s (training goes on): %s", step, url, exc)
