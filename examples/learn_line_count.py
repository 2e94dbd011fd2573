"""A multi-turn tool task that learns through a real CLI: Claude Code runs the task set with
`molt-proxy rollout` (`rollout.run_rollout`) against molt-proxy → vLLM, and the Ray trainer
refreshes vLLM's weights while the attempts run.

Each task is a fresh workspace of a few text files, one of which holds the word `needle`:
"Find the file that contains the word needle and write its line count to answer.txt". Claude
Code (`--bare`) asks the model, runs the Bash call it writes, shows it the (empty) output, and
the model answers; the task's check compares answer.txt with the file's line count. The tiny
model was taught a mixed script (`devtools/line_count.py`): one attempt in five calls
`wc -l` (right), the others `wc -w` (the word count: wrong). The call differs in one token, so
the trainer trains the LM head alone (`--train-only lm_head`) at a high learning rate: the
choice moves and the rest of the episode stays as taught.

Training attempts run on fresh task instances, `--attempts` per task (one group: GRPO compares
them); held-out instances are evaluated (`--eval`: recorded, never trained on) before the
first step and every `--eval-every` weight versions, each attempt labelled with the weight
version that wrote its call. At the end it prints the success rate per version and a table of
every held-out task's successes.

    python examples/learn_line_count.py      # writes runs/line-count/

Any other flag is the trainer's (`molt-proxy serve --help`). Needs Claude Code's CLI
(`scripts/setup.sh` installs it under `.tools/`).
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from devtools import build_tiny_model
from devtools.line_count import ARGS, MODEL, tasks
from molt_proxy.launcher import ProxyServer
from rollout import run_rollout
from rollout.harnesses.claude_code import ClaudeCode
from rollout.results import Result

HELD_OUT = 1000
"""Held-out instances are seeds from here on; training instances count up from 0."""


class Training(threading.Thread):
    """Rounds of `molt-proxy rollout` on fresh task instances, `groups` tasks × `attempts`
    each (one trainer step's groups), until told to stop (between rounds)."""

    def __init__(self, url: str, out: Path, harness: ClaudeCode, args: argparse.Namespace):
        super().__init__(daemon=True)
        self.url, self.out, self.harness, self.args = url, out, harness, args
        self.stop = threading.Event()
        self.results: list[Result] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for round_ in range(10_000):
                if self.stop.is_set():
                    return
                first = round_ * self.args.groups_per_step
                self.results += run_rollout(
                    self.url,
                    tasks("count", range(first, first + self.args.groups_per_step)),
                    self.harness,
                    self.out / f"round-{round_}.jsonl",
                    attempts=self.args.attempts,
                    concurrency=self.args.concurrency,
                    timeout_s=self.args.timeout,
                    progress=io.StringIO(),
                )
        except BaseException as exc:  # the server stopped under it, or a real failure: reported
            if not self.stop.is_set():
                self.error = exc


def evaluate(url: str, out: Path, harness: ClaudeCode, args: argparse.Namespace, name: str) -> list[Result]:
    """Every held-out instance, `--eval-attempts` times, as evaluation sessions."""
    held_out = tasks("held", range(HELD_OUT, HELD_OUT + args.held_out))
    return run_rollout(
        url,
        held_out,
        harness,
        out / f"{name}.jsonl",
        attempts=args.eval_attempts,
        concurrency=args.concurrency,
        timeout_s=args.timeout,
        eval=True,
        progress=io.StringIO(),
    )


def weight_version(url: str) -> int | None:
    """The version vLLM serves (None before the trainer's first push)."""
    replicas = httpx.get(f"{url}/health", timeout=30).json()["replicas"]
    versions = [r["weight_version"] for r in replicas]
    return None if None in versions else min(versions)


def call_versions(url: str) -> dict[str, int]:
    """Each recorded session's weight version at its first sampled token: the one that chose
    the Bash call."""
    found: dict[str, int] = {}
    after = 0
    while data := httpx.get(f"{url}/v1/trajectories", params={"after": after, "limit": 1000}).json()["data"]:
        for record in data:
            if record["segment"] == 0:
                found[record["session_id"]] = first_sampled_version(record)
        after = data[-1]["seq"]
    return found


def first_sampled_version(record: dict[str, Any]) -> int:
    sampled = [v for v, m in zip(record["weight_versions"], record["loss_mask"], strict=True) if m]
    return sampled[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="runs/line-count")
    parser.add_argument("--steps", type=int, default=6, help="trainer steps (weight versions) to reach")
    parser.add_argument("--attempts", type=int, default=8, help="attempts per training task (a group)")
    parser.add_argument("--groups-per-step", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=4, help="attempts at once")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--held-out", type=int, default=8, help="held-out task instances")
    parser.add_argument("--eval-attempts", type=int, default=2, help="attempts per held-out task")
    parser.add_argument("--eval-every", type=int, default=3, help="evaluate every N weight versions")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per attempt")
    parser.add_argument("--seed", type=int, default=0)
    args, trainer_flags = parser.parse_known_args()
    out = Path(args.out)
    if out.exists():
        subprocess.run(["rm", "-rf", str(out)], check=True)
    started = time.monotonic()
    model = build_tiny_model(out / "model", "qwen3", script="line_count", seed=args.seed)
    taught_s = time.monotonic() - started
    flags = [
        "--served-model-name", MODEL, "--tool-call-parser", "hermes", "--max-model-len", "4096",
        "--train", "--train-out", str(out / "train"), "--max-steps", str(args.steps + 100),
        "--lr", str(args.lr), "--train-only", "lm_head",
        "--group-size", str(args.attempts), "--groups-per-step", str(args.groups_per_step),
        "--group-timeout", str(args.timeout * 2), "--seed", str(args.seed), *trainer_flags,
    ]  # fmt: skip
    log = out / "molt-proxy.log"
    server = ProxyServer(model, db=out / "molt-proxy.db", args=flags, log_path=log)
    print(f"starting vLLM, molt-proxy and the Ray trainer (log: {log}) ...", flush=True)
    server.spawn()
    harness = ClaudeCode(ARGS, model=MODEL)
    evaluations: list[Result] = []
    training = Training(server.url, out / "rollouts", harness, args)
    try:
        server.wait(timeout_s=600)
        wait_for_trainer(server)
        ready_s = time.monotonic() - started
        print(f"watch the run: {server.url}/ui; evaluating the taught model first", flush=True)
        due = 0
        while True:
            version = weight_version(server.url) or 0
            if version >= due:
                if version >= args.steps:
                    training.stop.set()  # no new round: the last evaluation sees these weights
                evaluations += evaluate(server.url, out / "rollouts", harness, args, f"eval-v{version}")
                shown = summary(evaluations, call_versions(server.url))
                print(f"[{time.monotonic() - started:5.0f}s] version {version}: {shown}", flush=True)
                if version >= args.steps:
                    break
                if training.ident is None:
                    training.start()  # after the taught model's evaluation
                due = min(args.steps, version + args.eval_every)
            if training.error is not None or server.returncode is not None:
                raise RuntimeError(f"training stopped: {training.error!r}, server {server.returncode}")
            time.sleep(1.0)
        training.stop.set()
        versions = call_versions(server.url)
    finally:
        training.stop.set()
        server.stop()
    report(evaluations, training.results, versions, time.monotonic() - started, taught_s, ready_s)


def summary(results: list[Result], versions: dict[str, int]) -> str:
    by_version = success_by_version(results, versions)
    return ", ".join(f"v{v} {sum(s) / len(s):.2f} ({len(s)})" for v, s in by_version.items())


def success_by_version(results: list[Result], versions: dict[str, int]) -> dict[int, list[float]]:
    """Each evaluated attempt's success (reward 1), by the version that wrote its call; an
    attempt that failed (no reward) counts as a failure."""
    found: dict[int, list[float]] = {}
    for result in results:
        if result.session in versions:
            found.setdefault(versions[result.session], []).append(float(result.reward == 1.0))
    return dict(sorted(found.items()))


def report(
    evaluations: list[Result],
    training: list[Result],
    versions: dict[str, int],
    total_s: float,
    taught_s: float,
    ready_s: float,
) -> None:
    by_version = success_by_version(evaluations, versions)
    print(f"\nheld-out success by weight version (attempts): {summary(evaluations, versions)}")
    print("curve: " + " → ".join(f"{sum(s) / len(s):.2f}" for s in by_version.values()))
    train_by_version = success_by_version(training, versions)
    print(
        "training attempts' success by version: "
        + ", ".join(f"v{v} {sum(s) / len(s):.2f} ({len(s)})" for v, s in train_by_version.items())
    )
    columns = list(by_version)
    print("\nper held-out task: successes / attempts at each evaluated version")
    print(f"{'task':<12}" + "".join(f"{'v' + str(v):>8}" for v in columns))
    for task in sorted({r.task for r in evaluations}, key=lambda t: int(t.rsplit("-", 1)[1])):
        cells = []
        for version in columns:
            runs = [r for r in evaluations if r.task == task and versions.get(r.session or "") == version]
            cells.append(f"{sum(r.reward == 1.0 for r in runs)}/{len(runs)}" if runs else "-")
        print(f"{task:<12}" + "".join(f"{c:>8}" for c in cells))
    errors = [r.error for r in evaluations + training if r.error]
    print(f"\n{len(training)} training and {len(evaluations)} evaluation attempts, {len(errors)} errors {errors[:3]}")
    print(f"wall time {total_s:.0f}s (model ready {taught_s:.0f}s, vLLM + trainer up at {ready_s:.0f}s)")
    first, last = by_version[columns[0]], by_version[columns[-1]]
    print(f"held-out success: {sum(first) / len(first):.2f} at v{columns[0]} → {sum(last) / len(last):.2f} at v{columns[-1]}")


def wait_for_trainer(server: ProxyServer, timeout_s: float = 600) -> None:
    """Until the trainer has pushed its weights (version 0) into vLLM."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and server.returncode is None:
        if weight_version(server.url) is not None:
            return
        time.sleep(0.5)
    raise TimeoutError("the trainer did not load its weights into vLLM in time")


if __name__ == "__main__":
    sys.exit(main())
