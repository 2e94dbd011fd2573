#!/usr/bin/env bash
# The GPU paths CPU CI cannot run, in one shot of under 10 minutes on a machine with an NVIDIA
# GPU: `molt-proxy serve --train` on a small real-architecture model (Qwen3, 16 layers, hidden
# 1024, ~150M parameters), three times, a few steps each, with agents running throughout:
#
#   files      weights through safetensors (the default; the one-process trainer on CPU)
#   transfer   weights GPU to GPU with vLLM's weight-transfer engine (the trainer on GPU):
#              nccl with two GPUs or more (trainer and vLLM must be on distinct GPUs: NCCL
#              refuses two ranks on one device), ipc (CUDA IPC) with one GPU shared
#   fp32       transfer again, vLLM in float32 instead of bfloat16
#
# and prints, per run: refresh seconds (median over steps), trainer tokens/s, the gap between
# vLLM's logprobs and the trainer's on the same weights (`--max-staleness 0`, so every trained
# token was sampled by the weights the trainer holds: exp(pi - mu) is the numerics alone; a
# wrong transfer shows here), and the agents' errors (must be 0).
#
#   scripts/gpu_check.sh [OUT]      # OUT defaults to /tmp/molt-gpu-check
#
# Needs the GPU extra (vLLM with CUDA); installs it into the current Python if it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${1:-/tmp/molt-gpu-check}
nvidia-smi -L
GPUS=$(nvidia-smi -L | wc -l)
if ! "$PY" -c "import torch, vllm; assert torch.cuda.is_available()" 2>/dev/null; then
    "$PY" -m pip install -q -e ".[gpu]"
fi
TRANSFER=$([ "$GPUS" -ge 2 ] && echo nccl || echo ipc)
rm -rf "$OUT" && mkdir -p "$OUT"
"$PY" - "$OUT" "$TRANSFER" <<'EOF'
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, "examples")
from learn_digits import Agents, wait_for_trainer  # noqa: E402

from devtools import build_tiny_model  # noqa: E402
from molt_proxy.launcher import ProxyServer  # noqa: E402
from trainer.metrics import read  # noqa: E402

out, transfer = Path(sys.argv[1]), sys.argv[2]
model = build_tiny_model(out / "model", "qwen3", hidden_size=1024, num_layers=16, fallback_tokenizer=True, teach=False)
RUNS = [("files", "files", "bfloat16"), ("transfer", transfer, "bfloat16"), ("fp32", transfer, "float32")]


def run(name: str, weight_transfer: str, dtype: str) -> dict:
    folder = out / name
    flags = [
        "--train", "--train-out", str(folder / "train"), "--max-steps", "5", "--lr", "1e-5",
        "--group-size", "4", "--groups-per-step", "2", "--group-timeout", "30", "--max-staleness", "0",
        "--weight-transfer", weight_transfer, "--max-model-len", "256",
        "--vllm-arg=--gpu-memory-utilization=0.25", "--vllm-arg=--enforce-eager", f"--vllm-arg=--dtype={dtype}",
    ]  # fmt: skip
    server = ProxyServer(model, db=folder / "p.db", args=flags, log_path=folder / "serve.log")
    curve = folder / "train" / "reward_curve.png"
    agents = Agents(server.url, 8, 4, curve.exists)
    started = time.monotonic()
    try:
        server.spawn().wait(timeout_s=300)
        wait_for_trainer(server, timeout_s=120)
        agents.start()
        while server.returncode is None and not curve.exists() and time.monotonic() - started < 170:
            time.sleep(0.5)
        agents.join()
    finally:
        server.stop()
    records = read(folder / "train" / "metrics.jsonl")
    log = (folder / "serve.log").read_text()
    return {
        "run": name,
        "transport": weight_transfer,
        "vllm_dtype": dtype,
        "steps": len(records),
        "refresh_s_median": statistics.median(r["refresh_s"] for r in records) if records else None,
        "trainer_tokens_per_s": statistics.median(r["tokens_per_s"] for r in records) if records else None,
        "is_ratio_mean": statistics.mean(r["is_ratio_mean"] for r in records) if records else None,
        "is_ratio_max": max((r["is_ratio_max"] for r in records), default=None),
        "approx_kl": statistics.mean(r["approx_kl"] for r in records) if records else None,
        "episodes": agents.episodes,
        "agent_errors": len(agents.errors),
        "errors_seen": agents.errors[:3],
        "fell_back_to_files": weight_transfer != "files" and "through files" in log,
        "wall_s": round(time.monotonic() - started),
    }


results = []
for name, weight_transfer, dtype in RUNS:
    try:
        result = run(name, weight_transfer, dtype)
    except Exception as exc:  # a run that cannot start: say so, run the others
        result = {"run": name, "transport": weight_transfer, "failed": repr(exc)[:500]}
    results.append(result)
    print(json.dumps(result), flush=True)
(out / "results.json").write_text(json.dumps(results, indent=2))
print("\n| run | transport | vLLM dtype | refresh s | trainer tok/s | exp(pi-mu) mean / max | approx KL | agent errors |")
print("|---|---|---|---|---|---|---|---|")
for r in results:
    if "failed" in r:
        print(f"| {r['run']} | {r['transport']} | failed: {r['failed']} |")
        continue
    print(
        f"| {r['run']} | {r['transport']} | {r['vllm_dtype']} | {r['refresh_s_median']} | "
        f"{r['trainer_tokens_per_s']} | {r['is_ratio_mean']} / {r['is_ratio_max']} | {r['approx_kl']} "
        f"| {r['agent_errors']} |"
    )
EOF
