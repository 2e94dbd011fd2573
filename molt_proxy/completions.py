"""One chat completion, end to end: render → stitch → generate → parse → record → reply.

This is the data path of DESIGN §2; everything it calls is pure or owned by one module.
It runs under the session's lock, so a session's turns never interleave.
"""

from __future__ import annotations

import uuid
from typing import Any

from molt_proxy.errors import Conflict, ContextLengthExceeded, UpstreamError
from molt_proxy.parsing import ReplyParser
from molt_proxy.sessions import Session, Sessions, request_hash
from molt_proxy.stitching import plan_prompt
from molt_proxy.tokenizer import Tokenizer
from molt_proxy.upstream import Upstream
from molt_proxy.wire.openai import (
    ChatCall,
    encode_reply,
    requested_max_tokens,
    sampling_fields,
    template_kwargs,
)


class Completions:
    def __init__(
        self,
        sessions: Sessions,
        tokenizer: Tokenizer,
        parser: ReplyParser,
        upstream: Upstream,
        *,
        verify_prompt_ids: bool,
    ):
        self.sessions = sessions
        self.tokenizer = tokenizer
        self.parser = parser
        self.upstream = upstream
        self.verify_prompt_ids = verify_prompt_ids

    async def complete(self, session: Session, call: ChatCall, body: bytes) -> dict[str, Any]:
        body_hash = request_hash(body)
        async with session.lock:
            if session.closed:
                raise Conflict(f"session {session.id!r} is closed", param="session_id")
            if body_hash == session.last_request_hash and session.last_reply is not None:
                return session.last_reply  # a retry of the request just answered
            rendered = self.tokenizer.render(call.messages, call.tools, template_kwargs(call.request))
            plan = plan_prompt(session.open_segment, rendered, self.tokenizer)
            model = await self.upstream.model()
            max_tokens = _max_tokens(model.max_model_len, len(plan.ids), requested_max_tokens(call.request))
            generation = await self.upstream.generate(
                session.id,
                plan.ids,
                sampling_fields(call.request, max_tokens),
                return_prompt_ids=self.verify_prompt_ids,
            )
            if self.verify_prompt_ids and generation.prompt_token_ids != plan.ids:
                raise UpstreamError("vLLM reports prompt ids that differ from the ids the proxy sent")
            reply, finish_reason = self.parser.parse(
                generation.token_ids, generation.finish_reason, call.request, plan.ids
            )
            completion_id = f"chatcmpl-{uuid.uuid4().hex}"
            body_out = encode_reply(
                completion_id=completion_id,
                model=model.id,
                reply=reply,
                finish_reason=finish_reason,
                prompt_tokens=len(plan.ids),
                completion_tokens=len(generation.token_ids),
                session_id=session.id,
            )
            await self.sessions.record(session, plan, generation, completion_id, body_hash, body_out)
            return body_out


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
