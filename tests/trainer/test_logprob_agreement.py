"""The trainer sees what vLLM sampled from: trajectories recorded through the real proxy and a
real vLLM on CPU, recomputed by a fresh `Policy` in one right-padded batch, agree at every
sampled token to 1e-4. Without this, every importance ratio of the loss would be off from step 0.
"""

from __future__ import annotations

from typing import Any

import httpx
import torch
from openai import OpenAI

from devtools import Conversation, thinking_episode, weather_episode
from molt_proxy.types import Trajectory
from tests.helpers import forward_logprobs, reply_as_message, trajectories
from trainer.batch import collate
from trainer.policy import Policy, token_logprobs


def opening(conversation: Conversation) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages before a scripted episode's first reply, and its tools. The replies are
    whatever the model samples: agreement must hold for any tokens, not only the script's."""
    first_reply = next(i for i, m in enumerate(conversation["messages"]) if m["role"] == "assistant")
    return conversation["messages"][:first_reply], conversation["tools"]


def test_fresh_policy_logprobs_match_the_recorded_rollout_logprobs(qwen3_model, qwen3_vllm, start_proxy):
    proxy = start_proxy(
        qwen3_model, qwen3_vllm, "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"
    )
    openings = {
        "weather": opening(weather_episode("hermes")),
        "thinker": opening(thinking_episode()),
        # Off the script the taught model samples freely: unlikely tokens, the hard case.
        "free": ([{"role": "user", "content": "Tell me something about the sea."}], None),
    }
    for session, (messages, tools) in openings.items():
        client = OpenAI(base_url=proxy.base_url(session), api_key="unused")
        history = list(messages)
        for seed in (1, 2):  # two turns: the second continues the segment the first opened
            extra = {"tools": tools} if tools else {}
            reply = client.chat.completions.create(
                model="tiny", messages=history, temperature=1.0, max_tokens=32, seed=seed, **extra
            )
            history += [reply_as_message(reply.choices[0].message), {"role": "user", "content": "Go on."}]
        reward = {"session_id": session, "reward": 1.0}
        httpx.post(f"{proxy.url}/v1/rewards", json=reward).raise_for_status()

    records = [Trajectory.from_json(record) for record in trajectories(proxy.url)]
    assert len(records) >= 3
    batch = collate(records, [1.0] * len(records))
    with torch.no_grad():
        logprobs = token_logprobs(Policy(qwen3_model).model, batch.input_ids, batch.attention_mask)
    # Batching and right padding change nothing: each row is its own sequence's forward.
    for row, record in enumerate(records):
        alone = torch.tensor(forward_logprobs(qwen3_model, record.token_ids))
        torch.testing.assert_close(logprobs[row, : len(alone)], alone, rtol=0, atol=1e-5)
    # And that forward is vLLM's at every sampled token (measured: max 6e-6, mean 2e-7).
    sampled = batch.loss_mask.bool()
    assert int(sampled.sum()) > 50  # the taught replies and the free ones: enough to compare
    error = (logprobs - batch.rollout_logprobs).abs()[sampled]
    assert float(error.max()) <= 1e-4, f"max |policy - vLLM| = {float(error.max()):.2e}"
