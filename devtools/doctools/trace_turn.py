"""How many of the proxy's modules one turn crosses, and how often control switches between them:
one representative turn per API format, traced through the real app.

    python -m devtools.doctools.trace_turn               # the table
    python -m devtools.doctools.trace_turn --show chat   # one turn's calls, module by module

Its numbers are docs/architecture.md's (One turn, module by module). It lives in `doctools/`,
not beside `devtools/tinymodel.py`, whose build key hashes the files there: editing it does not
rebuild a taught model.

The app is `create_app` with the real Qwen3 tokenizer and chat template and a real SQLite
store, driven in this process through httpx's `ASGITransport` (no socket between client and
app). vLLM is the instant stand-in of `bench/mock_upstream.py`, on a loopback port in a thread
of its own, which always samples one tool call (`get_weather` for Paris) as Qwen3 writes it, so
that the proxy parses it with vLLM's `hermes` parser. Each format plays a two-turn episode
twice: the first episode warms the caches (the template's probes, vLLM's model info), and the
second episode's second turn is traced. That turn echoes the first turn's tool call (with its
arguments re-serialised, as agents do, so echo restoration has work) and its result, and
continues the first turn's chain:

- `chat`: `POST /v1/chat/completions`, the call echoed as `tool_calls` with compact arguments;
- `messages`: `POST /v1/messages` (Anthropic), the call echoed as a `tool_use` block;
- `responses`: `POST /v1/responses`, continuing the first response by `previous_response_id`
  (stored, the API's default) with a `function_call_output` item;
- `gemini`: `POST /v1beta/models/tiny:generateContent` (streamed: `:streamGenerateContent?alt=sse`),
  the model content echoed as returned, then a `functionResponse` part;

each whole and streamed (`-stream`).

What is counted: `sys.setprofile` on the event loop's thread, while the traced request runs,
sees every Python function called; the calls to functions whose code lives in `molt_proxy/`
are kept, in order (a generator or coroutine resumed is not a new call). *Modules* is how many
distinct modules those calls entered; *switches*, how many consecutive kept calls are in
different modules; *calls*, how many calls were kept. SQL on the store's thread and vLLM's
stand-in run in other threads and are not counted.

Before and after the `Turn` (issue 29; before: `main` at 43096a0; Python 3.11; the same on
every run):

    turn               modules      switches     calls
    chat               30 -> 29    111 -> 106    399 -> 389
    chat-stream        31 -> 30    269 -> 247    740 -> 724
    messages           31 -> 29    116 -> 106    430 -> 420
    messages-stream    31 -> 30    259 -> 231    762 -> 746
    responses          34 -> 32    117 -> 108    423 -> 414
    responses-stream   34 -> 33    294 -> 272    831 -> 822

Since then (issue 30, the Gemini API; `messages` has two more switches, 108 and 233: a helper it
shares with the Gemini decoder moved to `conversation.py`):

    gemini             31    114    498
    gemini-stream      32    233    792
"""

from __future__ import annotations

import argparse
import asyncio
import dis
import json
import sys
import tempfile
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import httpx
from aiohttp import web

import molt_proxy
from bench.mock_upstream import build_app as build_mock_vllm
from devtools.tokenizers import tokenizer_source
from molt_proxy.app import create_app
from molt_proxy.config import Settings
from molt_proxy.launcher import free_port
from molt_proxy.tokenizer import Tokenizer

PACKAGE = Path(molt_proxy.__file__).resolve().parent
SYSTEM = "You are a weather assistant."
ASKED = "What is the weather in Paris?"
RESULT = "Sunny, 21 degrees."
SAMPLED = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
"""What the stand-in vLLM samples every turn (then `<|im_end|>`): Qwen3's tool call."""
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


# -- the trace -------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class Call:
    module: str
    """Dotted, under `molt_proxy` (`wire.openai`)."""
    function: str


class Tracer:
    """The calls into `molt_proxy/` made on this thread while `tracing()` is on."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self._modules: dict[str, str | None] = {}
        self._first: dict[CodeType, int] = {}

    def _module(self, filename: str) -> str | None:
        if filename not in self._modules:
            path = Path(filename).resolve()
            inside = path.is_relative_to(PACKAGE)
            self._modules[filename] = (
                ".".join(path.relative_to(PACKAGE).with_suffix("").parts) if inside else None
            )
        return self._modules[filename]

    def _resumed(self, frame: FrameType) -> bool:
        """Whether a generator's or coroutine's frame resumes (its first `RESUME` is behind it)
        rather than starts."""
        code = frame.f_code
        if not code.co_flags & (0x20 | 0x80 | 0x200):  # generator, coroutine, async generator
            return False
        if code not in self._first:
            self._first[code] = next(i.offset for i in dis.get_instructions(code) if i.opname == "RESUME")
        return frame.f_lasti > self._first[code]

    def _profile(self, frame: FrameType, event: str, arg: object) -> None:
        if event != "call":
            return
        module = self._module(frame.f_code.co_filename)
        if module is not None and not self._resumed(frame):
            self.calls.append(Call(module, frame.f_code.co_qualname))

    @contextmanager
    def tracing(self) -> Iterator[None]:
        sys.setprofile(self._profile)
        try:
            yield
        finally:
            sys.setprofile(None)


@dataclass(slots=True, frozen=True)
class Counted:
    turn: str
    modules: int
    switches: int
    calls: int


def count(turn: str, calls: list[Call]) -> Counted:
    switches = sum(a.module != b.module for a, b in zip(calls, calls[1:], strict=False))
    return Counted(turn, len({c.module for c in calls}), switches, len(calls))


def runs(calls: list[Call]) -> list[tuple[str, list[str]]]:
    """The calls grouped into runs of one module: (module, the functions called in that run)."""
    grouped: list[tuple[str, list[str]]] = []
    for call in calls:
        if grouped and grouped[-1][0] == call.module:
            grouped[-1][1].append(call.function)
        else:
            grouped.append((call.module, [call.function]))
    return grouped


# -- the turns -------------------------------------------------------------------------------


Post = Callable[[str, dict[str, Any]], Awaitable[httpx.Response]]


async def _chat(post: Post, stream: bool) -> Callable[[], Awaitable[httpx.Response]]:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": ASKED},
    ]
    first = (
        await post("/v1/chat/completions", {"model": "tiny", "messages": messages, "tools": tools})
    ).json()
    [call] = first["choices"][0]["message"]["tool_calls"]
    arguments = json.dumps(json.loads(call["function"]["arguments"]), separators=(",", ":"))
    echoed = {
        "id": call["id"],
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [echoed]},
        {"role": "tool", "tool_call_id": call["id"], "content": RESULT},
    ]
    body = {"model": "tiny", "messages": messages, "tools": tools, "stream": stream}
    return lambda: post("/v1/chat/completions", body)


async def _messages(post: Post, stream: bool) -> Callable[[], Awaitable[httpx.Response]]:
    tools = [{"name": "get_weather", "description": "The weather in a city.", "input_schema": PARAMETERS}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": ASKED}]
    body = {"model": "tiny", "max_tokens": 64, "system": SYSTEM, "tools": tools, "messages": messages}
    first = (await post("/v1/messages", body)).json()
    [use] = [block for block in first["content"] if block["type"] == "tool_use"]
    messages += [
        {"role": "assistant", "content": [use]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": RESULT}]},
    ]
    again = {**body, "messages": messages, "stream": stream}
    return lambda: post("/v1/messages", again)


async def _responses(post: Post, stream: bool) -> Callable[[], Awaitable[httpx.Response]]:
    tools = [{"type": "function", "name": "get_weather", "parameters": PARAMETERS}]
    body = {"model": "tiny", "instructions": SYSTEM, "input": ASKED, "tools": tools}
    first = (await post("/v1/responses", body)).json()
    [call] = [item for item in first["output"] if item["type"] == "function_call"]
    output = {"type": "function_call_output", "call_id": call["call_id"], "output": RESULT}
    again = {**body, "input": [output], "previous_response_id": first["id"], "stream": stream}
    return lambda: post("/v1/responses", again)


async def _gemini(post: Post, stream: bool) -> Callable[[], Awaitable[httpx.Response]]:
    declaration = {"name": "get_weather", "description": "The weather in a city.", "parameters": PARAMETERS}
    contents: list[dict[str, Any]] = [{"role": "user", "parts": [{"text": ASKED}]}]
    body = {
        "systemInstruction": {"parts": [{"text": SYSTEM}]},
        "tools": [{"functionDeclarations": [declaration]}],
        "contents": contents,
    }
    first = (await post("/v1beta/models/tiny:generateContent", body)).json()
    parts = first["candidates"][0]["content"]["parts"]
    [call] = [part["functionCall"] for part in parts if "functionCall" in part]
    answer = {"functionResponse": {"id": call["id"], "name": "get_weather", "response": {"output": RESULT}}}
    contents += [{"role": "model", "parts": parts}, {"role": "user", "parts": [answer]}]
    action = "streamGenerateContent?alt=sse" if stream else "generateContent"
    return lambda: post(f"/v1beta/models/tiny:{action}", {**body, "contents": contents})


FORMATS = {"chat": _chat, "messages": _messages, "responses": _responses, "gemini": _gemini}
TURNS = [f"{name}{suffix}" for name in FORMATS for suffix in ("", "-stream")]


async def _trace(app: Any, turns: list[str]) -> dict[str, list[Call]]:
    traced: dict[str, list[Call]] = {}
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=60) as client,
    ):

        async def post(path: str, body: dict[str, Any]) -> httpx.Response:
            response = await client.post(path, json=body)
            if response.status_code != 200:
                raise RuntimeError(f"{path} answered {response.status_code}: {response.text[:500]}")
            return response

        for turn in turns:
            name, _, streamed = turn.partition("-")
            play = FORMATS[name]
            await (await play(post, bool(streamed)))()  # warms the caches
            second = await play(post, bool(streamed))
            tracer = Tracer()
            with tracer.tracing():
                response = await second()
            events = response.text.split("\n\n")
            if streamed and "error" in events[max(-3, -len(events))]:
                raise RuntimeError(f"{turn} failed: {response.text[-500:]}")
            traced[turn] = tracer.calls
    return traced


@contextmanager
def _stand_in(model: Path) -> Iterator[str]:
    """The stand-in vLLM, sampling `SAMPLED` every turn, on a loopback port; yields its URL."""
    tokenizer = Tokenizer.load(str(model))
    reply_ids = [*tokenizer.encode(SAMPLED), tokenizer.hf.convert_tokens_to_ids("<|im_end|>")]
    port, loop = free_port(), asyncio.new_event_loop()
    runner = web.AppRunner(build_mock_vllm("tiny", SAMPLED, reply_ids, 40960), access_log=None)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, name="stand-in-vllm", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


def trace(turns: list[str]) -> dict[str, list[Call]]:
    """The calls into `molt_proxy/` of each traced turn (see the module)."""
    model = tokenizer_source("qwen3")
    if model is None:
        raise SystemExit("the real qwen3 tokenizer is not in $MOLT_PROXY_TOKENIZERS or ../shared/tokenizers")
    with tempfile.TemporaryDirectory() as folder, _stand_in(model) as upstream:
        settings = Settings(
            model=str(model),
            upstreams=[upstream],
            db_path=Path(folder) / "trace.db",
            tool_call_parser="hermes",
            health_interval_s=3600.0,  # no health probe runs inside a traced turn
        )
        return asyncio.run(_trace(create_app(settings), turns))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m devtools.doctools.trace_turn", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--show", choices=TURNS, help="print this turn's calls, module by module")
    args = parser.parse_args(argv)
    if args.show:
        for module, functions in runs(trace([args.show])[args.show]):
            print(f"{module:<24} {', '.join(functions)}")
        return 0
    traced = trace(TURNS)
    print(f"{'turn':<18}{'modules':>8}{'switches':>10}{'calls':>7}")
    for turn, calls in traced.items():
        counted = count(turn, calls)
        print(f"{counted.turn:<18}{counted.modules:>8}{counted.switches:>10}{counted.calls:>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
