"""Benchmark 6: the whole loop, agents → molt-proxy → vLLM → Ray trainer → new weights, on
examples/learn_digits.py's task, with its reward curve.

It runs the example unchanged (its own command line), then reads what it left behind: the
store (every finalized trajectory, its tokens and finalization time), the trainer's
metrics.jsonl (per step: tokens, compute, refresh and step time, reward) and the reward
curve PNG, copied next to RESULTS.md. The baseline is rollout alone: the example's own agents
against the same kind of vLLM + molt-proxy with no trainer, in the same run, so the cost of
training alongside (CPU shared with the trainer, pauses for refreshes) shows as a ratio.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import time
from pathlib import Path
from types import ModuleType

from bench.common import HOME, OUT, PYTHON, ROOT, Section, median, proxy_server, ratio, table
from molt_proxy.launcher import VLLMServer
from molt_proxy.store import read_trajectories
from trainer.metrics import read

PNG = HOME / "bench" / "reward_curve.png"


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("learn_digits", ROOT / "examples" / "learn_digits.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rollout_only(model: Path, agents: int, group_size: int, seconds: float) -> dict[str, float]:
    """The example's agents against vLLM + molt-proxy without a trainer: episodes/s, tokens/s."""
    example = _example()
    for path in OUT.glob("e2e-rollout.db*"):
        path.unlink()
    with VLLMServer(str(model), max_model_len=256, log_path=OUT / "logs" / "vllm-e2e-rollout.log") as vllm:
        proxy = proxy_server("molt-proxy-e2e-rollout", model, vllm.url, OUT / "e2e-rollout.db")
        with proxy:
            runner = example.Agents(proxy.url, agents, group_size, lambda: False)
            runner.start()
            time.sleep(5.0)  # warm-up
            first = runner.episodes
            started = time.monotonic()
            time.sleep(seconds)
            done, elapsed = runner.episodes - first, time.monotonic() - started
            runner.join()
            errors = len(runner.errors)
    records = read_trajectories(OUT / "e2e-rollout.db")
    tokens = median([len(r["token_ids"]) for r in records])
    return {"episodes_per_s": done / elapsed, "tokens_per_s": done * tokens / elapsed, "errors": errors}


def run(quick: bool = False) -> Section:
    steps, seconds = (4, 20.0) if quick else (20, 60.0)
    section = Section(
        "e2e",
        "6. End to end: agents → molt-proxy → vLLM → trainer (examples/learn_digits.py)",
        "python -m bench e2e",
        "rollout alone — the example's 8 agents against vLLM + molt-proxy with no trainer, "
        f"{seconds:.0f} s, in the same run.",
    )
    out = OUT / "digits"
    command = [PYTHON, "examples/learn_digits.py", "--out", str(out), "--steps", str(steps)]
    started = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    wall = time.monotonic() - started
    (OUT / "logs").mkdir(parents=True, exist_ok=True)
    (OUT / "logs" / "learn_digits.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(
            f"learn_digits failed ({done.returncode}); see {OUT / 'logs' / 'learn_digits.log'}"
        )
    match = re.search(r"(\d+) episodes, (\d+) agent-visible errors", done.stdout)
    episodes, errors = (int(match.group(1)), int(match.group(2))) if match else (0, -1)
    metrics = read(out / "train" / "metrics.jsonl")
    records = read_trajectories(out / "molt-proxy.db")
    span = max(r["created"] for r in records) - min(r["created"] for r in records)
    tokens = sum(len(r["token_ids"]) for r in records)
    sampled = sum(sum(r["loss_mask"]) for r in records)
    trained_tokens = sum(m["tokens"] for m in metrics)
    train_span = metrics[-1]["time"] - metrics[0]["time"] + metrics[0]["step_s"]
    if (out / "train" / "reward_curve.png").exists():
        shutil.copyfile(out / "train" / "reward_curve.png", PNG)
    baseline = rollout_only(out / "model", 8, 8, seconds)
    loop_rate = len(records) / span
    section.body.append(
        f"`python examples/learn_digits.py --out bench/out/digits --steps {steps}` (8 agents, "
        "groups of 8, 2 groups per step, lr 1e-2, one refresh per step): "
        f"{steps} steps in {wall:.0f} s wall including start-up; {episodes} episodes; "
        f"agent-visible errors: **{errors}**."
    )
    section.body.append(
        table(
            ["", "full loop (training)", "rollout only (baseline)", "loop / baseline"],
            [
                [
                    "trajectories/s finalized",
                    f"{loop_rate:.2f}",
                    f"{baseline['episodes_per_s']:.2f}",
                    ratio(loop_rate, baseline["episodes_per_s"]),
                ],
                [
                    "tokens/s recorded (prompt + sampled)",
                    f"{tokens / span:,.0f}",
                    f"{baseline['tokens_per_s']:,.0f}",
                    ratio(tokens / span, baseline["tokens_per_s"]),
                ],
                ["sampled tokens/s", f"{sampled / span:,.0f}", "–", "–"],
                [
                    "trainer tokens/s (trained tokens / training wall time)",
                    f"{trained_tokens / train_span:,.0f}",
                    "–",
                    "–",
                ],
            ],
        )
    )
    step_s = median([m["step_s"] for m in metrics])
    compute_s = median([m["compute_s"] for m in metrics])
    refresh_s = median([m["refresh_s"] for m in metrics])
    section.body.append(
        "Per trainer step (medians from metrics.jsonl): "
        f"step {step_s * 1000:,.0f} ms = compute (advantages, collate, train_step) "
        f"{compute_s * 1000:,.0f} ms "
        f"+ refresh (save weights, POST /v1/admin/weights) {refresh_s * 1000:,.0f} ms + checkpoint and "
        f"bookkeeping {(step_s - compute_s - refresh_s) * 1000:,.0f} ms; "
        f"share of the step outside compute: **{1 - compute_s / step_s:.0%}**. Trainer tokens/s "
        f"during compute: {median([m['tokens_per_s'] for m in metrics]):,.0f}."
    )
    quarter = max(1, len(metrics) // 4)
    first = sum(m["reward_mean"] for m in metrics[:quarter]) / quarter
    last = sum(m["reward_mean"] for m in metrics[-quarter:]) / quarter
    curve = " ".join(f"{m['reward_mean']:.2f}" for m in metrics)
    section.body.append(
        f"Reward (share of digits in the reply): first quarter of steps {first:.3f} → last quarter "
        f"{last:.3f}. Per step: {curve}.\n\n![reward curve](reward_curve.png)"
    )
    return section
