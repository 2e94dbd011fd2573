"""Follow the ordered streams of finalized trajectories of one or more proxies, each from its
own cursor.

`GET /v1/trajectories?after=SEQ` with `Accept: text/event-stream` streams a proxy's
trajectories in `seq` order. One reader thread per proxy keeps its connection (reconnecting
from the last seq it saw) and fills one shared queue with (proxy index, trajectory); the
training loop takes from the queue with a timeout, so it can also act on time (stragglers)
while nothing arrives. Each proxy's trajectories come out in its own seq order, interleaved
with the others' as they arrive. What is in the queue is not yet consumed: the cursor the
trainer checkpoints per proxy is the seq of the last trajectory it took from that proxy.
Records are parsed here, once, into `molt_proxy.types.Trajectory`: past this module the
trainer reads attributes.

Seqs are each proxy's own (every store counts from 1); trajectory ids (`<session>:<segment>`)
are unique across proxies behind a session-affine balancer, which sends a session to one
proxy only.

Offline (`--trajectories FILE`), `ExportSource` gives a `molt-proxy export` the same way, as
one source with its own cursor: what the stream would have sent, in seq order, then nothing.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import httpx

from molt_proxy import export
from molt_proxy.types import SessionStatus, Trajectory

log = logging.getLogger(__name__)


class TrajectoryStream:
    def __init__(
        self,
        proxy_urls: Sequence[str],
        cursors: Sequence[int],
        *,
        admin_key: str | None = None,
        maxsize: int = 10_000,
    ):
        if len(proxy_urls) != len(cursors):
            raise ValueError(f"{len(proxy_urls)} proxies but {len(cursors)} cursors")
        self.headers = {"accept": "text/event-stream"}
        if admin_key:
            self.headers["authorization"] = f"Bearer {admin_key}"
        self._queue: queue.Queue[tuple[int, Trajectory]] = queue.Queue(maxsize)
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(
                target=self._read,
                args=(index, f"{url.rstrip('/')}/v1/trajectories", after),
                name=f"trajectory-stream-{index}",
                daemon=True,
            )
            for index, (url, after) in enumerate(zip(proxy_urls, cursors, strict=True))
        ]

    def start(self) -> TrajectoryStream:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def get(self, timeout_s: float) -> tuple[int, Trajectory] | None:
        """(proxy index, the next trajectory of that proxy in its seq order), or None if none
        arrived within `timeout_s`."""
        try:
            return self._queue.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def _read(self, index: int, url: str, last_seen: int) -> None:
        while not self._stop.is_set():
            try:
                with httpx.stream(
                    "GET",
                    url,
                    params={"after": last_seen},
                    headers=self.headers,
                    timeout=httpx.Timeout(10.0, read=60.0),
                ) as response:
                    response.raise_for_status()
                    for line in response.iter_lines():
                        if self._stop.is_set():
                            return
                        if line.startswith("data: "):
                            trajectory = Trajectory.from_json(json.loads(line[6:]))
                            if trajectory.seq <= last_seen:
                                continue
                            last_seen = trajectory.seq
                            self._queue.put((index, trajectory))
            except httpx.HTTPError as exc:
                log.warning(
                    "trajectory stream of %s interrupted (%s); reconnecting after seq %d", url, exc, last_seen
                )
                time.sleep(1.0)


class ExportSource:
    """The trajectories of an export file after `cursor`, in seq order, as source 0, with
    side requests left out as the proxy's stream leaves them out (the loop skips unrewarded
    and evaluation episodes as it does live). `exhausted` once all are taken: the loop then
    releases every waiting group as if its stragglers had timed out, with no clock involved,
    so a run from a file is the same whatever the machine's speed."""

    def __init__(self, path: Path, cursor: int):
        records = [Trajectory.from_json(row) for row in export.load(path)]
        taken = (t for t in records if t.seq > cursor and t.status != SessionStatus.SIDE)
        self._records = deque(sorted(taken, key=lambda t: t.seq))

    def start(self) -> ExportSource:
        return self

    def stop(self) -> None:
        pass

    @property
    def exhausted(self) -> bool:
        return not self._records

    def get(self, timeout_s: float) -> tuple[int, Trajectory] | None:
        return (0, self._records.popleft()) if self._records else None
