"""Server-sent events framing: the one place the proxy writes `data:` lines.

Two streams use it: a streamed chat reply (OpenAI's chunks, ended by `data: [DONE]`) and the
trainer's feed of finalized trajectories (`GET /v1/trajectories` with `Accept:
text/event-stream`), whose events carry the trajectory's `seq` as their id so that a client
can resume from the last one it saw.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

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
