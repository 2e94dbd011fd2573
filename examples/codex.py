"""Codex CLI, the real one, solving a small task in a git repository through molt-proxy,
rewarded by a check of its result: the RL episode of a coding harness that speaks only the
OpenAI Responses API.

    bash scripts/setup.sh                    # installs the pinned CLI under .tools/
    python examples/codex.py                 # writes everything under runs/codex/

It builds the tiny Qwen3 model (which learned this episode from what the installed CLI sends,
`devtools/codex.py`), starts molt-proxy with vLLM on CPU (an 8k context: Codex's prompt is
about 4.3k tokens with its optional parts off), and runs `codex exec "Write hi to hi.txt"`
in a fresh git repository, its provider's `base_url` naming a session (`/s/<session>/v1`). The
model calls `exec_command` (`echo hi | tee hi.txt`), Codex runs it in its sandbox and sends
the output back, the model answers; the reward is whether the repository's one change is
`hi.txt` holding `hi`, and the episode's exact token trajectory is stored. A real run swaps the
tiny model for a policy and the task for a repository with tests.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
from molt_stack import print_record, running_proxy, tiny_model

from devtools.codex import TASK, installed, run_codex

RUN = Path("runs/codex")


def solve(base_url: str, root: Path) -> float:
    """One episode: Codex on `TASK` in the git repository `root/work` (its home in
    `root/home`) against the Responses API at `base_url`; the reward is 1.0 if its one change
    to the repository is `hi.txt`, holding `hi`."""
    done = run_codex(base_url, root)
    print(f"codex exec {TASK!r} exited {done.returncode}: {done.stdout.strip()!r}")
    work = root / "work"
    status = subprocess.run(["git", "status", "--porcelain"], cwd=work, capture_output=True, text=True)
    written = work / "hi.txt"
    solved = status.stdout == "?? hi.txt\n" and written.read_text().strip() == "hi"
    return 1.0 if solved else 0.0


def main() -> None:
    if not installed():
        sys.exit("Codex's CLI is not installed: bash scripts/setup.sh installs it under .tools/")
    RUN.mkdir(parents=True, exist_ok=True)
    model = tiny_model(RUN / "tiny-qwen3", harness="codex")
    with running_proxy(model, RUN, max_model_len=8192) as url:
        session = httpx.post(f"{url}/v1/sessions", json={"group_id": "hi-file"}).json()["session_id"]
        with tempfile.TemporaryDirectory(prefix="codex-") as folder:
            reward = solve(f"{url}/s/{session}/v1", Path(folder))
        posted = httpx.post(f"{url}/v1/rewards", json={"session_id": session, "reward": reward})
        posted.raise_for_status()
        print(f"\nreward {reward} for session {session}")
        print_record(posted.json(), httpx.get(f"{url}/v1/trajectories").json()["data"])


if __name__ == "__main__":
    main()
