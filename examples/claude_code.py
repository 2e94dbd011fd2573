"""Claude Code, the real CLI, solving a small task through molt-proxy, rewarded by a check of
its result: the RL episode of a coding harness that speaks only Anthropic Messages.

    bash scripts/setup.sh                    # installs the pinned CLI under .tools/
    python examples/claude_code.py           # writes everything under runs/claude_code/

It builds the tiny Qwen3 model (which learned this episode from what the installed CLI sends,
`devtools/claude_code.py`), starts molt-proxy with vLLM on CPU (a 32k context: Claude Code's
prompt alone is about 19k tokens), and runs `claude -p "Write hi to hi.txt"` in a temporary
project folder with `ANTHROPIC_BASE_URL` naming a session (`/s/<session>`). The model calls
Bash (`echo hi | tee hi.txt`), Claude Code runs it and sends the output back, the model
answers; the reward is whether `hi.txt` holds `hi`, and the episode's exact token trajectory is
stored. A real run swaps the tiny model for a policy and the task for a repository with tests.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import httpx
from molt_stack import print_record, running_proxy, tiny_model

from devtools.claude_code import TASK, installed, run_claude

RUN = Path("runs/claude_code")


def solve(base_url: str, root: Path) -> float:
    """One episode: Claude Code on `TASK` in `root/work` (its `HOME` in `root/home`) against
    the Anthropic API at `base_url`; the reward is 1.0 if it wrote `hi.txt` as asked."""
    done = run_claude(base_url, root, bare=False)
    print(f"claude -p {TASK!r} exited {done.returncode}: {done.stdout.strip()!r}")
    written = root / "work" / "hi.txt"
    return 1.0 if written.exists() and written.read_text().strip() == "hi" else 0.0


def main() -> None:
    if not installed():
        sys.exit("Claude Code's CLI is not installed: bash scripts/setup.sh installs it under .tools/")
    RUN.mkdir(parents=True, exist_ok=True)
    model = tiny_model(RUN / "tiny-qwen3", harness="claude_code")
    with running_proxy(model, RUN, max_model_len=32768) as url:
        session = httpx.post(f"{url}/v1/sessions", json={"group_id": "hi-file"}).json()["session_id"]
        with tempfile.TemporaryDirectory(prefix="claude-code-") as folder:
            reward = solve(f"{url}/s/{session}", Path(folder))
        posted = httpx.post(f"{url}/v1/rewards", json={"session_id": session, "reward": reward})
        posted.raise_for_status()
        print(f"\nreward {reward} for session {session}")
        print_record(posted.json(), httpx.get(f"{url}/v1/trajectories").json()["data"])


if __name__ == "__main__":
    main()
