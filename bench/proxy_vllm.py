"""Benchmark 1b: molt-proxy in front of a real vLLM (CPU, tiny model): its added latency as
a share of what an agent waits for end to end.

The baseline is the same agents talking to vLLM's own `/v1/chat/completions` directly (vLLM
then renders and tokenizes itself); through molt-proxy, the proxy renders, stitches and
records, and vLLM gets token ids. Both generate exactly 16 tokens per turn (`ignore_eos`),
interleaved run by run. A real GPU decodes far faster than this CPU, so the share measured
here is a lower bound of the share on a GPU.
"""

from __future__ import annotations

import json

from bench.common import OUT, Section, median, ms, proxy_server, ratio, table, tiny_model
from bench.proxy import Frontend, loadgen, warm
from molt_proxy.launcher import VLLMServer


def run(quick: bool = False) -> Section:
    repeats, seconds = (1, 4.0) if quick else (3, 8.0)
    concurrencies = (1, 8)
    section = Section(
        "proxy_vllm",
        "1b. molt-proxy's added latency in front of a real vLLM (CPU)",
        "python -m bench proxy_vllm",
        "the same multi-turn agents sent straight to vLLM's `/v1/chat/completions`, interleaved with "
        "the runs through molt-proxy, against the same vLLM server.",
    )
    model = tiny_model("qwen3")
    extra = ["--model", str(model), "--extra", json.dumps({"ignore_eos": True}), "--max-tokens", "16"]
    results: dict[tuple[str, int], list[dict]] = {}
    with VLLMServer(str(model), max_model_len=2048, log_path=OUT / "logs" / "vllm-proxy-bench.log") as vllm:
        for path in OUT.glob("proxy-vllm-bench.db*"):
            path.unlink()
        proxy = proxy_server("molt-proxy-vllm", model, vllm.url, OUT / "proxy-vllm-bench.db")
        with proxy:
            targets = [Frontend("vLLM direct", vllm.url), Frontend("through molt-proxy", proxy.url)]
            for target in targets:
                warm(target, str(model))
            for rep in range(repeats):
                for concurrency in concurrencies:
                    for target in targets if rep % 2 == 0 else targets[::-1]:
                        result = loadgen(target, concurrency, seconds, *extra)
                        results.setdefault((target.name, concurrency), []).append(result)
                        print(f"  {target.name:>18} c={concurrency} {result}", flush=True)
    rows = []
    for concurrency in concurrencies:
        direct, proxied = results[("vLLM direct", concurrency)], results[("through molt-proxy", concurrency)]
        added = [p["p50"] - d["p50"] for p, d in zip(proxied, direct, strict=True)]
        share = [(p["p50"] - d["p50"]) / p["p50"] for p, d in zip(proxied, direct, strict=True)]
        d_rps, p_rps = median([r["rps"] for r in direct]), median([r["rps"] for r in proxied])
        rows.append(
            [
                concurrency,
                ms(median([r["p50"] for r in direct])),
                ms(median([r["p50"] for r in proxied])),
                ms(median(added)),
                f"{median(share):.1%}",
                f"{d_rps:.1f}",
                f"{p_rps:.1f}",
                ratio(p_rps, d_rps),
                sum(r["errors"] for r in direct + proxied),
            ]
        )
    section.body.append(
        f"Median of {repeats} runs of {seconds:.0f} s (2 s warm-up) per cell; sessions of 5 turns "
        "with growing history, 16 generated tokens per turn, temperature 1; tiny Qwen3 (hidden 64, "
        "2 layers, real tokenizer and template) on vLLM CPU (`--dtype float32 --enforce-eager`). "
        "Share = (proxy p50 − direct p50) / proxy p50, per repetition, then the median."
    )
    section.body.append(
        table(
            [
                "sessions",
                "direct p50 ms",
                "via proxy p50 ms",
                "added p50 ms",
                "added / end-to-end",
                "direct req/s",
                "via proxy req/s",
                "proxy / direct req/s",
                "errors",
            ],
            rows,
        )
    )
    return section
