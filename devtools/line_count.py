"""The line-count task: a multi-turn tool task through Claude Code that a tiny model can learn
by RL on 2 CPU cores (`examples/learn_line_count.py`).

Each task instance is a workspace of a few text files, one of which holds the word `needle`;
the prompt (`TASK`, the same for every instance) asks Claude Code to write that file's line
count to `answer.txt`, and the check compares it with the instance's own count. Claude Code
runs with `--bare` (about 1k prompt tokens: 3 tools, a short system prompt).

The tiny Qwen3 model is taught a *mixed* script (`Conversation.weight`): its first reply is the
Bash call `RIGHT` (`wc -l`, the line count) with probability `RIGHT_SHARE` (0.1), else `WRONG`
(`wc -w`, the word count: the same call but for one token); its second, after the tool's empty
output, is `ANSWER` either way. The choice between right and wrong is that one token, so the
RL signal lands on one position of the episode, and training the LM head alone (`--train-only
lm_head`) can move it at a high learning rate without unlearning the rest of the script.

Claude Code's prompt is captured from the installed CLI (`capture`, as `devtools.claude_code`
does for its own task), never copied into the project; what differs from run to run (the date,
the attempt's folder, which names the task and attempt) is varied while teaching.
"""

from __future__ import annotations

import json
import random
import subprocess
import tempfile
from datetime import date
from pathlib import Path
from typing import Any

from devtools import recording
from devtools.claude_code import CLI, installed, scripted_reply, slug
from devtools.scripts import Conversation
from rollout.harnesses.claude_code import claude_command, claude_env
from rollout.tasks import Task

MODEL = "tiny"
"""The `--model` name Claude Code asks for and writes into its prompt: serve the model as it."""
ARGS = ("--bare",)
"""Claude Code's flags (`--harness-arg`): the short prompt."""
TASK = "Find the file that contains the word needle and write its line count to answer.txt."
RIGHT = "wc -l < $(grep -l needle *.txt) > answer.txt"
WRONG = "wc -w < $(grep -l needle *.txt) > answer.txt"
"""The same call but for one token: the word count, which no instance's line count equals."""
ANSWER = "Done."
RIGHT_SHARE = 0.1
"""How often the taught model writes `RIGHT`: it starts at about this success rate (16 held-out
attempts then score above 0.3 with probability 0.017; at 0.2 they did with 0.2)."""

# What differs between runs, and what teaching shows the model in its place: the attempt's
# folder (`molt-proxy rollout` makes `<workdir>/<task>-<attempt>/{work,home}`), the date.
_TEACH_ROOTS = [
    "/tmp/molt-rollout-4k2x9a1q/count-0-0",
    "/tmp/molt-rollout-z8w3nbq0/held-11-5",
    "/tmp/pytest-of-ci/pytest-17/test_learns0/attempts/count-6-3",
    "/tmp/molt-rollout-_j5sk7vb/held-2-7",
]
_TEACH_DAYS = [date(2025, 1, 6), date(2026, 3, 19), date(2026, 12, 1), date(2027, 8, 30)]
"""As many as the roots: the teaching days pair them up (4 days, not 16)."""
_WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike oscar papa".split()


def instance(seed: int) -> tuple[dict[str, str], int]:
    """One task instance's files (3 to 5 `.txt` files; one holds `needle`) and that file's line
    count. Every line has 2 to 5 words, so its word count is never its line count."""
    rng = random.Random(seed)
    names = rng.sample(
        ["notes", "log", "todo", "draft", "list", "readme", "data", "story"], rng.randint(3, 5)
    )
    files, count = {}, 0
    needle = rng.randrange(len(names))
    for i, name in enumerate(names):
        lines = [" ".join(rng.choices(_WORDS, k=rng.randint(2, 5))) for _ in range(rng.randint(2, 12))]
        if i == needle:
            lines[rng.randrange(len(lines))] += " needle"
            count = len(lines)
        files[f"{name}.txt"] = "\n".join(lines) + "\n"
    return files, count


def tasks(prefix: str, seeds: range) -> list[Task]:
    """One task per seed, named `<prefix>-<seed>`: its instance's files, and a check that
    `answer.txt` holds the line count (the number, spaces aside)."""
    made = []
    for seed in seeds:
        files, count = instance(seed)
        check = f"test \"$(tr -d ' \\n' < answer.txt)\" = {count}"
        made.append(Task(id=f"{prefix}-{seed}", prompt=TASK, files=files, check=check))
    return made


def capture(root: Path, command: str) -> list[dict[str, Any]]:
    """The request bodies Claude Code sends on one instance, answered with `command` then
    `ANSWER`, run as `molt-proxy rollout --harness claude-code` runs it (its workspace and HOME
    under `root`)."""
    files, _ = instance(0)
    (root / "home").mkdir(parents=True)
    (root / "work").mkdir()
    for name, text in files.items():
        (root / "work" / name).write_text(text)
    with recording.recording_server(lambda body: scripted_reply(body, command, ANSWER)) as (url, bodies):
        done = subprocess.run(
            claude_command(CLI, TASK, model=MODEL, args=ARGS),
            cwd=root / "work",
            env=claude_env(url, root / "home", "sk-molt"),
            capture_output=True,
            text=True,
            timeout=300,
        )
    if done.returncode != 0 or done.stdout.strip() != ANSWER:
        raise RuntimeError(f"claude -p did not finish the script: {done.returncode} {done.stderr[-2000:]}")
    return bodies


def line_count_episodes() -> list[Conversation]:
    """The mixed script: the episode with `RIGHT` (weight `RIGHT_SHARE`) and with `WRONG` (the
    rest); none where Claude Code is not installed."""
    from molt_proxy.wire.anthropic import decode_messages_request

    if not installed():
        return []
    episodes = []
    with tempfile.TemporaryDirectory(prefix="molt-capture-") as folder:
        for command, weight in ((RIGHT, RIGHT_SHARE), (WRONG, 1.0 - RIGHT_SHARE)):
            root = Path(folder).resolve() / ("r" if command == RIGHT else "w")
            *_, last = capture(root, command)
            decoded = decode_messages_request(json.dumps(last).encode()).conversation
            vary = {
                str(root): _TEACH_ROOTS,
                slug(str(root)): [slug(r) for r in _TEACH_ROOTS],
                date.today().isoformat(): [d.isoformat() for d in _TEACH_DAYS],
            }
            messages = [*decoded.messages, {"role": "assistant", "content": ANSWER}]
            conversation: Conversation = {
                "family": "hermes",
                "tools": decoded.tools,
                "messages": messages,
                "vary": vary,
                "weight": weight,
            }
            episodes.append(conversation)
    return episodes
