"""Claude Code, the real CLI (`scripts/setup.sh` installs it under `.tools/`), through molt-proxy
to the shared vLLM on CPU, offline. The tiny Qwen3 model learned the episode from what this CLI
sends (`devtools/claude_code.py`): Bash `echo hi | tee hi.txt` (the tool really runs: the file
appears and its output goes back to the model), then an answer. Claude Code talks to a recording
pass-through in front of the proxy, so each test re-renders exactly what it sent and compares
that with the recorded ids."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from devtools.claude_code import ANSWER, COMMAND, installed, recording_server, run_claude
from molt_proxy.config import DEFAULT_SIDE_REQUESTS
from molt_proxy.tokenizer import Tokenizer
from molt_proxy.wire.anthropic import decode_messages_request
from tests.helpers import assert_exact, trajectories

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from claude_code import solve  # noqa: E402  (the example, as it is)

pytestmark = pytest.mark.skipif(
    not installed(), reason="Claude Code's CLI is not installed (scripts/setup.sh installs it under .tools/)"
)


def _assert_exact_episode(proxy: Any, model: Path, bodies: list[dict[str, Any]], session: str) -> None:
    """Both turns in one segment whose ids are, up to each reply, the proxy's tokenizer on the
    request re-rendered; the Bash output in the second request; logprobs the model's own."""
    first, second = [b for b in bodies if b.get("tools")]
    assert second["messages"][-1]["content"][0]["content"] == "hi"  # the tool's output, sent back
    assert second["messages"][-2]["content"][0]["input"] == {"command": COMMAND}
    httpx.post(f"{proxy.url}/v1/rewards", json={"session_id": session, "reward": 1.0}).raise_for_status()
    [record] = [t for t in trajectories(proxy.url) if t["session_id"] == session]  # one segment
    assert record["num_segments"] == 1 and len(record["turns"]) == 2
    tokenizer = Tokenizer.load(str(model))
    for body, turn in zip((first, second), record["turns"], strict=True):
        conversation = decode_messages_request(json.dumps(body).encode()).conversation
        rendered = tokenizer.render(conversation.messages, conversation.tools, conversation.template_kwargs)
        assert record["token_ids"][: turn["completion_start"]] == tokenizer.encode(rendered)
    assert_exact(record, model)


def test_bare_episode_is_one_exact_segment_and_its_title_request_stays_out_of_training(
    qwen3_model, qwen3_vllm, start_proxy, tmp_path
):
    """`--bare`, with Claude Code's title side request; no session in the base URL: the session
    is the one Claude Code names in `metadata.user_id`."""
    proxy = start_proxy(qwen3_model, qwen3_vllm, "--tool-call-parser", "hermes")
    with recording_server(proxy.url) as (url, bodies):
        done = run_claude(url, tmp_path, bare=True, side_requests=True)
    assert (done.returncode, done.stdout.strip()) == (0, ANSWER), done.stderr[-3000:]
    assert (tmp_path / "work" / "hi.txt").read_text() == "hi\n"
    [title] = [b for b in bodies if not b.get("tools")]
    assert title["messages"][0]["content"][0]["text"].startswith("<session>\nWrite hi to hi.txt")
    session = json.loads(title["metadata"]["user_id"])["session_id"]
    _assert_exact_episode(proxy, qwen3_model, bodies, session)
    listed = trajectories(proxy.url)
    [side] = [t for t in listed if t["session_id"] != session]
    assert side["session_id"].startswith("side-")
    assert (side["status"], side["reward"], side["info"]) == (
        "side",
        None,
        {"rule": DEFAULT_SIDE_REQUESTS[0]},
    )
    headers = {"accept": "text/event-stream"}
    params = {"after": side["seq"] - 1}
    with httpx.stream("GET", f"{proxy.url}/v1/trajectories", params=params, headers=headers) as feed:
        first = next(line for line in feed.iter_lines() if line.startswith("data: "))
    assert json.loads(first.removeprefix("data: "))["session_id"] == session  # the title is skipped


def test_the_example_solves_its_task_with_the_default_prompt_in_one_exact_segment(
    qwen3_model, qwen3_vllm, start_proxy, tmp_path
):
    """`examples/claude_code.py`'s episode (the default, 19k-token prompt), its session named by
    the base URL's path."""
    proxy = start_proxy(qwen3_model, qwen3_vllm, "--tool-call-parser", "hermes")
    with recording_server(f"{proxy.url}/s/cc-default") as (url, bodies):
        assert solve(url, tmp_path) == 1.0
    assert [len(b["tools"]) for b in bodies] == [24, 24]
    assert {b["max_tokens"] for b in bodies} == {32_000}  # over the context left: lowered to fit
    _assert_exact_episode(proxy, qwen3_model, bodies, "cc-default")
