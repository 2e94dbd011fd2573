"""Benchmark 12: the research loop's turnaround. A trainer is stopped and started again with
another algorithm while vLLM, molt-proxy and the agents keep running: how long from its start
to its first step?

examples/learn_digits.py's setup: its tiny model, vLLM on CPU, molt-proxy in front, its agent
threads (8, groups of 8, 2 groups per step, lr 1e-2), and `python -m trainer` as a process
of its own (Ray, the trainer actor). A first trainer (the built-in GRPO and PPO loss) takes
one step and exits; then each restart starts a trainer with the next algorithm (the example
plug-ins of examples/algorithms/, the built-in between them), which resumes from the
checkpoint and cursor, and is timed from `Popen` to its first metrics record. The agents ran
on meanwhile, so its first groups are waiting in the proxy's store. `step_s` (the step's own
compute and vLLM refresh) is read from that record; the rest is the start: Python and
torch imports, Ray, the actor, the model and checkpoint loaded, the resumed weights pushed to
vLLM, the stream read from the cursor. Each algorithm is switched to twice: by a trainer that
starts Ray itself (the default), and by one that joins a Ray cluster kept up across restarts
(`ray start --head`, then `--ray-address`: the workflow docs/training.md's "Iterating" gives).
Baseline: the same trainer started offline (`--trajectories`, an export of the same store, no
Ray, no proxy), to its first step.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import time
from pathlib import Path

from bench.common import OUT, PYTHON, ROOT, Section, load_average, median, proxy_server, table, tiny_model
from molt_proxy.launcher import RayNode, VLLMServer, free_port
from trainer.metrics import read

ALGORITHMS = ROOT / "examples" / "algorithms"
SWITCHES = [
    ("CISPO loss", ["--loss", f"{ALGORITHMS}/cispo.py:cispo"]),
    ("built-in (GRPO, PPO)", []),
    ("GiGPO-style advantage", ["--advantage", f"{ALGORITHMS}/gigpo.py:gigpo"]),
    ("DAPO overlong shaping", ["--reward-shaping", f"{ALGORITHMS}/dapo_overlong.py:digits"]),
]


RAY_UP = ("Started a local Ray instance", "Connected to Ray cluster")
"""What Ray logs once `ray.init` is done: having started its own instance, or joined one."""


def trainer(
    source: list[str], model: Path, out: Path, steps: int, flags: list[str], log: Path
) -> tuple[float, float]:
    """Run `python -m trainer` to `steps`: the seconds from its start to its first new record,
    and to Ray being up (`RAY_UP` in its log; nan offline: no Ray)."""
    shown = records(out)
    offset, wall = log.stat().st_size, time.time()
    command = [
        PYTHON, "-m", "trainer", *source, "--model", str(model), "--train-out", str(out),
        "--max-steps", str(steps), "--group-size", "8", "--groups-per-step", "2", "--lr", "1e-2",
        "--group-timeout", "30", *flags,
    ]  # fmt: skip
    started = time.monotonic()
    with log.open("ab") as sink:
        env = {**os.environ, "RAY_AUTH_MODE": "token"}  # a join sends the token (`ray_head`)
        process = subprocess.Popen(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, env=env)
    first = None
    while process.poll() is None or first is None:
        if first is None and records(out) > shown:
            first = time.monotonic() - started
        if process.poll() is not None and first is None:
            if process.returncode != 0:
                raise RuntimeError(f"the trainer failed: {log.read_text()[-3000:]}")
            first = float("nan")  # every step skipped: no record
        time.sleep(0.05)
    with log.open("rb") as f:
        f.seek(offset)
        lines = f.read().decode(errors="replace").splitlines()
    ray = [line[:23] for line in lines if any(up in line for up in RAY_UP)]
    if not ray:
        return first, float("nan")
    up = time.mktime(time.strptime(ray[0][:19], "%Y-%m-%d %H:%M:%S")) + int(ray[0][20:23]) / 1000
    return first, up - wall


def ray_head(work: Path) -> RayNode:
    """A Ray head kept up across restarts, as `ray start --head` would be: token auth on (the
    trainers join it with RAY_AUTH_MODE=token and this user's ~/.ray/auth_token), no dashboard,
    in a short temp dir (Ray's socket paths are long)."""
    folder = Path("/tmp") / f"ray-bench-{os.getpid()}"
    shutil.rmtree(folder, ignore_errors=True)
    args = ["--head", "--port", str(free_port()), "--temp-dir", str(folder), "--include-dashboard", "false"]
    head = RayNode([*args, "--disable-usage-stats"], work / "ray-head.log", {"RAY_AUTH_MODE": "token"})
    return head.start()


def records(out: Path) -> int:
    """Records in metrics.jsonl, a line being written not yet counted."""
    try:
        return len(read(out / "metrics.jsonl"))
    except ValueError:
        return 0


def run(quick: bool = False) -> Section:
    restarts = 2 if quick else len(SWITCHES)
    section = Section(
        "restart",
        "12. Switching the algorithm: a restarted trainer's time to its first step",
        "python -m bench restart",
        "the same trainer started offline (`--trajectories`: an export of the same store, "
        "in-process, no Ray, no proxy, no vLLM), in the same run.",
    )
    load_before = load_average()
    model = tiny_model("digits")
    work = OUT / "restart"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    log = OUT / "logs" / "trainer-restart.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_bytes(b"")
    spec = importlib.util.spec_from_file_location("learn_digits", ROOT / "examples" / "learn_digits.py")
    digits = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(digits)
    rows = []
    with VLLMServer(str(model), max_model_len=256, log_path=OUT / "logs" / "vllm-restart.log") as vllm:
        with proxy_server("molt-proxy-restart", model, vllm.url, work / "store.db") as proxy:
            source = ["--proxy-url", proxy.url]
            agents = digits.Agents(proxy.url, 8, 8, trained=lambda: False)
            agents.start()
            cluster = ray_head(work)
            try:
                cold, _ = trainer(source, model, work / "live", 1, [], log)
                kept = ["--ray-address", cluster.address]
                for k, (name, flags) in enumerate(SWITCHES[:restarts]):
                    first, ray_up = trainer(source, model, work / "live", 2 + 2 * k, flags, log)
                    step_s = read(work / "live" / "metrics.jsonl")[-1]["step_s"]
                    joined, join_s = trainer(source, model, work / "live", 3 + 2 * k, flags + kept, log)
                    rows.append((name, first, ray_up, step_s, joined, join_s))
            finally:
                agents.join()
                cluster.stop()
            export = work / "export.jsonl"
            subprocess.run(
                [PYTHON, "-m", "molt_proxy", "export", "--db", str(work / "store.db"), "--out", str(export)],
                cwd=ROOT, check=True, capture_output=True, env={**os.environ},
            )  # fmt: skip
    offline = []
    for name, flags in SWITCHES[:restarts]:
        shutil.rmtree(work / "offline", ignore_errors=True)
        first, _ = trainer(["--trajectories", str(export)], model, work / "offline", 1, flags, log)
        offline.append((name, first))
    section.body.append(
        f"One machine, everything on its CPUs: vLLM (CPU, tiny model), molt-proxy, {8} agent "
        f"threads, and each trainer process. The first trainer (built-in algorithm, cold: "
        f"{cold:.1f} s to its first step) ran 1 step; then {restarts} restarts, each with the "
        "next algorithm, each resuming the checkpoint and cursor of the one before."
    )
    section.body.append(
        table(
            [
                "restarted with",
                "own Ray: start → first step, s",
                "of which: start → Ray up, s",
                "the step (step_s), s",
                "kept Ray: start → first step, s",
                "of which: start → joined, s",
                "offline: start → first step, s",
            ],
            [
                [name, *(f"{value:.1f}" for value in (first, ray_up, step_s, joined, join_s, off))]
                for (name, first, ray_up, step_s, joined, join_s), (_, off) in zip(rows, offline, strict=True)
            ],
        )
    )
    section.body.append(
        f"Median start → first step, live: **{median([r[1] for r in rows]):.1f} s** starting Ray, "
        f"**{median([r[4] for r in rows]):.1f} s** joining a kept Ray cluster (goal: at most 30 s); "
        f"{median([o[1] for o in offline]):.1f} s offline; 1-min load average before the run "
        f"{load_before}. Agent-visible errors: {len(agents.errors)}."
    )
    return section
