"""Follow the proxy's ordered stream of finalized trajectories from a cursor.

`GET /v1/trajectories?after=SEQ` with `Accept: text/event-stream` streams trajectories in
`seq` order. A reader thread keeps the connection (reconnecting from the last seq it saw) and
fills a queue; the training loop takes from the queue with a timeout, so it can also act on
time (stragglers) while nothing arrives. What is in the queue is not yet consumed: the
cursor the trainer checkpoints is the seq of the last trajectory it took. Records are parsed
here, once, into `molt_proxy.types.Trajectory`: past this module the trainer reads attributes.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time

import httpx

from molt_proxy.types import Trajectory

log = logging.getLogger(__name__)


class TrajectoryStream:
    def __init__(self, proxy_url: str, after: int, *, admin_key: str | None = None, maxsize: int = 10_000):
        self.url = f"{proxy_url.rstrip('/')}/v1/trajectories"
        self.headers = {"accept": "text/event-stream"}
        if admin_key:
            self.headers["authorization"] = f"Bearer {admin_key}"
        self._last_seen = after
        self._queue: queue.Queue[Trajectory] = queue.Queue(maxsize)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="trajectory-stream", daemon=True)

    def start(self) -> TrajectoryStream:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def get(self, timeout_s: float) -> Trajectory | None:
        """The next trajectory in seq order, or None if none arrived within `timeout_s`."""
        try:
            return self._queue.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                with httpx.stream(
                    "GET",
                    self.url,
                    params={"after": self._last_seen},
                    headers=self.headers,
                    timeout=httpx.Timeout(10.0, read=60.0),
                ) as response:
                    response.raise_for_status()
                    for line in response.iter_lines():
                        if self._stop.is_set():
                            return
                        if line.startswith("data: "):
                            trajectory = Trajectory.from_json(json.loads(line[6:]))
                            if trajectory.seq <= self._last_seen:
                                continue
                            self._last_seen = trajectory.seq
                            self._queue.put(trajectory)
            except httpx.HTTPError as exc:
                log.warning(
                    "trajectory stream interrupted (%s); reconnecting after seq %d", exc, self._last_seen
                )
                time.sleep(1.0)
