"""The whole loop on one machine, in minutes: agents → molt-proxy → vLLM → Ray trainer → new
weights in vLLM, while the agents keep running.

The task is small enough for a tiny random model on 2 CPU cores to visibly learn: each
episode asks for a number, and the reward is the share of digits in the reply. A random
model writes almost no digits (its small byte-level vocabulary has ~300 tokens), so the
reward starts near 0 and has all the way to 1 to climb. Every few steps, and after the last,
a few greedy episodes run as evaluation sessions (`"train": false`): never trained on, their
reward logged per weight version.

    python examples/learn_digits.py      # writes runs/digits/ (reward_curve.png among it)

Any other flag is the trainer's (`molt-proxy serve --help`), so the same task runs with your
algorithm: `python examples/learn_digits.py --loss examples/algorithms/cispo.py:cispo`.
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from openai import OpenAI

from devtools import PROMPTS, build_tiny_model, digit_share
from molt_proxy.launcher import ProxyServer
from trainer.metrics import progress_line, read, summary_line


class Agents:
    """`n` agent threads, each running episodes until told to stop; episodes are numbered so
    that consecutive `group_size` of them share a group (and a prompt)."""

    def __init__(self, proxy_url: str, n: int, group_size: int, trained: Callable[[], bool]):
        self.proxy_url, self.group_size = proxy_url, group_size
        self.trained = trained
        """True once the last step is done: the server then winds down under the agents."""
        self.counter = itertools.count()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.episodes = 0
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(n)]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def join(self) -> None:
        self.stop.set()
        for thread in self.threads:
            if thread.ident is not None:  # started: a run that failed early never started them
                thread.join(timeout=60)

    def _loop(self) -> None:
        http = httpx.Client(base_url=self.proxy_url, timeout=120)
        while not self.stop.is_set():
            with self.lock:
                episode = next(self.counter)
            group = episode // self.group_size
            try:
                run_episode(http, {"group_id": f"g{group}"}, PROMPTS[group % len(PROMPTS)], temperature=1.0)
                with self.lock:
                    self.episodes += 1
            except Exception as exc:  # an agent-visible error: counted and reported, never hidden
                if not self.stop.is_set() and not self.trained():
                    self.errors.append(repr(exc))


class Evaluator(threading.Thread):
    """Every `every` trainer steps (and before the first, and once all `steps` are logged: the
    trainer waits for those), `episodes` greedy episodes in evaluation sessions (`"train":
    false`): recorded and rewarded, never trained on; the trainer logs their reward per weight
    version (`eval_reward`). A skipped step (a solved batch) writes no line: after one, the
    final weights are evaluated only if their version is a multiple of `every`."""

    def __init__(
        self, proxy_url: str, metrics: Path, every: int, steps: int, episodes: int, stop: threading.Event
    ):
        super().__init__(daemon=True)
        self.proxy_url, self.metrics, self.stop = proxy_url, metrics, stop
        self.every, self.steps, self.episodes = every, steps, episodes

    def run(self) -> None:
        http = httpx.Client(base_url=self.proxy_url, timeout=120)
        evaluated = -1
        while not self.stop.wait(1.0):
            done = len(read(self.metrics))
            due = done if done >= self.steps else done - done % self.every  # the version to evaluate
            if due == evaluated:
                continue
            evaluated = due
            for i in range(self.episodes):
                try:
                    body = {"group_id": f"p{i}", "train": False}
                    run_episode(http, body, PROMPTS[i % len(PROMPTS)], temperature=0.0)
                except Exception:  # the server winding down at the end of the run
                    return


def run_episode(http: httpx.Client, session_body: dict, prompt: str, temperature: float) -> None:
    """One episode: a session, one reply, its reward (the share of digits)."""
    session = http.post("/v1/sessions", json=session_body).json()
    client = OpenAI(base_url=session["base_url"], api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=8,
        temperature=temperature,
    )
    reward = digit_share(reply.choices[0].message.content or "")
    http.post("/v1/rewards", json={"session_id": session["session_id"], "reward": reward}).raise_for_status()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="runs/digits")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--groups-per-step", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=5, help="greedy evaluation every N steps")
    parser.add_argument("--eval-episodes", type=int, default=4)
    args, trainer_flags = parser.parse_known_args()
    out = Path(args.out)
    if out.exists():
        subprocess.run(["rm", "-rf", str(out)], check=True)
    model = build_tiny_model(out / "model", "qwen3", fallback_tokenizer=True, teach=False, seed=args.seed)
    flags = [
        "--max-model-len", "256", "--train",
        "--train-out", str(out / "train"), "--max-steps", str(args.steps), "--lr", str(args.lr),
        "--group-size", str(args.group_size), "--groups-per-step", str(args.groups_per_step),
        "--group-timeout", "30", "--seed", str(args.seed), *trainer_flags,
    ]  # fmt: skip
    # The proxy's log (one line per request) goes to a file; the progress lines are read back.
    log = out / "molt-proxy.log"
    server = ProxyServer(model, db=out / "molt-proxy.db", args=flags, log_path=log)
    print(f"starting vLLM, molt-proxy and the Ray trainer (log: {log}) ...", flush=True)
    server.spawn()
    metrics = out / "train" / "metrics.jsonl"
    # The trainer is done once it drew its reward curve: every step taken or skipped (a solved
    # batch, all rewards equal, is skipped and writes no metrics line).
    curve = out / "train" / "reward_curve.png"
    agents = Agents(server.url, args.agents, args.group_size, curve.exists)
    evaluator = Evaluator(server.url, metrics, args.eval_every, args.steps, args.eval_episodes, agents.stop)
    try:
        server.wait(timeout_s=600)
        print(f"watch the run: {server.url}/ui (trajectories, live) and {server.url}/metrics", flush=True)
        wait_for_trainer(server)
        agents.start()
        evaluator.start()
        # Agents run until the trainer's last step is logged; then the server winds down.
        shown = 0
        while server.returncode is None and not curve.exists():
            shown = show_progress(metrics, shown, args.steps)
            time.sleep(0.2)
        agents.join()
        server.process.wait()
        show_progress(metrics, shown, args.steps)
    finally:
        agents.join()
        server.stop()
    records = read(metrics)
    quarter = max(1, len(records) // 4)
    first = sum(r["reward_mean"] for r in records[:quarter]) / quarter
    last = sum(r["reward_mean"] for r in records[-quarter:]) / quarter
    print(f"\ntrainer: {summary_line(out / 'train')}")
    print(f"{agents.episodes} episodes, {len(agents.errors)} agent-visible errors {agents.errors[:3]}")
    print(f"mean reward: first quarter {first:.3f} → last quarter {last:.3f}")
    print("reward per step: " + sparkline([r["reward_mean"] for r in records]))
    evaluations = {v: r for record in records for v, r in record.get("eval_reward", {}).items()}
    print(
        "greedy evaluation reward by weight version: "
        + ", ".join(f"v{v} {r:.3f}" for v, r in evaluations.items())
    )
    print(f"reward curve: {out / 'train' / 'reward_curve.png'}")
    if server.returncode != 0 or not records:
        exited = f"molt-proxy serve --train exited with {server.returncode}"
        sys.exit(f"{exited} after {len(records)} steps (log: {log})")


def show_progress(metrics: Path, shown: int, max_steps: int) -> int:
    """Print the progress line of every step logged since the first `shown`; returns how many
    are shown now (a line being written is left for the next call)."""
    try:
        records = read(metrics)
    except ValueError:
        return shown
    for record in records[shown:]:
        print(progress_line(record, max_steps), flush=True)
    return len(records)


def wait_for_trainer(server: ProxyServer, timeout_s: float = 600) -> None:
    """Until the trainer has pushed its weights (version 0) into vLLM. Episodes sampled before
    it starts would pile up at version 0 and arrive more than `--max-staleness` versions old:
    steps spent on them would teach nothing."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and server.returncode is None:
        replicas = httpx.get(f"{server.url}/health", timeout=10).json()["replicas"]
        if all(r["weight_version"] is not None for r in replicas):
            return
        time.sleep(0.5)
    raise TimeoutError("the trainer did not load its weights into vLLM in time")


def sparkline(values: list[float]) -> str:
    """The reward curve in the terminal, one character per step (0 → ▁, 1 → █)."""
    bars = "▁▂▃▄▅▆▇█"
    return "".join(bars[min(len(bars) - 1, max(0, int(v * len(bars))))] for v in values)


if __name__ == "__main__":
    main()
