"""A stand-in API server that records what a harness CLI sends (Claude Code, Codex, Gemini CLI;
the rollout adapters' tests put it in front of the proxy too).

The CLIs are run against it twice: to capture the requests the tiny Qwen3 model learns
(answered by a script), and in the tests, where it passes each request on to a molt-proxy
and streams the proxy's answer back, so the test sees exactly what the CLI sent.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

ReplyEvents = Callable[[dict[str, Any]], list[dict[str, Any]]]
"""The server-sent events that answer a request body."""


def named_events(events: list[dict[str, Any]]) -> str:
    """Anthropic's and Responses' stream: each event's `type` as its SSE `event:` name."""
    return "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events)


def data_events(events: list[dict[str, Any]]) -> str:
    """Gemini's stream (`?alt=sse`): `data:` lines only."""
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events)


@contextmanager
def recording_server(
    reply_events: ReplyEvents,
    forward_to: str | None = None,
    *,
    encode: Callable[[list[dict[str, Any]]], str] = named_events,
    paths: list[str] | None = None,
) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A server on a free port that records every request body, in order, and answers with
    `reply_events(body)` (written by `encode`), or passes the request on to `forward_to` (a
    molt-proxy, or one of its `/s/<session>` paths) and streams its answer back; yields its URL
    and the bodies. Each POST's path (and query) is appended to `paths` where given."""
    bodies: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def do_HEAD(self) -> None:  # Claude Code probes its base URL first
            status = httpx.head(forward_to + self.path).status_code if forward_to else 200
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_GET(self) -> None:  # mini-swe-agent's, OpenCode's and Qwen Code's adapters ask for the model
            answer = httpx.get(forward_to + self.path, headers=self._passed()) if forward_to else None
            body = answer.content if answer else b""
            self.send_response(answer.status_code if answer else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers["Content-Length"]))
            bodies.append(json.loads(raw))
            if paths is not None:
                paths.append(self.path)
            if forward_to:
                return self._forward(forward_to, raw)
            events = encode(reply_events(bodies[-1]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(events.encode())))
            self.end_headers()
            self.wfile.write(events.encode())

        def _passed(self) -> dict[str, str]:
            skip = {"host", "content-length", "connection", "accept-encoding"}
            return {k: v for k, v in self.headers.items() if k.lower() not in skip}

        def _forward(self, url: str, raw: bytes) -> None:
            request = {"content": raw, "headers": self._passed(), "timeout": 600}
            with httpx.stream("POST", url + self.path, **request) as answer:
                self.send_response(answer.status_code)
                self.send_header("Content-Type", answer.headers.get("content-type", "application/json"))
                self.send_header("Connection", "close")  # the body ends where the connection does
                self.end_headers()
                for chunk in answer.iter_raw():
                    self.wfile.write(chunk)
                    self.wfile.flush()
            self.close_connection = True

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", bodies
    finally:
        server.shutdown()
        server.server_close()
