"""Side requests on every API format (`molt_proxy/side.py`, issue 28 item 4): a request without
tools whose system prompt matches a `--side-request` rule is served in a session of its own,
closed with status `side` and left out of the trainer's stream, whatever session it names, on
chat completions, Responses and Anthropic Messages, whole or streamed. Real SDKs, a real proxy
over the shared vLLM; the side request names the episode's session by its base URL and key, as
a harness given a session does."""

from __future__ import annotations

import json
import re
from typing import Any

import anthropic
import httpx
import pytest

from integrations.session import MoltSession, create_session
from molt_proxy.config import DEFAULT_SIDE_REQUESTS
from tests.helpers import trajectories

TITLE = "Generate a concise, sentence-case title (3-7 words) for this conversation."
EPISODE = "You are a helpful assistant."


def ask(session: MoltSession, api: str, system: str, stream: bool) -> str:
    """One request without tools in `session`, through `api`'s SDK, read to its end; the session
    the reply names."""
    user, limit = "Say hi", 16
    if api == "chat":
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        reply: Any = session.client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=limit, stream=stream
        )
        return list(reply)[0].session_id if stream else reply.session_id
    if api == "responses":
        reply = session.client.responses.create(
            model="tiny", instructions=system, input=user, max_output_tokens=limit, stream=stream
        )
        return list(reply)[0].response.session_id if stream else reply.session_id
    sdk = anthropic.Anthropic(base_url=session.base_url.removesuffix("/v1"), api_key=session.api_key)
    messages = [{"role": "user", "content": user}]
    reply = sdk.messages.create(
        model="tiny", max_tokens=limit, system=system, messages=messages, stream=stream
    )
    return list(reply)[0].message.session_id if stream else reply.session_id


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_a_side_request_leaves_the_episode_it_names_and_the_trainers_stream(
    api, stream, qwen3_model, qwen3_vllm, start_proxy
):
    proxy = start_proxy(qwen3_model, qwen3_vllm)
    session = create_session(proxy.url, group_id="episode")
    assert ask(session, api, EPISODE, stream) == session.session_id
    side = ask(session, api, TITLE, stream)
    assert side.startswith("side-")
    session.reward(1.0)
    listed = [
        (t["session_id"], t["status"], t["reward"], t["info"], len(t["turns"]))
        for t in trajectories(proxy.url)
    ]
    assert listed == [
        (side, "side", None, {"rule": DEFAULT_SIDE_REQUESTS[0]}, 1),
        (session.session_id, "rewarded", 1.0, {}, 1),  # the episode's one turn: untouched
    ]
    headers = {"accept": "text/event-stream"}
    with httpx.stream("GET", f"{proxy.url}/v1/trajectories", headers=headers, timeout=60) as feed:
        first = next(line for line in feed.iter_lines() if line.startswith("data: "))
    assert (
        json.loads(first.removeprefix("data: "))["session_id"] == session.session_id
    )  # the side one skipped


def test_the_default_rules_name_the_title_requests_of_claude_code_and_opencode():
    """Their system texts as the pinned CLIs send them (OpenCode's read from its binary); an
    agent's own system prompt that talks of titles is not one."""

    def rule(system: str) -> str | None:
        return next((r for r in DEFAULT_SIDE_REQUESTS if re.search(r, system)), None)

    claude = "Generate a concise, sentence-case title (3-7 words) for this conversation. Reply in JSON."
    opencode = "You are a title generator. You output ONLY a thread title. Nothing else."
    assert [rule(claude), rule(opencode)] == list(DEFAULT_SIDE_REQUESTS)
    assert rule("You are a coding agent. When you are a title generator's user, be brief.") is None
