"""A multi-turn tool task that learns through a real CLI: Claude Code runs the task set with
`molt-proxy rollout` (`rollout.run_rollout`) against molt-proxy → vLLM, and the Ray trainer
refreshes vLLM's weights while the attempts run.

Each task is a fresh workspace of a few text files, one of which holds the word `needle`:
"Find the file that contains the word needle and write its line count to answer.txt". Claude
Code (`--bare`) asks the model, runs the Bash call it writes, shows it the (empty) output, and
the model answers; the task's check compares answer.txt with the file's line count. The tiny
model was taught a mixed script (`devtools/line_count.py`): one attempt in ten calls
`wc -l` (right), the others `wc -w` (the word count: wrong). The call differs in one token, so
the trainer trains the LM head alone (`--train-only lm_head`) at a high learning rate: the
choice moves and the rest of the episode stays as taught.

Training attempts run on fresh task instances, `--attempts` per task (one group: GRPO compares
them); held-out instances are evaluated (`--eval`: recorded, never trained on) before the
first step and every `--eval-every` weight versions, each attempt labelled with the weight
version that wrote its call. At the end it prints the success rate per version and a table of
every held-out task's successes. The defaults (6 rounds at a learning rate of 2e-2, evaluated
before and after) leave room for a slow start: the right call's share climbs within three or
four steps that saw a success, and from then on every group succeeds, so its step is skipped
and further rounds add minutes, not learning.

    python examples/learn_line_count.py      # writes runs/line-count/

Any other flag is the trainer's (`molt-proxy serve --help`). Needs Claude Code's CLI
(`scripts/setup.sh` installs it under `.tools/`).
"""

from __future__ import annotations

import argparse
import io
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from devtools import build_tiny_model, claude_code
from devtools.line_count import ARGS, MODEL, line_count_episodes, tasks
from molt_proxy.launcher import ProxyServer
from rollout.harnesses.claude_code import ClaudeCode
from rollout.results import Result
from rollout.runner import run_rollout

HELD_OUT = 1000
"""Held-out instances are seeds from here on; training instances count up from 0."""


class Training(threading.Thread):
    """`rounds` rounds of `molt-proxy rollout` on fresh task instances, `groups` tasks ×
    `attempts` each: one trainer step's groups per round (a step whose groups all succeeded or
    all failed changes nothing and is skipped: no new version)."""

    def __init__(self, url: str, out: Path, harness: ClaudeCode, args: argparse.Namespace):
        super().__init__(daemon=True)
        self.url, self.out, self.harness, self.args = url, out, harness, args
        self.rounds_done = 0
        self.results: list[Result] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for round_ in range(self.args.rounds):
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
                self.rounds_done += 1
        except BaseException as exc:  # reported by the main thread
            self.error = exc


@dataclass
class Evaluation:
    """One pass over the held-out instances, after `after` training rounds."""

    after: int
    results: list[Result]
    versions: list[int]
    """The weight version that wrote each attempt's call (its first sampled token)."""

    @property
    def success(self) -> float:
        return sum(r.reward == 1.0 for r in self.results) / len(self.results)

    @property
    def label(self) -> str:
        low, high = min(self.versions), max(self.versions)
        return f"v{low}" if low == high else f"v{low}-{high}"


def evaluate(url: str, out: Path, harness: ClaudeCode, args: argparse.Namespace, after: int) -> Evaluation:
    """Every held-out instance, `--eval-attempts` times, as evaluation sessions (never trained
    on); an attempt without a reward (the harness failed) counts as a failure."""
    held_out = tasks("held", range(HELD_OUT, HELD_OUT + args.held_out))
    results = run_rollout(
        url,
        held_out,
        harness,
        out / f"eval-after-{after}.jsonl",
        attempts=args.eval_attempts,
        concurrency=args.concurrency,
        timeout_s=args.timeout,
        eval=True,
        progress=io.StringIO(),
    )
    versions = call_versions(url)
    return Evaluation(after, results, [versions.get(r.session or "", -1) for r in results])


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
                mask, versions = record["loss_mask"], record["weight_versions"]
                found[record["session_id"]] = next(v for v, m in zip(versions, mask, strict=True) if m)
        after = data[-1]["seq"]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="runs/line-count")
    parser.add_argument(
        "--rounds", type=int, default=6, help="training rounds (a trainer step's groups each)"
    )
    parser.add_argument("--attempts", type=int, default=8, help="attempts per training task (a group)")
    parser.add_argument("--groups-per-step", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=4, help="attempts at once")
    parser.add_argument("--lr", type=float, default=2e-2)
    parser.add_argument("--held-out", type=int, default=8, help="held-out task instances")
    parser.add_argument("--eval-attempts", type=int, default=2, help="attempts per held-out task")
    parser.add_argument(
        "--eval-every", type=int, default=6, help="evaluate after every N rounds (and after the last)"
    )
    parser.add_argument("--timeout", type=float, default=300, help="seconds per attempt")
    parser.add_argument("--seed", type=int, default=0)
    args, trainer_flags = parser.parse_known_args()
    if not claude_code.installed():
        sys.exit("Claude Code's CLI is not installed: bash scripts/setup.sh installs it under .tools/")
    out = Path(args.out)
    if out.exists():
        subprocess.run(["rm", "-rf", str(out)], check=True)
    started = time.monotonic()
    # The mixed script alone (no harness's episodes), captured from the installed Claude Code:
    # each reply taught to 0.9 of its share (the right call then lies in [0.09, 0.19]).
    model = build_tiny_model(
        out / "model", "qwen3", harnesses=(), scripts=line_count_episodes(), stop_prob=0.9, seed=args.seed
    )
    taught_s = time.monotonic() - started
    flags = [
        "--served-model-name", MODEL, "--tool-call-parser", "hermes", "--max-model-len", "4096",
        "--train", "--train-out", str(out / "train"), "--max-steps", "1000",
        "--lr", str(args.lr), "--train-only", "lm_head",
        "--group-size", str(args.attempts), "--groups-per-step", str(args.groups_per_step),
        "--group-timeout", str(args.timeout * 2), "--seed", str(args.seed), *trainer_flags,
    ]  # fmt: skip
    log = out / "molt-proxy.log"
    server = ProxyServer(model, db=out / "molt-proxy.db", args=flags, log_path=log)
    print(f"starting vLLM, molt-proxy and the Ray trainer (log: {log}) ...", flush=True)
    server.spawn()
    harness = ClaudeCode(ARGS, model=MODEL)
    training = Training(server.url, out / "rollouts", harness, args)
    evaluations: list[Evaluation] = []

    def evaluated(after: int) -> None:
        evaluations.append(evaluate(server.url, out / "rollouts", harness, args, after))
        last = evaluations[-1]
        elapsed = time.monotonic() - started
        print(
            f"[{elapsed:4.0f}s] after {after} rounds: held-out success {last.success:.2f} at {last.label}",
            flush=True,
        )

    try:
        server.wait(timeout_s=600)
        wait_for_trainer(server)
        ready_s = time.monotonic() - started
        print(f"watch the run: {server.url}/ui; evaluating the taught model first", flush=True)
        evaluated(0)
        training.start()  # the trainer steps and refreshes vLLM while these attempts run
        for due in [*range(args.eval_every, args.rounds, args.eval_every), args.rounds]:
            while training.rounds_done < due and training.is_alive() and server.returncode is None:
                time.sleep(1.0)
            if training.error is not None or server.returncode is not None:
                raise RuntimeError(f"training stopped: {training.error!r}, server {server.returncode}")
            evaluated(due)  # while the next rounds run, but for the last
    finally:
        interrupt(server)
    report(evaluations, training.results, time.monotonic() - started, taught_s, ready_s)


def report(
    evaluations: list[Evaluation], training: list[Result], total_s: float, taught_s: float, ready_s: float
) -> None:
    first, last = evaluations[0], evaluations[-1]
    print("\nheld-out success after each evaluation (rounds: versions): " + ", ".join(
        f"{e.after}: {e.label} {e.success:.2f}" for e in evaluations
    ))  # fmt: skip
    print("training rounds' success: " + " ".join(
        f"{sum(r.reward == 1.0 for r in training[i : i + 8])}/{len(training[i : i + 8])}"
        for i in range(0, len(training), 8)
    ))  # fmt: skip
    print("\nper held-out task: successes / attempts at each evaluation")
    print(f"{'task':<10}" + "".join(f"{e.label:>9}" for e in evaluations))
    for task in sorted({r.task for r in first.results}, key=lambda t: int(t.rsplit("-", 1)[1])):
        cells = []
        for evaluation in evaluations:
            runs = [r for r in evaluation.results if r.task == task]
            cells.append(f"{sum(r.reward == 1.0 for r in runs)}/{len(runs)}")
        print(f"{task:<10}" + "".join(f"{c:>9}" for c in cells))
    errors = [r.error for e in evaluations for r in e.results if r.error] + [
        r.error for r in training if r.error
    ]
    attempts = len(training) + sum(len(e.results) for e in evaluations)
    print(f"\n{attempts} attempts ({len(training)} training), {len(errors)} errors {errors[:3]}")
    print(
        f"wall time {total_s:.0f}s (model ready at {taught_s:.0f}s, vLLM and the trainer at {ready_s:.0f}s)"
    )
    print(f"held-out success: {first.success:.2f} at {first.label} → {last.success:.2f} at {last.label}")


def interrupt(server: ProxyServer) -> None:
    """Stop `serve` as Ctrl-C does (SIGINT), so that it stops its vLLM and the trainer. Its
    SIGTERM (`ProxyServer.stop`) meets Ray's own handler in the serve process, which ends the
    process at once and leaves vLLM running (seen here); `stop` then reaps what is left."""
    if server.process is not None and server.returncode is None:
        server.process.send_signal(signal.SIGINT)
        try:
            server.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    server.stop()


def wait_for_trainer(server: ProxyServer, timeout_s: float = 600) -> None:
    """Until the trainer has pushed its weights (version 0) into vLLM."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and server.returncode is None:
        if weight_version(server.url) is not None:
            return
        time.sleep(0.5)
    raise TimeoutError("the trainer did not load its weights into vLLM in time")


if __name__ == "__main__":
    main()
