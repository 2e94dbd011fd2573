"""`POST /v1/admin/advantages`: the trainer reports the advantages it trained trajectories with,
so that the viewer's group page shows them next to the rewards (`trainer/report.py` posts them
after each step; `store_advantages.py` keeps them). An admin route, like the weights: with keys
on, only the admin key may post.

    {"step": 3, "version": 3, "trajectories": [
        {"trajectory_id": "s1:0", "advantage": 0.5},
        {"trajectory_id": "s2:0", "turn_advantages": [0.25, null]}]}

`step` and `version` are those of the trainer's metrics record for the step. Each trajectory
has `advantage` (one for all its sampled tokens) or `turn_advantages` (per-turn credit: one per
turn of the trajectory, null for a turn that had no sampled token), not both.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

import pydantic
from fastapi import APIRouter, Request
from pydantic import BaseModel, Field, TypeAdapter

from molt_proxy import auth, store_advantages
from molt_proxy.completions import OFF_LOOP_BYTES
from molt_proxy.errors import BadRequest
from molt_proxy.proxy import Proxy
from molt_proxy.wire.control import request_body, validated
from molt_proxy.wire.jsonbody import INT64_MAX, decode_json_object

Finite = Annotated[float, Field(strict=True, allow_inf_nan=False)]
"""Finite: the viewer reads these back as JSON."""
MAX_TRAJECTORIES = 100_000


class Entry(BaseModel):
    trajectory_id: str = Field(min_length=1)
    advantage: Finite | None = None
    turn_advantages: list[Finite | None] | None = None


class AdvantagesBody(BaseModel):
    step: int = Field(strict=True, ge=0, le=INT64_MAX)
    version: int = Field(strict=True, ge=0, le=INT64_MAX)
    trajectories: list[Entry] = Field(min_length=1, max_length=MAX_TRAJECTORIES)

    @classmethod
    def decode(cls, body: bytes) -> AdvantagesBody:
        """The body, validated as this model would validate it, its entries a slice at a time
        (`CHUNK`); the first error is the one the whole model would report first."""
        header = validated(_Header, decode_json_object(body))
        entries: list[Entry] = []
        for start in range(0, len(header.trajectories), CHUNK):
            entries += _entries(header.trajectories[start : start + CHUNK], start)
        for index, entry in enumerate(entries):
            if (entry.advantage is None) == (entry.turn_advantages is None):
                raise BadRequest(
                    "give exactly one of 'advantage' and 'turn_advantages'",
                    param=f"trajectories.{index}.advantage",
                )
        return cls.model_construct(step=header.step, version=header.version, trajectories=entries)


CHUNK = 2_000
"""Entries validated per pydantic call. pydantic holds the GIL through a call (0.5 s for the
87k entries of a large step on a loaded machine), so even in a worker thread one call for all
of them would stall the event loop; between slices the loop takes the GIL back."""


class _Header(BaseModel):
    """`AdvantagesBody` with its entries left unvalidated (`_entries` validates them)."""

    step: int = Field(strict=True, ge=0, le=INT64_MAX)
    version: int = Field(strict=True, ge=0, le=INT64_MAX)
    trajectories: list[Any] = Field(min_length=1, max_length=MAX_TRAJECTORIES)


_ENTRIES = TypeAdapter(list[Entry])


def _entries(items: list[Any], start: int) -> list[Entry]:
    """`items`, the entries from index `start` on, validated; an error names its index in the
    whole body, as `validated` names a field."""
    try:
        return _ENTRIES.validate_python(items)
    except pydantic.ValidationError as exc:
        error = exc.errors()[0]
        index, *rest = error["loc"]
        param = ".".join(str(part) for part in ("trajectories", start + int(index), *rest))
        raise BadRequest(f"invalid value for '{param}': {error['msg'][:300]}", param=param) from None


def _posted(body: bytes) -> tuple[int, int, list[store_advantages.Posted]]:
    """The step, version and entries of a post, as the store takes them."""
    decoded = AdvantagesBody.decode(body)
    entries = [
        store_advantages.Posted(e.trajectory_id, e.advantage, e.turn_advantages) for e in decoded.trajectories
    ]
    return decoded.step, decoded.version, entries


_NUMBER = {"type": "number"}
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "step": {"type": "integer", "minimum": 0},
        "version": {"type": "integer", "minimum": 0},
        "trajectories": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {
                    "trajectory_id": {"type": "string", "minLength": 1},
                    "advantage": _NUMBER,
                    "turn_advantages": {"type": "array", "items": {"anyOf": [_NUMBER, {"type": "null"}]}},
                },
                "required": ["trajectory_id"],
            },
        },
    },
    "required": ["step", "version", "trajectories"],
}

router = APIRouter()


@router.post("/v1/admin/advantages", openapi_extra=request_body(SCHEMA))
async def post_advantages(request: Request) -> dict[str, Any]:
    """Store what the trainer trained each named trajectory with; all or nothing."""
    proxy: Proxy = request.app.state.proxy
    proxy.principal(request, auth.ADMIN_ONLY)
    body = await request.body()
    # A trainer step's post is large (87k entries: 4 MB): decoded in a worker thread, as a
    # large chat request is (`completions.OFF_LOOP_BYTES`), so other clients are not held up.
    posted = _posted(body) if len(body) < OFF_LOOP_BYTES else await asyncio.to_thread(_posted, body)
    step, version, entries = posted
    await store_advantages.save(proxy.store, step, version, entries)
    return {"stored": len(entries), "step": step, "version": version}
