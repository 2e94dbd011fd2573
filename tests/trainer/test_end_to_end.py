"""The whole loop through real parts: agents → proxy → vLLM → Ray trainer → refreshed vLLM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.helpers import trajectories
from trainer import checkpoint
from trainer.metrics import read

ROOT = Path(__file__).resolve().parents[2]


def test_example_task_reward_climbs(tmp_path):
    """`examples/learn_digits.py`, seeded and sized for CI: the mean reward over the last
    quarter of training is clearly above the first quarter."""
    out = tmp_path / "digits"
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "learn_digits.py"), "--out", str(out), "--steps", "24"],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "0 agent-visible errors" in result.stdout
    records = read(out / "train" / "metrics.jsonl")
    # A step taken writes a line; a skipped one (every advantage 0, e.g. a solved batch) does not.
    assert [r["step"] for r in records] == list(range(1, len(records) + 1)) and len(records) >= 12
    quarter = len(records) // 4
    first = sum(r["reward_mean"] for r in records[:quarter]) / quarter
    last = sum(r["reward_mean"] for r in records[-quarter:]) / quarter
    assert last > first + 0.2, (first, last)
    assert (out / "train" / "reward_curve.png").stat().st_size > 0
    # Every step refreshed vLLM: the versions vLLM labelled tokens with reached the last steps.
    assert max(r["version"] for r in records) == len(records)


def _agents(proxy_url: str, stop_file: Path) -> subprocess.Popen:
    """Episodes in groups of 4, each rewarded by the share of digits (a separate process)."""
    code = f"""
import itertools, sys, httpx
from pathlib import Path
from openai import OpenAI
from devtools import digit_share
http = httpx.Client(base_url={proxy_url!r}, timeout=120)
for episode in itertools.count():
    if Path({str(stop_file)!r}).exists():
        break
    s = http.post("/v1/sessions", json={{"group_id": f"g{{episode // 4}}"}}).json()
    r = OpenAI(base_url=s["base_url"], api_key="x").chat.completions.create(
        model="m", messages=[{{"role": "user", "content": "Write a number."}}], max_tokens=8)
    reward = digit_share(r.choices[0].message.content or "")
    http.post("/v1/rewards", json={{"session_id": s["session_id"], "reward": reward}})
"""
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)


def _trainer(proxy_url: str, model: Path, out: Path, steps: int, log: Path) -> subprocess.Popen:
    """A trainer in its own session (killed as a whole); its output goes to `log`, and with
    the fault handler on, SIGABRT makes it print where every thread is."""
    command = [
        sys.executable, "-m", "trainer", "--proxy-url", proxy_url, "--model", str(model),
        "--train-out", str(out), "--max-steps", str(steps), "--group-size", "4", "--groups-per-step", "1",
        "--lr", "1e-3",
    ]  # fmt: skip
    with log.open("ab") as sink:
        return subprocess.Popen(
            command, cwd=ROOT, start_new_session=True, stdout=sink, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONFAULTHANDLER": "1"},
        )  # fmt: skip


def _session_alive(sid: int) -> bool:
    """Whether any process of session `sid` (a killed trainer, its Ray head and workers) is left."""
    listed = subprocess.run(["ps", "-e", "-o", "sid=,stat="], capture_output=True, text=True).stdout
    return any(int(f[0]) == sid and not f[1].startswith("Z") for f in map(str.split, listed.splitlines()))


def _wait_or_dump(process: subprocess.Popen, log: Path, timeout_s: float) -> int:
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        # Where every process is (CPU, kernel wait, allowed CPUs): a hang once showed a trainer
        # pinned to the CPU of a busy vLLM worker.
        processes = subprocess.run(
            "ps -e -o pid,sid,stat,psr,pcpu,wchan:24,args --sort=pid | cut -c1-160;"
            " grep -H Cpus_allowed_list /proc/[0-9]*/status",
            shell=True, capture_output=True, text=True,
        ).stdout  # fmt: skip
        process.send_signal(signal.SIGABRT)  # the fault handler prints every thread's stack
        process.wait(timeout=30)
        output = log.read_text(errors="replace")[-8000:]
        raise AssertionError(f"the trainer hung; its output:\n{output}\nprocesses:\n{processes}") from None


def _steps_done(folder: Path) -> int:
    loaded = checkpoint.load(folder)
    return 0 if loaded is None else loaded[0].step + sum(loaded[0].skipped_steps.values())


def test_trainer_killed_mid_run_resumes_without_training_twice_or_skipping(
    digits_model, digits_vllm, start_proxy, tmp_path
):
    proxy = start_proxy(digits_model, digits_vllm)
    stop_file = tmp_path / "stop"
    agents = _agents(proxy.url, stop_file)
    out = tmp_path / "train"
    try:
        first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
        first = _trainer(proxy.url, digits_model, out, steps=8, log=first_log)
        deadline = time.monotonic() + 600
        # Steps taken or skipped (a skipped step, e.g. a group of equal rewards, writes no
        # metrics line but is checkpointed).
        while _steps_done(out / "checkpoint") < 3:
            assert first.poll() is None and time.monotonic() < deadline, first_log.read_text()[-8000:]
            time.sleep(1.0)
        os.killpg(first.pid, signal.SIGKILL)  # mid-run: between or inside steps
        first.wait()
        # As after a crashed machine: nothing of the first run (Ray head, workers) is left.
        deadline = time.monotonic() + 60
        while _session_alive(first.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        second = _trainer(proxy.url, digits_model, out, steps=8, log=second_log)
        try:
            assert _wait_or_dump(second, second_log, timeout_s=420) == 0, second_log.read_text()[-8000:]
        finally:
            if second.poll() is None:
                os.killpg(second.pid, signal.SIGKILL)
    finally:
        stop_file.touch()
        agents.wait(timeout=120)
    state, _ = checkpoint.load(out / "checkpoint")
    assert state.step + sum(state.skipped_steps.values()) == 8  # taken or skipped
    trained = [seq for step in state.trained for seq in step]
    assert len(trained) == len(set(trained)), "a trajectory was trained on twice"
    taken = set(trained) | set(state.consumed) | {t.seq for t in state.pending}
    finalized = {t["seq"] for t in trajectories(proxy.url) if t["seq"] <= state.cursor}
    assert taken == finalized, "every trajectory up to the cursor is trained on, let go or still pending"
    # The restarted trainer pushed its resumed version back to vLLM before going on.
    assert httpx.get(f"{digits_vllm.url}/weight_info").json()["weight_version"] == str(state.version)
