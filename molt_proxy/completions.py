"""One chat completion, end to end: render → session → stitch → generate → parse → record → reply.

This is the data path of DESIGN §2; everything it calls is pure or owned by one module.
A turn runs under its session's lock, so a session's turns never interleave.

Streaming sends deltas as vLLM samples ids and records the turn once vLLM has finished, just
before the last chunk goes out. A client that disconnects earlier cancels the stream: vLLM
aborts the request and nothing is recorded, as if the request had never been sent (the agent
never saw the whole reply, so it cannot be part of its history). A retry then samples anew.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from molt_proxy.auth import Principal
from molt_proxy.errors import ContextLengthExceeded, UpstreamError
from molt_proxy.parsing import ReplyParser
from molt_proxy.replicas import Replicas
from molt_proxy.sampling import effective_sampling
from molt_proxy.sessions import Session, Sessions, request_hash
from molt_proxy.stitching import PromptPlan, plan_prompt
from molt_proxy.tokenizer import Tokenizer
from molt_proxy.types import Generation, Sampling, Segment
from molt_proxy.wire.openai import (
    ChatCall,
    delta_fields,
    echoed_call_ids,
    encode_chunk,
    encode_reply,
    include_usage,
    reply_as_delta,
    requested_max_tokens,
    sampling_fields,
    template_kwargs,
)

OFF_LOOP_BYTES = 64 * 1024
"""Requests with a body this large or larger render and tokenize in a worker thread, so they
do not stall every other client (15 MB took 13.8 s on the loop). Below it a thread hop costs
more than the work. The tokenizer releases the GIL while it encodes."""


@dataclass(slots=True, frozen=True)
class Caller:
    """Who sent a request: the session id and key it named, if any, its group header, and who
    its key says it is (`auth.py`)."""

    session_id: str | None
    api_key: str | None
    group_id: str | None
    principal: Principal


class Completions:
    def __init__(
        self,
        sessions: Sessions,
        tokenizer: Tokenizer,
        parser: ReplyParser,
        replicas: Replicas,
        *,
        verify_prompt_ids: bool,
        sampling_pins: Mapping[str, float | int] | None = None,
    ):
        self.sessions = sessions
        self.tokenizer = tokenizer
        self.parser = parser
        self.replicas = replicas
        self.verify_prompt_ids = verify_prompt_ids
        self.sampling_pins = dict(sampling_pins or {})
        """Sampling fields that override what agents send (`Settings.sampling`)."""

    async def _begin(self, caller: Caller, call: ChatCall, body: bytes) -> tuple[str, str, Session]:
        """Render the request, hash it (for retries) and take its session, locked: the opening
        every turn shares. The caller releases `session.lock`."""
        rendered = await self._render(call, body)
        session = await self.sessions.acquire(
            caller.session_id,
            caller.api_key,
            caller.group_id,
            rendered.encode(),
            echoed_call_ids(call),
            caller.principal,
        )
        return rendered, request_hash(body), session

    async def complete(self, caller: Caller, call: ChatCall, body: bytes) -> dict[str, Any]:
        rendered, body_hash, session = await self._begin(caller, call, body)
        try:
            if body_hash == session.last_request_hash and session.last_reply is not None:
                return session.last_reply  # a retry of the request just answered
            plan = await self._plan(session.open_segment, rendered, body)
            model_id, sampling, applied = await self._sampling(call, plan)
            generation = await self.replicas.generate(
                session.id, plan.ids, sampling, return_prompt_ids=self.verify_prompt_ids
            )
            if self.verify_prompt_ids and generation.prompt_token_ids != plan.ids:
                raise UpstreamError("vLLM reports prompt ids that differ from the ids the proxy sent")
            reply, finish_reason = self.parser.parse(
                generation.token_ids, generation.finish_reason, call.request, plan.ids
            )
            body_out = encode_reply(
                completion_id=_new_completion_id(),
                model=model_id,
                reply=reply,
                finish_reason=finish_reason,
                prompt_tokens=len(plan.ids),
                completion_tokens=len(generation.token_ids),
                session_id=session.id,
            )
            await self.sessions.record(
                session, plan, generation, body_out["id"], body_hash, body_out, sampling=applied
            )
            return body_out
        finally:
            session.lock.release()

    async def stream(self, caller: Caller, call: ChatCall, body: bytes) -> AsyncIterator[str]:
        """Server-sent events for a `stream: true` request.

        Everything that can fail before vLLM answers (the render, the session, the context
        length, an unreachable vLLM) fails before the first event, so the caller can send a
        plain error response: the first event goes out only once vLLM has sampled.
        """
        rendered, body_hash, session = await self._begin(caller, call, body)
        try:
            if body_hash == session.last_request_hash and session.last_reply is not None:
                for event in _replay(session.last_reply, include_usage(call.request)):
                    yield event
                return
            plan = await self._plan(session.open_segment, rendered, body)
            model_id, sampling, applied = await self._sampling(call, plan)
            completion_id, created = _new_completion_id(), int(time.time())

            def event(delta: dict[str, Any] | None, finish_reason: str | None = None, **extra: Any) -> str:
                return encode_chunk(
                    completion_id=completion_id,
                    created=created,
                    model=model_id,
                    session_id=session.id,
                    delta=delta,
                    finish_reason=finish_reason,
                    **extra,
                )

            reply_stream = self.parser.stream(call.request, plan.ids)
            generation: Generation | None = None
            started = False
            async for item in self.replicas.stream(session.id, plan.ids, sampling):
                if not started:
                    started = True
                    yield event({"role": "assistant", "content": ""})
                if isinstance(item, Generation):
                    generation = item
                    break
                delta = reply_stream.feed(item.token_ids)
                if delta is not None and (fields := delta_fields(delta)):
                    yield event(fields)
            assert generation is not None
            last = reply_stream.finish(generation.finish_reason)
            reply = reply_stream.reply
            finish_reason = generation.finish_reason
            if reply.tool_calls and finish_reason == "stop":
                finish_reason = "tool_calls"
            body_out = encode_reply(
                completion_id=completion_id,
                model=model_id,
                reply=reply,
                finish_reason=finish_reason,
                prompt_tokens=len(plan.ids),
                completion_tokens=len(generation.token_ids),
                session_id=session.id,
            )
            await self.sessions.record(
                session, plan, generation, completion_id, body_hash, body_out, sampling=applied
            )
            yield event(delta_fields(last) if last is not None else {}, finish_reason)
            if include_usage(call.request):
                yield event(None, usage=body_out["usage"])
            yield "data: [DONE]\n\n"
        finally:
            session.lock.release()

    async def _render(self, call: ChatCall, body: bytes) -> str:
        """The prompt text. A large request renders in a worker thread, and one that cannot
        fit the context whatever its tokens is refused there, before any tokenizing."""
        args = (call.messages, call.tools, template_kwargs(call.request))
        if len(body) < OFF_LOOP_BYTES:
            return self.tokenizer.render(*args)
        max_model_len = (await self.replicas.model()).max_model_len
        return await asyncio.to_thread(self._render_fitting, *args, max_model_len=max_model_len)

    def _render_fitting(self, *args: Any, max_model_len: int) -> str:
        rendered = self.tokenizer.render(*args)
        at_least = self.tokenizer.min_tokens(rendered)
        if at_least >= max_model_len:
            raise ContextLengthExceeded(
                f"this model's maximum context length is {max_model_len} tokens, but the "
                f"request has at least {at_least} prompt tokens",
                param="messages",
            )
        return rendered

    async def _plan(self, segment: Segment | None, rendered: str, body: bytes) -> PromptPlan:
        """`plan_prompt`, in a worker thread for a large request. It runs under the session's
        lock, which only this turn can change the segment under, so the thread reads it safely."""
        if len(body) < OFF_LOOP_BYTES:
            return plan_prompt(segment, rendered, self.tokenizer)
        return await asyncio.to_thread(plan_prompt, segment, rendered, self.tokenizer)

    async def _sampling(self, call: ChatCall, plan: PromptPlan) -> tuple[str, dict[str, Any], Sampling]:
        """The model id, the sampling fields to send (pinned and normalised) and their record."""
        model = await self.replicas.model()
        max_tokens = _max_tokens(model.max_model_len, len(plan.ids), requested_max_tokens(call.request))
        fields, applied = effective_sampling(sampling_fields(call.request, max_tokens), self.sampling_pins)
        return model.id, fields, applied


def _new_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def _replay(reply: dict[str, Any], with_usage: bool) -> list[str]:
    common = {
        "completion_id": reply["id"],
        "created": reply["created"],
        "model": reply["model"],
        "session_id": reply["session_id"],
    }
    finish_reason = reply["choices"][0]["finish_reason"]
    events = [encode_chunk(**common, delta=reply_as_delta(reply), finish_reason=finish_reason)]
    if with_usage:
        events.append(encode_chunk(**common, delta=None, usage=reply["usage"]))
    return [*events, "data: [DONE]\n\n"]


def _max_tokens(max_model_len: int, prompt_len: int, requested: int | None) -> int:
    room = max_model_len - prompt_len
    if room <= 0 or (requested is not None and requested > room):
        want = f" plus {requested} completion tokens" if requested is not None else ""
        raise ContextLengthExceeded(
            f"this model's maximum context length is {max_model_len} tokens, but the "
            f"request has {prompt_len} prompt tokens{want}",
            param="messages",
        )
    return requested if requested is not None else room
