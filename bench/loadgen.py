"""Closed-loop load: C concurrent multi-turn agent sessions against one OpenAI endpoint.

Each session sends `--turns` chat requests, each carrying the whole history so far (as an
agent does) plus one new user message, appends the reply it got, then a new session
starts. Sessions are named with `X-Session-Id` (molt-proxy uses it; the others ignore it).
Throughput counts the requests completed inside the measured window (after a warm-up; the
window lasts `--seconds` and at least until 2 × C requests completed, up to 30 s);
latency covers every request sent inside it, however late it finished. The result is one
JSON line on stdout.

It runs as its own process (aiohttp client), so that its cost lands on a core of its own
as far as two cores allow, the same for every front-end it is pointed at.

    python -m bench.loadgen --url http://127.0.0.1:8000 --concurrency 64 --seconds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from typing import Any

import aiohttp

from bench.common import median, percentile

_USER = "Turn {turn}: summarise what we discussed so far in one short sentence, then add one new fact."


async def session_loop(
    http: aiohttp.ClientSession,
    url: str,
    turns: int,
    max_tokens: int,
    stream: bool,
    api_key: str,
    extra: dict[str, Any],
    clock: dict[str, float],
    counts: dict[str, int],
    latencies: list[float],
    errors: list[str],
) -> None:
    while not clock["stopped"]:
        session_id = uuid.uuid4().hex
        history: list[dict[str, Any]] = [{"role": "system", "content": "You are a concise assistant."}]
        for turn in range(turns):
            history.append({"role": "user", "content": _USER.format(turn=turn)})
            body = {**extra, "messages": history, "max_tokens": max_tokens, "temperature": 1.0}
            if stream:
                body["stream"] = True
            sent = time.monotonic()
            try:
                async with http.post(
                    url, json=body, headers={"x-session-id": session_id, "authorization": f"Bearer {api_key}"}
                ) as resp:
                    if stream:
                        content = await _read_stream(resp)
                    else:
                        data = await resp.json(content_type=None)
                        if resp.status != 200:
                            raise RuntimeError(f"HTTP {resp.status}: {str(data)[:200]}")
                        content = data["choices"][0]["message"]["content"]
            except Exception as exc:  # counted, never hidden
                if clock["start"] <= sent < clock["end"]:
                    errors.append(repr(exc)[:200])
                break
            done = time.monotonic()
            counts["total"] += 1
            if clock["start"] <= sent < clock["end"]:
                latencies.append(done - sent)  # finished late or not: it was sent in the window
            if clock["start"] <= done <= clock["end"]:
                counts["completed"] += 1
            history.append({"role": "assistant", "content": content})
            if clock["stopped"]:
                return


async def _close_window(
    clock: dict[str, float], counts: dict[str, int], concurrency: int, cap_s: float
) -> None:
    """End the window after `--seconds`, but not before 2 × C requests completed in it (up to
    `cap_s`): with latency longer than the window, a short window would count a burst or none."""
    while True:
        await asyncio.sleep(0.05)
        now = time.monotonic()
        if now < clock["end"]:
            continue
        if counts["completed"] >= 2 * concurrency or now - clock["start"] >= cap_s:
            clock["stopped"] = 1.0
            return
        clock["end"] = now + 0.25


async def _read_stream(resp: aiohttp.ClientResponse) -> str:
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
    parts = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("data:") and line != "data: [DONE]":
            delta = json.loads(line[5:])["choices"]
            if delta and delta[0].get("delta", {}).get("content"):
                parts.append(delta[0]["delta"]["content"])
    return "".join(parts)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    now = time.monotonic()
    clock = {"start": now + args.warmup, "end": now + args.warmup + args.seconds, "stopped": 0.0}
    latencies: list[float] = []
    errors: list[str] = []
    counts = {"completed": 0, "total": 0}
    extra = {"model": args.model, **json.loads(args.extra)}
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        url = args.url.rstrip("/") + "/v1/chat/completions"
        await asyncio.gather(
            _close_window(clock, counts, args.concurrency, cap_s=max(30.0, args.seconds)),
            *(
                session_loop(
                    http,
                    url,
                    args.turns,
                    args.max_tokens,
                    args.stream,
                    args.api_key,
                    extra,
                    clock,
                    counts,
                    latencies,
                    errors,
                )
                for _ in range(args.concurrency)
            ),
        )
    window = clock["end"] - clock["start"]
    return {
        "requests": counts["completed"],
        "total_requests": counts["total"],
        "seconds": window,
        "rps": counts["completed"] / window,
        "p50": median(latencies),
        "p99": percentile(latencies, 99),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True, help="base URL; /v1/chat/completions is appended")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--extra", default="{}", help="JSON merged into every request body")
    parser.add_argument("--api-key", default="unused", help="sent as a bearer key (LiteLLM needs one)")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
