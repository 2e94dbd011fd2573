"""The trajectory viewer at `/ui`, and `/docs` without a CDN.

The viewer is static HTML, JS and CSS shipped in the package (`molt_proxy/ui/`): clusters are
often offline, so nothing is loaded from elsewhere. The pages hold no data and need no key;
the data they fetch does, under the rules of `/v1/trajectories` (the admin key, when keys are
set): the routes under `/ui/api/` below, and the trajectory stream itself, which the list
follows live. What the viewer reads here is what the trainer reads, plus the text of each
token and each turn's tool calls as the proxy's parser reads them from the sampled ids (a
closed session's replies are not kept, so they are read again), and the advantages the trainer
posted for the trajectory (`advantages.py`).

FastAPI's `/docs` loads Swagger UI from a CDN; here it is served from the copy vLLM ships
(`vllm/entrypoints/serve/instrumentator/static`), and ReDoc (which vLLM does not ship) is off.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import vllm.entrypoints.serve.instrumentator as vllm_instrumentator
from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

from molt_proxy import auth, store_advantages
from molt_proxy.errors import NotFound
from molt_proxy.proxy import Proxy
from molt_proxy.side import is_side
from molt_proxy.wire.jsonbody import INT64_MAX

UI = Path(__file__).parent / "ui"
FILES = {"app.js": "text/javascript", "style.css": "text/css", "favicon.svg": "image/svg+xml"}
SWAGGER = Path(vllm_instrumentator.__file__).parent / "static"
SWAGGER_FILES = {"swagger-ui-bundle.js": "text/javascript", "swagger-ui.css": "text/css"}

VIEW_REQUEST = ChatCompletionRequest(
    model="viewer",
    messages=[{"role": "user", "content": ""}],
    tools=[{"type": "function", "function": {"name": "any", "parameters": {"type": "object"}}}],
)
"""The request a recorded turn is parsed under: one that declares a tool, so that the tool
parser (`--tool-call-parser`) reads the calls the model sampled, whatever their names."""

router = APIRouter(include_in_schema=False)


def _proxy(request: Request) -> Proxy:
    proxy: Proxy = request.app.state.proxy
    proxy.principal(request, auth.ADMIN_ONLY)
    return proxy


@router.get("/ui")
@router.get("/ui/")
async def page() -> FileResponse:
    return FileResponse(UI / "index.html", media_type="text/html")


@router.get("/ui/{name}")
async def asset(name: str) -> FileResponse:
    if name not in FILES:
        raise NotFound(f"no viewer file {name!r}")
    return FileResponse(UI / name, media_type=FILES[name])


@router.get("/ui/api/sessions")
async def open_sessions(request: Request) -> dict[str, Any]:
    """The open sessions, newest activity first."""
    sessions = sorted(_proxy(request).sessions.open_sessions(), key=lambda s: -s.last_active)
    return {
        "data": [
            {
                **s.describe(),
                "created": s.created,
                "last_active": s.last_active,
                "in_flight": bool(s.in_flight),
            }
            for s in sessions
        ]
    }


@router.get("/ui/api/trajectories")
async def trajectories(
    request: Request,
    after: int = Query(0, ge=0, le=INT64_MAX),
    limit: int = Query(1000, ge=1, le=10_000),
) -> dict[str, Any]:
    """`/v1/trajectories` without the token arrays: what the list shows."""
    rows = await _proxy(request).store.trajectories_after(after, limit)
    return {"data": [brief(t) for t in rows], "last_seq": rows[-1]["seq"] if rows else after}


def brief(t: dict[str, Any]) -> dict[str, Any]:
    keep = ("seq", "trajectory_id", "session_id", "segment", "num_segments", "group_id", "reward", "created")
    return {
        **{name: t.get(name) for name in keep},
        "status": "side" if is_side(t) else t["status"],
        "turns": len(t["turns"]),
        "num_tokens": len(t["token_ids"]),
        "num_sampled": sum(t["loss_mask"]),
    }


@router.get("/ui/api/trajectories/{seq}")
async def trajectory(request: Request, seq: int) -> dict[str, Any]:
    """One trajectory as stored, with each token's text, each turn's parsed reply, and the
    advantages the trainer posted for it (`advantages`, None if it posted none)."""
    proxy = _proxy(request)
    rows = await proxy.store.trajectories_after(max(seq - 1, 0), 1) if 0 < seq <= INT64_MAX else []
    if not rows or rows[0]["seq"] != seq:
        raise NotFound(f"no trajectory {seq}", param="seq")
    t = rows[0]
    ids = t["token_ids"]
    t["pieces"] = [proxy.tokenizer.token_bytes(i).decode(errors="replace") for i in ids]
    parser = proxy.completions.parser
    for turn in t["turns"]:
        start, end = turn["completion_start"], turn["completion_end"]
        reply = parser.parse(ids[start:end], turn["finish_reason"], VIEW_REQUEST, ids[:start])
        turn["reply"] = {
            "content": reply.content,
            "reasoning_content": reply.reasoning_content,
            "tool_calls": reply.tool_calls,
        }
    t["advantages"] = await store_advantages.load(proxy.store, t["trajectory_id"])
    return t


def install_docs(app: FastAPI) -> None:
    """`/docs` from vLLM's copy of Swagger UI (the app is built with `docs_url=None`)."""

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url="/openapi.json",
            title="molt-proxy",
            swagger_js_url="/docs/swagger-ui-bundle.js",
            swagger_css_url="/docs/swagger-ui.css",
            swagger_favicon_url="/ui/favicon.svg",
        )

    @app.get("/docs/{name}", include_in_schema=False)
    async def docs_asset(name: str) -> FileResponse:
        if name not in SWAGGER_FILES:
            raise NotFound(f"no docs file {name!r}")
        return FileResponse(SWAGGER / name, media_type=SWAGGER_FILES[name])
