"""Gemini CLI, the real one (`scripts/setup.sh` installs it under `.tools/`), through molt-proxy's
Gemini API to the shared vLLM on CPU, offline. The tiny Qwen3 model learned the episode from
what this CLI sends (`devtools/gemini_cli.py`): `run_shell_command` with `echo hi | tee hi.txt`
(Gemini CLI really runs it: the file appears and its output goes back to the model), then an
answer. Gemini CLI talks to a recording pass-through in front of the proxy, so the test
re-renders exactly what it sent and compares that with the recorded ids."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from devtools.gemini_cli import ANSWER, COMMAND, MODEL, TASK, installed, recording_server, tool_output
from molt_proxy.tokenizer import Tokenizer
from molt_proxy.wire.gemini import decode_generate_request
from tests.helpers import forward_logits, trajectories
from trainer.sampling import TokenSampling, processed_logprobs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gemini_cli import solve  # noqa: E402  (the example, as it is)

pytestmark = pytest.mark.skipif(
    not installed(), reason="Gemini CLI is not installed (scripts/setup.sh installs it under .tools/)"
)
TOOLS = (
    "update_topic list_directory read_file grep_search glob replace write_file web_fetch run_shell_command"
    " list_background_processes read_background_output google_web_search enter_plan_mode invoke_agent"
    " activate_skill"
).split()
"""What 0.61.0 declares, in its order (measured)."""


def test_the_example_runs_its_command_in_one_exact_segment_and_sends_nothing_else(
    qwen3_model, qwen3_vllm, start_proxy, tmp_path
):
    """`examples/gemini_cli.py`'s episode, its session named by the base URL's path: two
    streamed `generateContent` requests and no side request (the adapter's settings turn off
    the next-speaker check and the loop detection), both turns in one segment whose ids are,
    up to each reply, the proxy's tokenizer on the request re-rendered; logprobs the model's own."""
    proxy = start_proxy(qwen3_model, qwen3_vllm, "--tool-call-parser", "hermes", "--served-model-name", MODEL)
    session = httpx.post(f"{proxy.url}/v1/sessions", json={"group_id": "hi-file"}).json()["session_id"]
    paths: list[str] = []
    with recording_server(proxy.url, paths) as (url, bodies):
        assert solve(f"{url}/s/{session}", tmp_path) == 1.0
    assert paths == [f"/s/{session}/v1beta/models/{MODEL}:streamGenerateContent?alt=sse"] * 2
    first, second = bodies
    for body in bodies:
        assert [f["name"] for t in body["tools"] for f in t["functionDeclarations"]] == TOOLS
        assert body["generationConfig"] == {
            "temperature": 1,
            "topP": 0.95,
            "topK": 64,
            "thinkingConfig": {"includeThoughts": True},
        }
    assert first["contents"][-1]["parts"][-1] == {"text": TASK}
    call, output = (content["parts"] for content in second["contents"][-2:])
    assert call[0]["functionCall"]["name"] == "run_shell_command"
    assert call[0]["functionCall"]["args"] == {"command": COMMAND}
    assert tool_output(second).startswith("<untrusted_context>\nOutput: hi\nProcess Group PGID: ")
    httpx.post(f"{proxy.url}/v1/rewards", json={"session_id": session, "reward": 1.0}).raise_for_status()
    [record] = trajectories(proxy.url)  # one segment, and nothing else recorded
    assert (record["session_id"], record["num_segments"], len(record["turns"])) == (session, 1, 2)
    tokenizer = Tokenizer.load(str(qwen3_model))
    for body, turn in zip(bodies, record["turns"], strict=True):
        conversation = decode_generate_request(json.dumps(body).encode(), MODEL).conversation
        rendered = tokenizer.render(conversation.messages, conversation.tools, conversation.template_kwargs)
        assert record["token_ids"][: turn["completion_start"]] == tokenizer.encode(rendered)
    last = record["turns"][-1]
    answer = tokenizer.ids_bytes(record["token_ids"][last["completion_start"] : last["completion_end"]])
    # The taught answer, sampled at Gemini CLI's T = 1 after a folder and a process group id the
    # model never saw: teaching showed it 36 others (`devtools.variants`).
    assert answer == f"{ANSWER}<|im_end|>".encode()
    # Gemini CLI samples with top-p and top-k: vLLM records the logprobs of the truncated
    # distribution it drew from (`--logprobs-mode processed_logprobs`), which `assert_exact`'s
    # plain forward does not make (a token alone in the nucleus: 0.0 recorded, -1.2e-4 plain).
    assert [{k: turn["sampling"][k] for k in SAMPLED} for turn in record["turns"]] == [SAMPLED] * 2
    assert_exact_processed(record, qwen3_model)


SAMPLED = {"temperature": 1.0, "top_p": 0.95, "top_k": 64}
"""The sampling of Gemini CLI's `generationConfig`, as each turn records it (the rest default)."""


def assert_exact_processed(record: dict[str, Any], model: Path, tolerance: float = 1e-4) -> None:
    """`assert_exact`, each sampled token's logprob compared with the float32 forward's
    processed as vLLM processed it (temperature, top-k, top-p: `trainer.sampling`)."""
    sampled = [p for t in record["turns"] for p in range(t["completion_start"], t["completion_end"])]
    assert [i for i, m in enumerate(record["loss_mask"]) if m] == sampled
    logits = forward_logits(model, record["token_ids"], sampled)
    n = len(sampled)
    sampling = TokenSampling(
        temperature=torch.full((1, n), SAMPLED["temperature"]),
        top_k=torch.full((1, n), SAMPLED["top_k"]),
        top_p=torch.full((1, n), SAMPLED["top_p"]),
        min_p=torch.zeros(1, n),
        reproducible=torch.ones(1, n, dtype=torch.bool),
        constrained=torch.zeros(1, n, dtype=torch.bool),
    )
    targets = torch.tensor([[record["token_ids"][p] for p in sampled]])
    reference = processed_logprobs(logits[None], targets, sampling)[0].tolist()
    for p, expected in zip(sampled, reference, strict=True):
        assert abs(record["logprobs"][p] - expected) <= tolerance, (p, record["logprobs"][p], expected)
