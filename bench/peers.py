"""Benchmark 13: the systems an RL user would pick instead of molt-proxy, in the same run.

Agent Lightning's LLM proxy (PyPI `agentlightning`) and rLLM's model gateway (PyPI
`rllm-model-gateway`) both sit between an agent and vLLM and record what it sampled. Each is
installed by this benchmark, pinned, into a venv of its own (bench/.<name>-venv; never the
project's), and started the way its docs say (`bench/peer_servers.py`).

1. **Capture quality.** The same multi-turn tool episodes (a tool call, its result, an answer,
   a follow-up question and its tool call) through each system against one real CPU vLLM, the
   Qwen3 and Llama-3.2 templates (tiny models taught the weather script), three ways: echoing
   each reply as it came, echoing it as pydantic-ai does (arguments compact, keys sorted), and
   streamed. A recording tap (`bench/tap.py`) between every system and vLLM is the witness of
   what vLLM saw and sampled; each system's record, read as its trainer side reads it, is
   compared with it (`bench/capture.py`).
2. **Overhead.** requests/s and CPU per request on the instant mock, at 1/64/256 sessions,
   streamed and not, beside the aiohttp pass-through, LiteLLM and molt-proxy
   (`bench/proxy.py`'s front-ends and measurement, with the peers added).
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from dataclasses import dataclass
from typing import Any

import httpx

from bench.capture import Call, Trace, Verdict, judge, per_call
from bench.common import (
    OUT,
    PYTHON,
    ROOT,
    Child,
    Section,
    proxy_server,
    table,
)
from bench.peer_servers import (
    AGENTLIGHTNING,
    AGENTLIGHTNING_KEY,
    PEERS,
    RLLM,
    Peer,
    agentlightning_child,
    ensure,
    installed,
    new_rollout,
    rllm_child,
)
from bench.proxy import (
    LITELLM,
    STREAMING_NOTE,
    Frontend,
    durability_note,
    measure,
    rps_ratios,
    start_frontends,
    start_mock,
    tables,
    tiny_model,
    warm,
)
from molt_proxy.launcher import VLLMServer, free_port

# -- capture quality ---------------------------------------------------------------------------

FAMILIES = {"qwen3": "hermes", "llama": "llama3_json"}
TEMPLATES = {"qwen3": "Qwen3", "llama": "Llama-3.2"}
WAYS = ("echoed as returned", "echoed as pydantic-ai does", "streamed")


def compact(message: dict[str, Any]) -> dict[str, Any]:
    """pydantic-ai's echo: tool arguments compact with sorted keys, content trimmed."""
    for call in message.get("tool_calls") or []:
        arguments = json.loads(call["function"]["arguments"])
        call["function"]["arguments"] = json.dumps(arguments, separators=(",", ":"), sort_keys=True)
    if message.get("content"):
        message["content"] = message["content"].strip()
    return message


Ids = tuple[list[int], list[int]]


def ask(base: str, history: list[dict[str, Any]], tools: list[dict], stream: bool) -> tuple[dict, Ids | None]:
    """One chat request: the reply's message as an agent appends it (streams accumulated), and
    the prompt and completion ids the reply itself carries (vLLM's fields, as Agent Lightning
    relays them), if it carries both."""
    body: dict[str, Any] = {"model": "tiny", "messages": history, "tools": tools, "temperature": 0}
    body["max_tokens"] = 80
    headers = {"authorization": f"Bearer {AGENTLIGHTNING_KEY}"}
    if not stream:
        reply = httpx.post(f"{base}/chat/completions", json=body, headers=headers, timeout=300)
        reply.raise_for_status()
        data = reply.json()
        choice = data["choices"][0]
        keep = ("role", "content", "tool_calls")
        completion = choice.get("token_ids") or (choice.get("provider_specific_fields") or {}).get(
            "token_ids"
        )
        ids = (data["prompt_token_ids"], completion) if data.get("prompt_token_ids") and completion else None
        return {k: v for k, v in choice["message"].items() if v is not None and k in keep}, ids
    message: dict[str, Any] = {"role": "assistant", "content": None}
    calls: dict[int, dict[str, Any]] = {}
    prompt: list[int] = []
    sampled: list[int] = []
    streamed = {**body, "stream": True}
    with httpx.stream(
        "POST", f"{base}/chat/completions", json=streamed, headers=headers, timeout=300
    ) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            prompt = prompt or chunk.get("prompt_token_ids") or []
            for choice in chunk.get("choices") or []:
                sampled += choice.get("token_ids") or []
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    message["content"] = (message["content"] or "") + delta["content"]
                for call in delta.get("tool_calls") or []:
                    slot = calls.setdefault(
                        call["index"],
                        {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
                    )
                    slot["id"] += call.get("id") or ""
                    function = call.get("function") or {}
                    slot["function"]["name"] += function.get("name") or ""
                    slot["function"]["arguments"] += function.get("arguments") or ""
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    if message["content"] is None:
        del message["content"]
    return message, (prompt, sampled) if prompt and sampled else None


def play(base: str, family: str, way: str) -> tuple[list[dict[str, Any]], list[Ids | None]]:
    """The weather episode's first three turns, each reply echoed `way`: the question (a tool
    call), its results (the answer), a follow-up question (another call). Tool results come in
    the script's order, whatever the calls' ids. Returns the replies and the ids each carried."""
    from devtools.scripts import weather_episode

    script = weather_episode(FAMILIES[family])  # type: ignore[arg-type]
    messages = script["messages"]
    results = [m["content"] for m in messages if m["role"] == "tool"]
    history = messages[:2]
    replies, carried = [], []
    stream = way == "streamed"
    for follow_up in (None, None, "And Tokyo?"):
        if follow_up:
            history.append({"role": "user", "content": follow_up})
        reply, ids = ask(base, history, script["tools"], stream)
        replies.append(reply)
        carried.append(ids)
        history.append(compact(json.loads(json.dumps(reply))) if way == WAYS[1] else reply)
        for call in reply.get("tool_calls") or []:
            history.append({"role": "tool", "tool_call_id": call["id"], "content": results.pop(0)})
    return replies, carried


def molt_traces(url: str, session: str) -> list[Trace]:
    """molt-proxy's trajectories of `session` (one per segment), as its trainer reads them."""
    httpx.post(
        f"{url}/v1/rewards", json={"session_id": session, "reward": 1.0}, timeout=30
    ).raise_for_status()
    data = httpx.get(f"{url}/v1/trajectories", params={"limit": 10000}, timeout=30).json()["data"]
    return [
        Trace(t["token_ids"], [bool(m) for m in t["loss_mask"]], t["logprobs"], t["weight_versions"])
        for t in data
        if t["session_id"] == session
    ]


def rllm_traces(url: str, session: str, calls: int) -> list[Trace]:
    """rLLM's traces of `session` (one per call), as `GatewayClient.get_session_traces` reads
    them; traces are written after the reply, so wait (10 s at most) for all `calls`."""
    traces: list[dict[str, Any]] = []
    for _ in range(50):
        httpx.post(f"{url}/admin/flush", timeout=30)
        traces = httpx.get(f"{url}/sessions/{session}/traces", timeout=30).json()
        if len(traces) >= calls:
            break
        time.sleep(0.2)
    traces.sort(key=lambda t: t.get("timestamp", 0))
    return [per_call(t["prompt_token_ids"], t["completion_token_ids"], t.get("logprobs")) for t in traces]


def agentlightning_traces(store: str, prefix: str, calls: int) -> tuple[list[Trace], int]:
    """Agent Lightning's triplets of one attempt (one per call) as its `LlmProxyTraceToTriplet`
    adapter makes them from the proxy's spans (`bench/peer_agentlightning.py dump`); spans are
    exported in batches, so wait (20 s at most) for all `calls`. Also returns the span count."""
    _, rollout, _, attempt = prefix.strip("/").split("/")
    command = [str(AGENTLIGHTNING.python), str(ROOT / "bench" / "peer_agentlightning.py"), "dump"]
    command += ["--store", store, "--rollout", rollout, "--attempt", attempt]
    out: dict[str, Any] = {"spans": 0, "triplets": []}
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"agentlightning dump failed: {done.stderr[-2000:]}")
        out = json.loads(done.stdout.strip().splitlines()[-1])
        if len(out["triplets"]) >= calls:
            break
        time.sleep(1)
    traces = [per_call(t["prompt_ids"], t["completion_ids"], t["logprobs"]) for t in out["triplets"]]
    return traces, out["spans"]


@dataclass(slots=True)
class Episode:
    system: str
    family: str
    way: str
    calls: int
    verdict: Verdict
    tool_calls: int


def capture(family: str, notes: list[str]) -> list[Episode]:
    """Every way of every system on one template, against one vLLM (behind the tap)."""
    from devtools import build_tiny_model
    from devtools.scripts import weather_episode

    model = build_tiny_model(
        OUT / "models" / f"peers-{family}",
        family,  # type: ignore[arg-type]
        scripts=[weather_episode(FAMILIES[family])],  # type: ignore[arg-type]
    )
    parser = FAMILIES[family]
    extra = ["--served-model-name", "tiny", "--enable-auto-tool-choice", "--tool-call-parser", parser]
    episodes: list[Episode] = []
    children: list[Child] = []
    log = OUT / "logs" / f"vllm-peers-{family}.log"
    with VLLMServer(str(model), max_model_len=2048, extra_args=extra, log_path=log) as vllm:
        try:
            port = free_port()
            tap = Child(
                "tap",
                [PYTHON, "-m", "bench.tap", "--port", str(port), "--upstream", vllm.url],
                f"http://127.0.0.1:{port}",
            )
            children.append(tap.start(health="/health"))
            db = OUT / f"peers-molt-{family}.db"
            for path in OUT.glob(db.name + "*"):
                path.unlink()
            molt = proxy_server(
                f"molt-proxy-peers-{family}", model, tap.url, db, args=["--tool-call-parser", parser]
            )
            children.append(molt.start())
            systems: dict[str, Any] = {"molt-proxy": molt.url}
            if AGENTLIGHTNING.python.exists():
                al, store = agentlightning_child(tap.url, "tiny")
                children.append(al.start(health="/health/liveliness"))
                systems["agentlightning"] = (al.url, store)
            if RLLM.python.exists():
                children.append(rllm_child(tap.url, OUT / f"peers-rllm-{family}.db").start())
                systems["rllm"] = children[-1].url
            for way in WAYS:
                for system, where in systems.items():
                    httpx.post(f"{tap.url}/_tap/clear", timeout=30)
                    session = f"{family}-{WAYS.index(way)}-{uuid.uuid4().hex[:8]}"
                    if system == "molt-proxy":
                        base = f"{where}/s/{session}/v1"
                    elif system == "rllm":
                        base = f"{where}/sessions/{session}/v1"
                    else:
                        prefix = new_rollout(where[1])
                        base = f"{where[0]}{prefix}/v1"
                    try:
                        replies, carried = play(base, family, way)
                    except httpx.HTTPError as exc:
                        notes.append(f"{system}, {TEMPLATES[family]}, {way}: the episode failed: {exc!r}")
                        continue
                    truth = [
                        Call(c["prompt_ids"], c["sampled_ids"], c["logprobs"])
                        for c in httpx.get(f"{tap.url}/_tap", timeout=30).json()
                    ]
                    if system == "molt-proxy":
                        traces = molt_traces(where, session)
                    elif system == "rllm":
                        traces = rllm_traces(where, session, len(truth))
                    else:
                        traces, _ = agentlightning_traces(where[1], prefix, len(truth))
                    tool_calls = sum(len(r.get("tool_calls") or []) for r in replies)
                    found = [(system, traces)]
                    if system == "agentlightning":  # what an agent-side tracer could keep
                        in_replies = [per_call(p, c, None) for p, c in filter(None, carried)]
                        found.append(("agentlightning (ids in its replies)", in_replies))
                    for name, kept in found:
                        verdict = judge(truth, kept)
                        episodes.append(Episode(name, family, way, len(truth), verdict, tool_calls))
                        print(f"  {name:>15} {family:>6} {way:<28} {verdict}", flush=True)
        finally:
            for child in reversed(children):
                child.stop()
    return episodes


def capture_table(episodes: list[Episode]) -> str:
    rows = []
    for system in dict.fromkeys(e.system for e in episodes):
        mine = [e for e in episodes if e.system == system]
        exact = sum(e.verdict.ids_exact for e in mine)
        traces = sorted({e.verdict.traces for e in mine})
        calls = sorted({e.calls for e in mine})
        chains = sorted({e.verdict.chains for e in mine})
        logprobs = sorted({e.verdict.logprobs for e in mine})
        versions = sorted({e.verdict.versions for e in mine})
        rows.append(
            [
                system,
                f"{exact} / {len(mine)}",
                "–".join(map(str, [traces[0], traces[-1]] if len(traces) > 1 else traces)),
                "–".join(map(str, [calls[0], calls[-1]] if len(calls) > 1 else calls)),
                "–".join(map(str, [chains[0], chains[-1]] if len(chains) > 1 else chains)),
                ", ".join(logprobs),
                "yes" if versions == [True] else "no" if versions == [False] else "some",
            ]
        )
    header = [
        "system",
        "episodes whose recorded ids = vLLM's",
        "traces (segments) per episode",
        "vLLM calls per episode",
        "sequences vLLM saw per episode",
        "logprobs vs vLLM's",
        "per-token weight versions",
    ]
    return table(header, rows)


def detail_table(episodes: list[Episode]) -> str:
    rows = [
        [
            e.system,
            TEMPLATES[e.family],
            e.way,
            e.calls,
            e.tool_calls,
            "yes" if e.verdict.ids_exact else f"no: {e.verdict.why}",
            e.verdict.traces,
            e.verdict.chains,
            e.verdict.logprobs,
            "yes" if e.verdict.versions else "no",
        ]
        for e in episodes
    ]
    header = [
        "system",
        "template",
        "episode",
        "calls",
        "tool calls",
        "ids exact",
        "traces",
        "sequences vLLM saw",
        "logprobs",
        "versions",
    ]
    return table(header, rows)


# -- the benchmark ----------------------------------------------------------------------------


def versions_line() -> str:
    parts = ["molt-proxy at the commit above"]
    for peer in PEERS:
        got = installed(peer, peer.package)
        parts.append(f"{peer.package} {got or 'not installed'}")
    al_litellm = installed(AGENTLIGHTNING, "litellm")
    if al_litellm:
        parts.append(f"(Agent Lightning's LiteLLM {al_litellm})")
    if LITELLM.exists():
        lite = Peer("litellm", "litellm", "")
        parts.append(f"LiteLLM (bench/.litellm-venv) {installed(lite, 'litellm')}")
    return ", ".join(parts)


def run(quick: bool = False) -> Section:
    repeats, seconds = (1, 2.0) if quick else (3, 4.0)
    section = Section(
        "peers",
        "13. The peers an RL user would pick instead: Agent Lightning's proxy and rLLM's gateway",
        "python -m bench peers",
        "for capture, a recording tap between each system and the same vLLM (`bench/tap.py`): what "
        "vLLM was given and sampled, call by call; for overhead, the same load sent straight to the "
        "instant mock (`direct`) and through a bare aiohttp pass-through, round-robin with "
        "molt-proxy, LiteLLM and the peers, in the same run.",
    )
    notes: list[str] = []
    for peer in PEERS:
        try:
            ensure(peer)
        except (subprocess.SubprocessError, OSError) as exc:
            notes.append(f"{peer.package} {peer.version} could not be installed here: {exc!r}")
    section.body.append(f"Versions measured: {versions_line()}.")
    episodes: list[Episode] = []
    for family in FAMILIES:
        episodes += capture(family, notes)
    section.body.append(
        "**Capture quality** against a real vLLM on CPU (tiny models with the real Qwen3 and "
        "Llama-3.2 tokenizers and templates, taught the weather script; temperature 0, vLLM's own "
        "tool parser for the peers, the same parser name for molt-proxy). Each episode: the "
        "question (the model calls the weather tool), the tool's result (it answers), a follow-up "
        "question (it calls the tool again); played echoing each reply as returned, as pydantic-ai "
        "echoes it (arguments compact, keys sorted), and streamed. Recorded ids = vLLM's: every "
        "call's prompt ids and sampled ids, as the tap saw them, begin one of the system's traces "
        "with exactly the sampled ids marked as sampled. Each system's record is read as its "
        "trainer side reads it: molt-proxy's `/v1/trajectories` after the reward; rLLM's "
        "`GET /sessions/{id}/traces`; Agent Lightning's spans through its `LlmProxyTraceToTriplet`."
    )
    section.body.append(capture_table(episodes))
    section.body.append(detail_table(episodes))
    children: list[Child] = []
    model = tiny_model("qwen3")
    try:
        mock, ids = start_mock(model, children)
        frontends, _ = start_frontends(mock, model, children, notes, clients=("aiohttp",))
        if AGENTLIGHTNING.python.exists():
            al, store = agentlightning_child(mock.url, "tiny")
            children.append(al.start(health="/health/liveliness"))
            url = al.url + new_rollout(store)
            frontends.append(Frontend("agentlightning", url, AGENTLIGHTNING_KEY, al.process.pid))
        if RLLM.python.exists():
            gateway = rllm_child(mock.url, OUT / "peers-rllm-load.db").start()
            children.append(gateway)
            frontends.append(Frontend("rllm", f"{gateway.url}/sessions/load", pid=gateway.process.pid))
        for frontend in frontends:
            warm(frontend)
        modes = [False, True]
        commits: list[float] = []
        results = measure(frontends, modes, repeats, seconds, commits)
    finally:
        for child in reversed(children):
            child.stop()
    section.body.append(
        f"**Overhead** on the instant mock (`bench/proxy.py`'s load, front-ends and measurement): "
        f"each cell the median of {repeats} run(s) of {seconds:.0f} s or more after 2 s warm-up, C "
        "concurrent sessions of 5 turns, `max_tokens` 16; the mock replies "
        f"{len(ids)} tokens and, where asked (`return_token_ids`, `logprobs`: both peers ask), "
        "vLLM's token-id and logprob fields. CPU per request counts each front-end's processes "
        "(Agent Lightning's: the store server and the proxy process it launches)."
    )
    section.body += tables(frontends, results, modes)
    names = [f.name for f in frontends]
    for peer in ("agentlightning", "rllm", "litellm"):
        if peer in names:
            section.body += rps_ratios(results, modes, "molt-proxy", peer)
    notes.append(STREAMING_NOTE)
    notes.append(durability_note(commits))
    section.body.append("\n".join(f"- {note}" for note in notes))
    return section
