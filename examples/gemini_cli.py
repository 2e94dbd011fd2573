"""Gemini CLI, the real one, solving a small task through molt-proxy, rewarded by a check of its
result: the RL episode of a coding harness that speaks only Google's Gemini API.

    bash scripts/setup.sh                    # installs the pinned CLI under .tools/
    python examples/gemini_cli.py            # writes everything under runs/gemini_cli/

It builds the tiny Qwen3 model (which learned this episode from what the installed CLI sends,
`devtools/gemini_cli.py`), starts molt-proxy with vLLM on CPU (a 16k context: Gemini CLI's
prompt is about 10.5k tokens: a 30k-character system prompt and 15 tools), and runs
`gemini -p "Write hi to hi.txt"` in a temporary folder with `GOOGLE_GEMINI_BASE_URL` naming a
session (`/s/<session>`; its requests go to `/s/<session>/v1beta/models/tiny:streamGenerateContent`).
The model calls `run_shell_command` (`echo hi | tee hi.txt`), Gemini CLI runs it and sends the
output back, the model answers; the reward is whether `hi.txt` holds `hi`, and the episode's
exact token trajectory is stored. A real run swaps the tiny model for a policy and the task for
a repository with tests.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import httpx
from molt_stack import print_record, running_proxy

from devtools import build_tiny_model
from devtools.gemini_cli import TASK, installed, run_gemini
from rollout.harnesses.gemini_cli import response

RUN = Path("runs/gemini_cli")


def solve(base_url: str, root: Path) -> float:
    """One episode: Gemini CLI on `TASK` in `root/work` (its home in `root/home`) against the
    Gemini API at `base_url`; the reward is 1.0 if `hi.txt` holds `hi`."""
    print(f"gemini -p {TASK!r}: Gemini CLI asks the model, runs its command and asks again ...")
    done = run_gemini(base_url, root)
    print(f"gemini exited {done.returncode}: {response(done.stdout)!r}")
    written = root / "work" / "hi.txt"
    return 1.0 if written.exists() and written.read_text().strip() == "hi" else 0.0


def main() -> None:
    if not installed():
        sys.exit("Gemini CLI is not installed: bash scripts/setup.sh installs it under .tools/")
    RUN.mkdir(parents=True, exist_ok=True)
    model = RUN / "tiny-qwen3"
    if not (model / "model.safetensors").exists():
        # The tests' model, every script and every CLI's episode (minutes): Gemini CLI's episode
        # did not take in 300 steps taught alone (p(reply) 0.05 and 0.09 for its two replies), nor
        # beside the library scripts without the other CLIs' (0.07), though it does among them all.
        print("building the tests' tiny Qwen3 model, which knows Gemini CLI's episode (minutes) ...")
        build_tiny_model(model, "qwen3")
    with running_proxy(model, RUN, max_model_len=16384) as url:
        session = httpx.post(f"{url}/v1/sessions", json={"group_id": "hi-file"}).json()["session_id"]
        with tempfile.TemporaryDirectory(prefix="gemini-") as folder:
            reward = solve(f"{url}/s/{session}", Path(folder))
        posted = httpx.post(f"{url}/v1/rewards", json={"session_id": session, "reward": reward})
        posted.raise_for_status()
        print(f"\nreward {reward} for session {session}")
        print_record(posted.json(), httpx.get(f"{url}/v1/trajectories").json()["data"])


if __name__ == "__main__":
    main()
