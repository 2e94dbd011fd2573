"""The whole loop through real parts: agents → proxy → vLLM → Ray trainer → refreshed vLLM."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
    log = out / "molt-proxy.log"  # the proxy's and the trainer's own output
    served = log.read_text()[-3000:] if log.exists() else ""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:] + served
    assert "0 agent-visible errors" in result.stdout
    records = read(out / "train" / "metrics.jsonl")
    # A step taken writes a line; a skipped one (every advantage 0, e.g. a solved batch) does not.
    assert [r["step"] for r in records] == list(range(1, len(records) + 1)) and len(records) >= 12
    quarter = len(records) // 4
    first = sum(r["reward_mean"] for r in records[:quarter]) / quarter
    last = sum(r["reward_mean"] for r in records[-quarter:]) / quarter
    assert last > first + 0.2, (first, last)
    assert (out / "train" / "reward_curve.png").stat().st_size > 0
    # The greedy evaluation episodes were logged by weight version, never trained on.
    assert any(r.get("eval_reward") for r in records)
    # Every step refreshed vLLM: the versions vLLM labelled tokens with reached the last steps.
    assert max(r["version"] for r in records) == len(records)
