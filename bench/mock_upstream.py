"""An instant stand-in for vLLM, so that a proxy benchmark measures only the proxy.

It answers the routes the front-ends call, with bodies shaped like vLLM 0.32's:
`POST /inference/v1/generate` (molt-proxy: `choices[0].token_ids`, `logprobs.content[i]`,
`weight_versions` spans, `finish_reason`; with `stream: true`, one SSE chunk per id; top
logprobs in vLLM's order when `sampling_params.logprobs` asks for them, see `top_logprobs`),
`POST /v1/chat/completions` (the pass-through, LiteLLM and the RL peers; streamed one word
per chunk; with `return_token_ids`, vLLM's `prompt_token_ids` and per-choice `token_ids`, and
with `logprobs`, vLLM's logprobs, as Agent Lightning's proxy and rLLM's gateway ask),
`GET /v1/models` and `GET /health`. Every answer is the same fixed reply, built
once; aiohttp's server keeps the per-request cost to well under a millisecond. Tests that
need other replies queue them with `POST /_script` (a JSON list of `{"token_ids": [...],
"finish_reason": ..., "logprobs": [...] (optional)}`): the next whole (not streamed) generate
requests answer them, in order.

The weight-refresh routes (`/pause`, `/collective_rpc`, `/update_weight_version`, `/resume`,
and the weight-transfer engine's `/init_weight_transfer_engine`, `/start_weight_update`,
`/update_weights`, `/finish_weight_update`) only record that they were called, in order, as
`(path, body)` in the list `calls` passed to `build_app` (and at `GET /_calls`);
`/update_weight_version` and `/finish_weight_update` also relabel what is sampled next, as
vLLM does. `GET /_generated` lists the body of every generate request, in order.

    python -m bench.mock_upstream --port 8101 --reply-text "..." --reply-ids 1,2,3
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from typing import Any

from aiohttp import web


def top_logprobs(position: int, sampled: int, asked: int) -> list[dict[str, Any]]:
    """vLLM's `top_logprobs` at one position when asked for `asked` (> 0): the sampled id first,
    then the most likely ids, the list cut at `asked` entries. Here the sampled id (logprob
    -0.5) ranks 1 + position % 3, among ids 1000, 1001, ... whose logprobs step by 0.125."""
    rank = 1 + position % 3
    others = [i for i in range(1000, 1000 + asked + 2) if i != sampled]
    ranked = [*others[: rank - 1], sampled, *others[rank - 1 :]]
    entries = {sampled: {"token_id": sampled, "logprob": -0.5, "rank": rank}}
    for r, token_id in enumerate(ranked[:asked], start=1):
        entries.setdefault(token_id, {"token_id": token_id, "logprob": -0.5 - (r - rank) * 0.125, "rank": r})
    return list(entries.values())[:asked]


def build_app(
    model: str,
    reply_text: str,
    reply_ids: list[int],
    max_model_len: int,
    calls: list[tuple[str, Any]] | None = None,
) -> web.Application:
    calls = [] if calls is None else calls
    generated: list[dict] = []
    script: list[dict] = []
    logprobs = {
        "content": [{"token_id": i, "logprob": -0.5, "rank": 1, "top_logprobs": []} for i in reply_ids]
    }
    choice = {
        "index": 0,
        "token_ids": reply_ids,
        "logprobs": logprobs,
        "weight_versions": [{"version": "default", "start": 0, "end": len(reply_ids)}],
        "finish_reason": "stop",
        "stop_reason": None,
    }
    models = json.dumps(
        {
            "object": "list",
            "data": [{"id": model, "object": "model", "owned_by": "vllm", "max_model_len": max_model_len}],
        }
    )

    async def sse(request: web.Request, chunks: list[dict]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in chunks:
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def with_top(asked: int) -> dict[str, Any]:
        """The logprobs of the reply with `asked` top logprobs per position."""
        content = [
            {**entry, "top_logprobs": top_logprobs(n, entry["token_id"], asked)}
            for n, entry in enumerate(logprobs["content"])
        ]
        return {"content": content}

    def token_chunks(asked: int = 0) -> list[dict]:
        """vLLM's streamed shape: one chunk per sampled id; the finish reason and the
        weight-version spans come on the last one."""
        chunks = []
        content = with_top(asked)["content"] if asked else logprobs["content"]
        for n, (token_id, entry) in enumerate(zip(reply_ids, content, strict=True)):
            last = n == len(reply_ids) - 1
            piece = {"index": 0, "token_ids": [token_id], "logprobs": {"content": [entry]}}
            piece["finish_reason"] = "stop" if last else None
            if last:
                piece["weight_versions"] = choice["weight_versions"]
            chunks.append({"request_id": "r", "output_mode": "tokens", "choices": [piece]})
        return chunks

    streamed_tokens = token_chunks()
    words = reply_text.split(" ")
    streamed_chat = [
        {
            "id": "chatcmpl-mock",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": model,
            "choices": [{"index": 0, "delta": {"content": w + " "}, "finish_reason": None}],
        }
        for w in words
    ] + [
        {
            "id": "chatcmpl-mock",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": model,
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
        }
    ]

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        generated.append(body)
        asked = body["sampling_params"].get("logprobs") or 0
        prompt = body["token_ids"]
        if body.get("stream"):
            chunks = token_chunks(asked) if asked else streamed_tokens
            if body.get("return_token_ids"):  # as vLLM: on the first chunk only
                chunks = [{**chunks[0], "prompt_token_ids": prompt}, *chunks[1:]]
            return await sse(request, chunks)
        if script:
            answer = _scripted(script.pop(0), choice["weight_versions"])
        else:
            answer = {**choice, "logprobs": with_top(asked)} if asked else choice
        reply = {
            "request_id": uuid.uuid4().hex,
            "model": model,
            "created": int(time.time()),
            "output_mode": "tokens",
            "choices": [answer],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(answer["token_ids"]),
                "total_tokens": len(prompt) + len(answer["token_ids"]),
            },
            "prompt_token_ids": prompt if body.get("return_token_ids") else None,
        }
        return web.json_response(reply)

    def chat_logprobs() -> dict[str, Any]:
        entries = [
            {"token": f"token_id:{i}", "logprob": -0.5, "bytes": None, "top_logprobs": []} for i in reply_ids
        ]
        return {"content": entries}

    def streamed_with_ids(body: dict[str, Any]) -> list[dict]:
        """The word chunks with what the peers ask vLLM for (`return_token_ids`, `logprobs`): the
        reply's ids spread over the chunks, the prompt's on the first, as vLLM streams them."""
        ids, logprobs_asked = body.get("return_token_ids"), body.get("logprobs")
        chunks = [json.loads(json.dumps(c)) for c in streamed_chat]
        per = -(-len(reply_ids) // max(len(chunks) - 1, 1))
        for n, chunk in enumerate(chunks):
            piece = reply_ids[n * per : (n + 1) * per]
            if ids:
                chunk["choices"][0]["token_ids"] = piece
            if logprobs_asked:
                entries = chat_logprobs()["content"][n * per : (n + 1) * per]
                chunk["choices"][0]["logprobs"] = {"content": entries}
        if ids:
            chunks[0]["prompt_token_ids"] = prompt_ids(body)
        return chunks

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("stream"):
            if body.get("return_token_ids") or body.get("logprobs"):
                return await sse(request, streamed_with_ids(body))
            return await sse(request, streamed_chat)
        reply = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", model),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": reply_text},
                    "finish_reason": "stop",
                }
            ],
            "usage": {
                "prompt_tokens": 1,
                "completion_tokens": len(reply_ids),
                "total_tokens": 1 + len(reply_ids),
            },
        }
        if body.get("return_token_ids"):  # vLLM's fields, which the RL peers ask for
            reply["prompt_token_ids"] = prompt_ids(body)
            reply["choices"][0]["token_ids"] = reply_ids
        if body.get("logprobs"):
            reply["choices"][0]["logprobs"] = chat_logprobs()
        return web.json_response(reply)

    def prompt_ids(body: dict[str, Any]) -> list[int]:
        """Stand-in prompt ids, one per 4 bytes of the messages (the mock renders nothing): the
        size of what a peer receives and keeps per call."""
        return list(range(len(json.dumps(body.get("messages", []))) // 4))

    async def list_models(_: web.Request) -> web.Response:
        return web.Response(text=models, content_type="application/json")

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def admin(request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else None
        calls.append((request.path_qs, body))
        if request.path == "/update_weight_version":
            choice["weight_versions"][0]["version"] = body["new_version"]
        if request.path == "/finish_weight_update" and body and body.get("weight_version"):
            choice["weight_versions"][0]["version"] = body["weight_version"]
        return web.json_response({})

    async def list_calls(_: web.Request) -> web.Response:
        return web.json_response(calls)

    async def list_generated(_: web.Request) -> web.Response:
        return web.json_response(generated)

    async def add_script(request: web.Request) -> web.Response:
        script.extend(await request.json())
        return web.json_response({"queued": len(script)})

    app = web.Application(client_max_size=2**30)  # vLLM takes prompts of any size; aiohttp's default is 1 MiB
    app.router.add_post("/inference/v1/generate", generate)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    transfer = (
        "/init_weight_transfer_engine",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
    )
    for path in ("/pause", "/collective_rpc", "/update_weight_version", "/resume", *transfer):
        app.router.add_post(path, admin)
    app.router.add_get("/_calls", list_calls)
    app.router.add_get("/_generated", list_generated)
    app.router.add_post("/_script", add_script)
    return app


def _scripted(reply: dict, versions: list[dict]) -> dict:
    """A queued reply in the shape of `choice` (its `logprobs`, if given, else -0.5 for every id)."""
    ids = reply["token_ids"]
    logprobs = reply.get("logprobs") or [-0.5] * len(ids)
    pairs = zip(ids, logprobs, strict=True)
    entries = [{"token_id": i, "logprob": lp, "rank": 1, "top_logprobs": []} for i, lp in pairs]
    return {
        "index": 0,
        "token_ids": ids,
        "logprobs": {"content": entries},
        "weight_versions": [{**versions[0], "start": 0, "end": len(ids)}],
        "finish_reason": reply["finish_reason"],
        "stop_reason": None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--reply-text", required=True)
    parser.add_argument("--reply-ids", required=True, help="comma-separated token ids of the reply")
    parser.add_argument("--max-model-len", type=int, default=40960)
    args = parser.parse_args()
    ids = [int(i) for i in args.reply_ids.split(",")]
    app = build_app(args.model, args.reply_text, ids, args.max_model_len)
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None, backlog=4096)


if __name__ == "__main__":
    main()
