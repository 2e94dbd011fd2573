"""Server-sent events: the framing of `data:` lines, and how a streamed turn goes out in any
format's events.

Two streams are framed here: a streamed chat reply (OpenAI's chunks, ended by `data: [DONE]`)
and the trainer's feed of finalized trajectories (`GET /v1/trajectories` with `Accept:
text/event-stream`), whose events carry the trajectory's `seq` as their id so that a client
can resume from the last one it saw. Every API format streams a turn through `encoded`, with
its own `Encoder`: a failure after the first line went out ends the stream the same way for all.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any, Protocol

import orjson

from molt_proxy.errors import MoltError
from molt_proxy.wire.events import Closed, Replayed, StreamEvent

log = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"
"""The OpenAI stream's last event."""
KEEPALIVE = ": keepalive\n\n"
"""A comment line: keeps an idle stream's connection (and its proxies) open."""


def data_event(payload: dict[str, Any]) -> str:
    """An unnamed event carrying one JSON object (an OpenAI stream chunk), encoded by orjson:
    a chunk goes out per sampled token."""
    return f"data: {orjson.dumps(payload).decode()}\n\n"


def trajectory_event(trajectory: dict[str, Any]) -> str:
    """One finalized trajectory in its JSON form, its `seq` as the event id."""
    return f"id: {trajectory['seq']}\nevent: trajectory\ndata: {json.dumps(trajectory)}\n\n"


class Encoder(Protocol):
    """A wire format's encoding of one streamed turn (it keeps what the events so far opened)."""

    def lines(self, event: StreamEvent) -> list[str]:
        """The server-sent events that stand for `event`."""
        ...

    def failed(self, error: MoltError) -> list[str]:
        """The events that end a stream whose turn failed after its first event went out."""
        ...


async def encoded(events: AsyncGenerator[StreamEvent], encoder: Encoder) -> AsyncGenerator[str]:
    """A streamed turn's events in `encoder`'s format. A failure before the first line goes out
    propagates: the route answers it as a plain error response. One after it cannot change the
    status line that went out, so the stream ends with the format's error events
    (`Encoder.failed`); an error that is not the proxy's own is logged and shown as an internal
    error (its text may quote a prompt). One after the reply's last event propagates: the
    reply went out whole. Closing this closes `events`, and with them the turn."""
    started = finished = False
    async with aclosing(events):
        try:
            async for event in events:
                for line in encoder.lines(event):
                    started = True
                    yield line
                finished = isinstance(event, Closed | Replayed)
        except Exception as exc:
            if not started or finished:
                raise
            error = exc if isinstance(exc, MoltError) else MoltError("internal error")
            if error is not exc:
                log.error("internal error in a streamed reply", exc_info=exc)
            for line in encoder.failed(error):
                yield line
