"""`examples/learn_line_count.py` end to end: Claude Code runs the line-count task set through
`molt-proxy rollout` against the taught tiny model, the Ray trainer refreshes vLLM's weights
while the attempts run, and the held-out success rate rises (issue 28, item 5)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from devtools import claude_code

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not claude_code.installed(), reason="Claude Code's CLI is not installed")
def test_held_out_success_rises_from_at_most_0_3_to_at_least_0_8(tmp_path: Path) -> None:
    """The example with its defaults: held-out success at the taught weights (v0) at most 0.3,
    at the last evaluated version at least 0.8; every attempt ran without error, and each
    held-out task shows up in the per-task table."""
    out = tmp_path / "line-count"
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "learn_line_count.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    log = out / "molt-proxy.log"
    served = log.read_text()[-3000:] if log.exists() else ""
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + served
    found = re.search(r"held-out success: ([\d.]+) at v0 → ([\d.]+) at v(\d+)", done.stdout)
    assert found is not None, done.stdout[-3000:]
    first, last, version = float(found[1]), float(found[2]), int(found[3])
    # v0: the taught weights; the last evaluation's calls were all written by trained ones
    assert first <= 0.3 and last >= 0.8 and version >= 1, done.stdout[-3000:]
    assert re.search(r", 0 errors", done.stdout), done.stdout[-3000:]
    for task in range(1000, 1008):
        assert re.search(rf"^held-{task}\s", done.stdout, re.MULTILINE), done.stdout[-3000:]
