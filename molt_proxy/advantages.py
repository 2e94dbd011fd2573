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

from typing import Annotated, Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from molt_proxy import auth, store_advantages
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
        decoded = validated(cls, decode_json_object(body))
        for index, entry in enumerate(decoded.trajectories):
            if (entry.advantage is None) == (entry.turn_advantages is None):
                raise BadRequest(
                    "give exactly one of 'advantage' and 'turn_advantages'",
                    param=f"trajectories.{index}.advantage",
                )
        return decoded


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
    body = AdvantagesBody.decode(await request.body())
    entries = [
        store_advantages.Posted(e.trajectory_id, e.advantage, e.turn_advantages) for e in body.trajectories
    ]
    await store_advantages.save(proxy.store, body.step, body.version, entries)
    return {"stored": len(entries), "step": body.step, "version": body.version}
