"""Agent Lightning's LLM proxy for `bench/peers.py`, run by the Python of its own venv
(bench/.agentlightning-venv: `agentlightning` is never imported by the project).

`serve` starts it as its own example does (examples/minimal/llm_proxy.py at v0.3.0,
`serve_llm_proxy_with_vllm`): an `InMemoryLightningStore` behind a `LightningStoreServer`, and
an `LLMProxy` with one model, `hosted_vllm/<model>` at the upstream's `/v1`, with the default
middlewares (`rollout_attempt`, `stream_conversion`) and callbacks (`return_token_ids`,
`opentelemetry`) and the default launch mode (`mp`: the proxy is a process of its own, a child
of this one). Agents call `/rollout/<rollout>/attempt/<attempt>/v1/chat/completions`.

`dump` prints, as JSON, what Agent Lightning's trainer side gets from the proxy's spans of one
attempt: `LlmProxyTraceToTriplet` (its adapter for these spans), one triplet per call, each
with its prompt and response ids; and the logprobs the raw span's choices carry, if any.

    python bench/peer_agentlightning.py serve --port P --store-port S --upstream URL --model NAME
    python bench/peer_agentlightning.py dump --store URL --rollout R --attempt A
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
from typing import Any

import agentlightning as agl
from agentlightning.utils.server_launcher import PythonServerLauncherArgs


async def serve(args: argparse.Namespace) -> None:
    store = agl.InMemoryLightningStore()
    store_server = agl.LightningStoreServer(store, "127.0.0.1", args.store_port)
    await store_server.start()
    model_list = [
        {
            "model_name": args.model,
            "litellm_params": {"model": f"hosted_vllm/{args.model}", "api_base": f"{args.upstream}/v1"},
        }
    ]
    # The example's `port=...`, as launcher arguments: the same launch (mode "mp", one worker) with
    # a longer start-up wait than its 60 s, which a loaded 2-core machine overran.
    launcher = PythonServerLauncherArgs(port=args.port, launch_mode="mp", startup_timeout=300.0)
    proxy = agl.LLMProxy(launcher_args=launcher, model_list=model_list, store=store_server)  # type: ignore[arg-type]
    try:
        await proxy.start()
        await asyncio.sleep(float("inf"))
    finally:
        await proxy.stop()
        await store_server.stop()


def _literal(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return ast.literal_eval(value)
        except (ValueError, SyntaxError):
            return value
    return value


async def dump(args: argparse.Namespace) -> None:
    from agentlightning.adapter import LlmProxyTraceToTriplet

    client = agl.LightningStoreClient(args.store)
    spans = await client.query_spans(args.rollout, args.attempt)
    await client.close()
    triplets = LlmProxyTraceToTriplet().adapt(spans)
    logprobs: dict[str, list[float]] = {}
    for span in spans:
        if span.name != "raw_gen_ai_request":
            continue
        choices = _literal((span.attributes or {}).get("llm.hosted_vllm.choices"))
        response_id = (span.attributes or {}).get("llm.hosted_vllm.id")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            content = (choices[0].get("logprobs") or {}).get("content") or []
            values = [float(e["logprob"]) for e in content if isinstance(e, dict) and "logprob" in e]
            if values and isinstance(response_id, str):
                logprobs[response_id] = values
    out = [
        {
            "prompt_ids": t.prompt.get("token_ids") or [],
            "completion_ids": t.response.get("token_ids") or [],
            "logprobs": logprobs.get(str(t.metadata.get("response_id"))),
        }
        for t in triplets
    ]
    print(json.dumps({"spans": len(spans), "triplets": out}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("serve")
    run.add_argument("--port", type=int, required=True)
    run.add_argument("--store-port", type=int, required=True)
    run.add_argument("--upstream", required=True)
    run.add_argument("--model", required=True)
    show = sub.add_parser("dump")
    show.add_argument("--store", required=True)
    show.add_argument("--rollout", required=True)
    show.add_argument("--attempt", required=True)
    args = parser.parse_args()
    asyncio.run(serve(args) if args.command == "serve" else dump(args))


if __name__ == "__main__":
    main()
