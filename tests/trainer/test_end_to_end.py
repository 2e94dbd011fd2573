"""The whole loop through real parts: agents → proxy → vLLM → Ray trainer → refreshed vLLM."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from trainer.metrics import read

ROOT = Path(__file__).resolve().parents[2]
STEPS = 30  # examples/learn_digits.py's default: the README's command as it is


def test_example_task_reward_climbs(tmp_path):
    """`examples/learn_digits.py` with its defaults (the README's main command): the mean reward
    climbs from at most 0.3 over the first quarter of training to at least 0.8 over the last
    (issue 17's bar), and the output points at the viewer before the first step."""
    out = tmp_path / "digits"
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "learn_digits.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    log = out / "molt-proxy.log"  # the proxy's and the trainer's own output
    served = log.read_text()[-3000:] if log.exists() else ""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:] + served
    assert "0 agent-visible errors" in result.stdout
    watch = re.search(r"watch the run: http://127\.0\.0\.1:\d+/ui \(trajectories, live\)", result.stdout)
    first_step = result.stdout.index(f"step    1/{STEPS}")
    assert watch is not None and watch.start() < first_step, result.stdout[:2000]
    records = read(out / "train" / "metrics.jsonl")
    # A step taken writes a line; a skipped one (every advantage 0, e.g. a solved batch) does not.
    assert [r["step"] for r in records] == list(range(1, len(records) + 1)) and len(records) >= 20
    quarter = len(records) // 4
    first = sum(r["reward_mean"] for r in records[:quarter]) / quarter
    last = sum(r["reward_mean"] for r in records[-quarter:]) / quarter
    assert first <= 0.3 and last >= 0.8, (first, last, [round(r["reward_mean"], 3) for r in records])
    assert (out / "train" / "reward_curve.png").stat().st_size > 0
    # The greedy evaluation episodes were logged by weight version, never trained on; those of
    # the final weights came after the last step, and the trainer waited for them.
    assert any("0" in r.get("eval_reward", {}) for r in records)
    if len(records) == STEPS:  # no step skipped: the evaluator saw the last step's record
        assert str(STEPS) in records[-1]["eval_reward"], records[-1]
    # Every step refreshed vLLM: the versions vLLM labelled tokens with reached the last steps.
    assert max(r["version"] for r in records) == len(records)
