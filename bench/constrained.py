"""Benchmark 10: what vLLM records as the logprob of a constrained token (issue 11, item 3).

Under structured outputs vLLM samples each token from the policy's logits with a grammar
mask applied (tokens the grammar forbids at -inf) before its sampler. The proxy records the
logprob vLLM returns in `--logprobs-mode processed_logprobs`; the question is which
distribution that is: the masked one (renormalised over the allowed tokens), or the
policy's own, unmasked one, which is what the trainer's forward pass computes.

One molt-proxy (`--tool-call-parser hermes`) in front of one CPU vLLM (float32) on the
untaught tiny Qwen3; constrained requests of three kinds (a forced named tool call with a
strict schema, `response_format` `json_schema`, `json_object`) at temperature 1, each in a
session of its own, rewarded, read back from the trajectory stream. Every sampled token is
then recomputed with a float32 `transformers` forward: log p (unmasked), and log p masked by
the same grammar (xgrammar, which vLLM uses, driven token by token over the sampled ids)
and renormalised. The baseline is unconstrained turns of the same model in the same run,
where the record equals the unmasked log p.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import torch
import xgrammar as xgr
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

from bench.common import OUT, Section, table, tiny_model
from molt_proxy.launcher import ProxyServer, VLLMServer
from molt_proxy.parsing import ReplyParser
from molt_proxy.tokenizer import Tokenizer

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string"}, "confidence": {"type": "number"}},
    "required": ["answer", "confidence"],
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CASES: dict[str, dict[str, Any]] = {
    "none (baseline)": {},
    "tool_choice named": {"tools": [TOOL], "tool_choice": NAMED},
    "response_format json_schema": {
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    },
    "response_format json_object": {"response_format": {"type": "json_object"}},
}


def _requests(url: str, case: str, extra: dict[str, Any], count: int) -> None:
    with httpx.Client(base_url=url, timeout=300) as client:
        for i in range(count):
            session = f"{case.replace(' ', '-')}-{i}"
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": f"Weather in city {i}? Answer in JSON."}],
                "max_tokens": 64,
                "temperature": 1.0,
                "seed": i,
                **extra,
            }
            reply = client.post("/v1/chat/completions", json=body, headers={"x-session-id": session})
            reply.raise_for_status()
            client.post("/v1/rewards", json={"session_id": session, "reward": 0.0}).raise_for_status()


def _matcher(constraint: dict[str, Any], compiler: xgr.GrammarCompiler) -> xgr.GrammarMatcher:
    """The grammar vLLM's xgrammar backend compiles for these structured outputs."""
    if "structural_tag" in constraint:
        return xgr.GrammarMatcher(compiler.compile_structural_tag(constraint["structural_tag"]))
    schema = constraint["json"] if "json" in constraint else {"type": "object"}
    text = schema if isinstance(schema, str) else json.dumps(schema)
    return xgr.GrammarMatcher(compiler.compile_json_schema(text, any_whitespace=True))


def _measure(
    record: dict[str, Any], model: torch.nn.Module, matcher: xgr.GrammarMatcher | None, vocab: int
) -> list[tuple[float, float, float, int]]:
    """Per sampled token: (recorded, unmasked log p, masked log p, allowed tokens)."""
    ids = record["token_ids"]
    turn = record["turns"][0]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    rows = []
    for position in range(turn["completion_start"], turn["completion_end"]):
        row = logits[position - 1, :vocab].clone()
        unmasked = float(row.log_softmax(-1)[ids[position]])
        masked, allowed = unmasked, vocab
        if matcher is not None and not matcher.is_terminated():
            matcher.fill_next_token_bitmask(bitmask)
            xgr.apply_token_bitmask_inplace(row, bitmask)
            masked = float(row.log_softmax(-1)[ids[position]])
            allowed = int(torch.isfinite(row).sum())
            matcher.accept_token(ids[position])
        rows.append((record["logprobs"][position], unmasked, masked, allowed))
    return rows


def _summary(case: str, rows: list[tuple[float, float, float, int]]) -> list[object]:
    forced = [r for r in rows if r[3] == 1]
    free = [r for r in rows if r[3] > 1]
    return [
        case,
        len(rows),
        len(forced),
        f"{max(abs(r[0] - r[2]) for r in rows):.1e}",
        f"{max(abs(r[0] - r[1]) for r in rows):.2f}",
        f"{sum(r[0] - r[1] for r in rows) / len(rows):.2f}",
        f"{max((abs(r[0]) for r in forced), default=0.0):.1e}" if forced else "-",
        f"{sum(r[1] for r in forced) / len(forced):.2f}" if forced else "-",
        f"{sum(r[0] - r[1] for r in free) / len(free):.3f}" if free else "-",
    ]


def _conclusion(rows: list[tuple[float, float, float, int]]) -> str:
    """What the numbers say, from the numbers (a rerun with other results says otherwise)."""
    to_masked = max(abs(r[0] - r[2]) for r in rows)
    to_unmasked = max(abs(r[0] - r[1]) for r in rows)
    if to_masked <= 1e-4 < to_unmasked:
        return (
            f"On all {len(rows)} constrained tokens the recorded logprob is the masked, renormalised "
            f"distribution's (within {to_masked:.1e}), not the policy's (up to {to_unmasked:.2f} apart): a "
            "token the grammar forced (one allowed token) is recorded at 0.0 whatever the policy gave "
            "it, and every other constrained token at its log p minus the log of the probability mass "
            "the grammar allowed. The trainer computes the unmasked log p, so these tokens are not "
            "samples it can reweigh: `--constrained-turns skip` (the default) leaves them out."
        )
    if to_unmasked <= 1e-4:
        return f"The recorded logprob is the unmasked policy's (within {to_unmasked:.1e}) on all {len(rows)}."
    return f"Neither: {to_masked:.1e} from the masked, {to_unmasked:.1e} from the unmasked distribution."


def run(quick: bool = False) -> Section:
    count = 2 if quick else 6
    model_dir = tiny_model("qwen3")
    vllm_log, db = OUT / "logs" / "vllm-constrained.log", OUT / "constrained.db"
    vllm_log.parent.mkdir(parents=True, exist_ok=True)
    db.unlink(missing_ok=True)
    with VLLMServer(str(model_dir), max_model_len=2048, log_path=vllm_log) as vllm:
        args = ["--tool-call-parser", "hermes"]
        log = OUT / "logs" / "proxy-constrained.log"
        with ProxyServer(model_dir, upstreams=[vllm.url], db=db, args=args, log_path=log) as proxy:
            for case, extra in CASES.items():
                _requests(proxy.url, case, extra, count)
            records = httpx.get(f"{proxy.url}/v1/trajectories", params={"limit": 1000}).json()["data"]
    hf = AutoTokenizer.from_pretrained(model_dir)
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab))
    parser = ReplyParser(Tokenizer.load(str(model_dir)), "hermes", None)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    results, constrained_rows = [], []
    for index, (case, extra) in enumerate(CASES.items()):
        body = {"messages": [{"role": "user", "content": "x"}], **extra}
        request = ChatCompletionRequest.model_validate(body)
        constraint = parser.structured_outputs(request)
        rows = []
        for record in records[index * count : (index + 1) * count]:
            assert record["turns"][0]["constrained"] == (constraint is not None), record["trajectory_id"]
            matcher = _matcher(constraint, compiler) if constraint is not None else None
            rows += _measure(record, model, matcher, vocab)
        results.append(_summary(case, rows))
        constrained_rows += rows if constraint is not None else []
    header = [
        "constraint",
        "sampled tokens",
        "forced (1 allowed)",
        "max abs(recorded − masked)",
        "max abs(recorded − unmasked)",
        "mean recorded − unmasked",
        "max abs(recorded) on forced",
        "mean unmasked on forced",
        "mean recorded − unmasked on free",
    ]
    return Section(
        name="constrained",
        title="10. Logprobs vLLM records on constrained tokens",
        command="python -m bench constrained",
        baseline="unconstrained turns of the same model in the same run (first row): the record is log p.",
        body=[
            f"{count} requests per kind (T = 1, seeds 0..{count - 1}, at most 64 tokens), untaught tiny "
            "Qwen3 on a CPU vLLM (float32, `processed_logprobs`); every sampled token recomputed with a "
            "float32 forward, unmasked and masked by the same grammar (xgrammar) and renormalised.",
            table(header, results),
            _conclusion(constrained_rows),
        ],
    )


if __name__ == "__main__":
    print(run(quick=True).render(0.0))
