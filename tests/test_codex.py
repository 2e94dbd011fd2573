"""Codex CLI, the real one (`scripts/setup.sh` installs it under `.tools/`), through molt-proxy
to the shared vLLM on CPU, offline. The tiny Qwen3 model learned the episode from what this CLI
sends (`devtools/codex.py`): `exec_command` with `echo hi | tee hi.txt` (Codex really runs it,
in its sandbox: the file appears and its output goes back to the model), then an answer. Codex
talks to a recording pass-through in front of the proxy, so the test re-renders exactly what
it sent and compares that with the recorded ids."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest

from devtools.codex import ANSWER, COMMAND, installed, recording_server
from molt_proxy.tokenizer import Tokenizer
from molt_proxy.wire.responses import conversation, decode_responses_request
from tests.helpers import assert_exact, trajectories

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from codex import solve  # noqa: E402  (the example, as it is)

pytestmark = pytest.mark.skipif(
    not installed(), reason="Codex's CLI is not installed (scripts/setup.sh installs it under .tools/)"
)


def test_the_example_runs_its_command_in_one_exact_segment_named_by_codex(
    qwen3_model, qwen3_vllm, start_proxy, tmp_path
):
    """`examples/codex.py`'s episode, its base URL naming no session: the session is the one
    Codex names in `client_metadata`. Both turns in one segment whose ids are, up to each
    reply, the proxy's tokenizer on the request re-rendered; logprobs the model's own."""
    proxy = start_proxy(qwen3_model, qwen3_vllm, "--tool-call-parser", "hermes")
    with recording_server(proxy.url) as (url, bodies):
        assert solve(url, tmp_path) == 1.0
    first, second = bodies
    call, output = second["input"][-2:]
    assert (call["type"], call["name"], call["arguments"]) == (
        "function_call",
        "exec_command",
        json.dumps({"cmd": COMMAND}),
    )
    # What the command printed, as Codex sent it back (after its chunk id and wall time).
    assert output["output"].endswith("\nProcess exited with code 0\nOriginal token count: 1\nOutput:\nhi\n")
    assert [t["name"] for t in first["tools"]] == ["exec_command", "write_stdin"]
    assert (first["stream"], first["store"]) == (True, False)
    session = first["client_metadata"]["session_id"]
    httpx.post(f"{proxy.url}/v1/rewards", json={"session_id": session, "reward": 1.0}).raise_for_status()
    [record] = [t for t in trajectories(proxy.url) if t["session_id"] == session]  # one segment
    assert record["num_segments"] == 1 and len(record["turns"]) == 2
    tokenizer = Tokenizer.load(str(qwen3_model))
    for body, turn in zip(bodies, record["turns"], strict=True):
        turned = conversation(decode_responses_request(json.dumps(body).encode()), [])
        rendered = tokenizer.render(turned.messages, turned.tools, turned.template_kwargs)
        assert record["token_ids"][: turn["completion_start"]] == tokenizer.encode(rendered)
    last = record["turns"][-1]
    answer = tokenizer.ids_bytes(record["token_ids"][last["completion_start"] : last["completion_end"]])
    # The taught answer, sampled (Codex sends no temperature: T = 1) after a chunk id and wall
    # time the model never saw: teaching showed it 36 others (`devtools.variants`).
    assert answer == f"{ANSWER}<|im_end|>".encode()
    assert_exact(record, qwen3_model)
