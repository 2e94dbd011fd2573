"""The floor for an OpenAI front-end: a FastAPI/uvicorn app that forwards each chat request
unchanged to the upstream and returns its answer (relaying a stream chunk by chunk),
recording nothing.

Whatever molt-proxy costs above this is the price of rendering, stitching and recording;
what this costs above talking to the upstream directly is the price of any Python HTTP hop.
`--client httpx` is the floor the issue names; `--client aiohttp` is the client molt-proxy
actually uses on its hot path (DESIGN §4), so both are offered.

    python -m bench.passthrough --port 8102 --upstream http://127.0.0.1:8101 --client httpx
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import httpx
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask


def build_app(upstream: str, client: str) -> FastAPI:
    state: dict[str, object] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if client == "httpx":
            # httpx's default pool (100 connections, 20 kept alive), as most code uses it.
            async with httpx.AsyncClient(base_url=upstream, timeout=600) as http:
                state["http"] = http
                yield
        else:
            connector = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(upstream, connector=connector) as session:
                state["http"] = session
                yield

    app = FastAPI(lifespan=lifespan)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await request.body()
        headers = {"content-type": "application/json"}
        http = state["http"]
        if isinstance(http, httpx.AsyncClient):
            answer = await http.send(
                http.build_request("POST", "/v1/chat/completions", content=body, headers=headers), stream=True
            )
            if answer.headers.get("content-type", "").startswith("text/event-stream"):
                # relay the stream chunk by chunk, as a streaming front-end must
                return StreamingResponse(
                    answer.aiter_raw(),
                    media_type="text/event-stream",
                    background=BackgroundTask(answer.aclose),
                )
            content = await answer.aread()
            await answer.aclose()
            return Response(content, status_code=answer.status_code, media_type="application/json")
        assert isinstance(http, aiohttp.ClientSession)
        resp = await http.post("/v1/chat/completions", data=body, headers=headers)
        if resp.content_type == "text/event-stream":
            return StreamingResponse(
                resp.content.iter_any(),
                media_type="text/event-stream",
                background=BackgroundTask(resp.release),
            )
        async with resp:
            return Response(await resp.read(), status_code=resp.status, media_type="application/json")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--client", choices=["httpx", "aiohttp"], default="httpx")
    args = parser.parse_args()
    uvicorn.run(build_app(args.upstream, args.client), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
