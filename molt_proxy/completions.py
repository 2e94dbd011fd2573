"""One turn, end to end: a `Turn` owns it from admission to record (DESIGN §2, §3).

A route decodes a request into a `Conversation` (`wire/`), opens a `Turn` on it
(`Completions.turn`) and encodes what the turn answers, whole (`Answer`) or streamed
(`wire/events.py`): a new API format is a decoder and an encoder, nothing here. The turn, in
the order it runs:

1. open: who asks (`Caller`), which try this is (`Attempt`), whether it is a side request
   (`side.py`: then it runs in a session of its own), and where its heavy work runs (`Work`:
   a large body's in a worker thread, decided once from its size);
2. render: the messages, each echo restored to what the proxy returned (`echo.py`), through
   the chat template (`rendering.py`);
3. admit (`turns.py`): the session and chain it joins, the chains its render continues
   (matched once), and its claim on them until it ends; a retry of a request the session
   answered gets the recorded reply;
4. plan: the prompt ids continuing the furthest chain or opening one (`stitching.py`), the
   model, `max_tokens` and the sampling (`sampling.py`, `constraints.py`);
5. sample: vLLM generates (`replicas.py`), whole or streamed, and vLLM's parsers read the ids
   (`parsing.py`); with `--verify-prompt-ids` the prompt vLLM read is checked;
6. record: the reply in neutral form with its echo view (`echo.py`), stored and committed to
   its chain (`sessions.py`), and what the format keeps besides (`Keep`: the Responses API's
   stored response); the requested stop string that ended it, for formats that report one;
7. end: the claim released, a side request's session closed.

How many modules a turn crosses, and how often control switches between them, is measured by
`python -m devtools.doctools.trace_turn` (docs/architecture.md has the numbers).

Streaming sends deltas as vLLM samples ids and records the turn once vLLM has finished, just
before the last event goes out. A client that disconnects earlier cancels the stream: vLLM
aborts the request and nothing is recorded, as if the request had never been sent (the agent
never saw the whole reply, so it cannot be part of its history). A retry then samples anew.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any, ParamSpec, TypeVar

from vllm.entrypoints.generate.base.protocol import DeltaMessage

from molt_proxy.auth import Role
from molt_proxy.conversation import Conversation
from molt_proxy.echo import Find, Rendered, echo_view, restore
from molt_proxy.errors import ContextLengthExceeded, UpstreamError
from molt_proxy.parsing import ReplyParser
from molt_proxy.rendering import Renders
from molt_proxy.replicas import Replicas
from molt_proxy.sampling import effective_sampling
from molt_proxy.session import Attempt, Caller, Session
from molt_proxy.sessions import Sessions
from molt_proxy.side import side_info
from molt_proxy.stitching import PromptPlan, plan_match
from molt_proxy.tokenizer import Tokenizer
from molt_proxy.turns import Admitted, Turns
from molt_proxy.types import Generation, ParsedReply, RecordedReply, Sampling, SessionStatus, TokenLogprobs
from molt_proxy.upstream import TokenDelta
from molt_proxy.wire.events import Answer, Closed, Delta, Opened, Replayed, StreamEvent

P = ParamSpec("P")
R = TypeVar("R")

OFF_LOOP_BYTES = 64 * 1024
"""Requests with a body this large or larger decode, render and tokenize in a worker thread,
so they do not stall every other client (15 MB took 13.8 s on the loop). Below it a thread hop
costs more than the work. The tokenizer releases the GIL while it encodes."""

Keep = Callable[[RecordedReply, str], Awaitable[None]]
"""What a format keeps of a turn's reply besides its record, given the reply and its session's
id (the Responses API's stored response, for `previous_response_id`); kept before the turn's
answer goes out."""
Close = Callable[[str, float | None, dict[str, Any], SessionStatus], Awaitable[object]]
"""`Proxy.close_session(session_id, reward, info, status)`: how a side request's session ends."""


@dataclass(slots=True, frozen=True)
class Work:
    """Where a request's heavy work runs (decoding, rendering, tokenizing, the echo view): in a
    worker thread for a body of `OFF_LOOP_BYTES` or more, else on the event loop. Decided once
    per request, from its body's size, where it arrives (`routes.py`)."""

    off_loop: bool

    @classmethod
    def of(cls, body: bytes) -> Work:
        return cls(len(body) >= OFF_LOOP_BYTES)

    async def run(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        if self.off_loop:
            return await asyncio.to_thread(fn, *args, **kwargs)
        return fn(*args, **kwargs)


class Completions:
    """What every turn uses, built once at startup (`proxy.py`); `turn` opens one."""

    def __init__(
        self,
        sessions: Sessions,
        tokenizer: Tokenizer,
        parser: ReplyParser,
        replicas: Replicas,
        *,
        verify_prompt_ids: bool,
        sampling_pins: Mapping[str, float | int] | None = None,
        served_model_name: str | None = None,
        side_rules: Sequence[str],
        close: Close,
    ):
        self.sessions = sessions
        self.admission = Turns(sessions)
        self.tokenizer = tokenizer
        self.renders = Renders(tokenizer)
        """The chat template's renders, incremental where checked (`rendering.py`)."""
        self.parser = parser
        self.replicas = replicas
        self.verify_prompt_ids = verify_prompt_ids
        self.sampling_pins = dict(sampling_pins or {})
        """Sampling fields that override what agents send (`Settings.sampling`)."""
        self.served_model_name = served_model_name
        """The name replies carry (`Settings.served_model_name`); None: the name vLLM serves."""
        self.side_rules = list(side_rules)
        """`Settings.side_requests`: what makes a request a side request (`side.py`)."""
        self.close = close
        """How a side request's session ends (`Proxy.close_session`)."""

    def turn(
        self,
        caller: Caller,
        conversation: Conversation,
        attempt: Attempt,
        work: Work,
        keep: Keep | None = None,
    ) -> Turn:
        """A turn on `conversation` for `caller`. A side request (`side.py`) runs in a new
        session of its own, with no group (it groups by its prompt), whatever session it
        names; a session key's request cannot leave its session, so it is never one."""
        rule = None if caller.principal.role is Role.SESSION else self._side_rule(conversation)
        if rule is not None:
            caller = Caller(f"side-{uuid.uuid4().hex}", None, None, caller.principal)
        return Turn(self, caller, conversation, attempt, work, rule, keep)

    def _side_rule(self, conversation: Conversation) -> str | None:
        """The rule (`Settings.side_requests`) that makes a request a side request, if one
        does: it declares no tools and its system prompt, every `system` message's text and
        every `developer` message's (OpenAI's newer name for it), matches the rule."""
        if conversation.tools:
            return None
        system = "\n".join(
            m["content"]
            for m in conversation.messages
            if m["role"] in ("system", "developer") and isinstance(m["content"], str)
        )
        return next((rule for rule in self.side_rules if re.search(rule, system)), None)


@dataclass(slots=True, frozen=True)
class Prepared:
    """A turn ready to sample: the exact prompt ids, the served model and the sampling."""

    plan: PromptPlan
    model_id: str
    """The name replies carry as `model`."""
    fields: dict[str, Any]
    """The sampling fields sent to vLLM (pinned and normalised)."""
    applied: Sampling
    """Their record, kept on the turn for the trainer."""
    constrained: bool
    """vLLM samples under structured outputs (`constraints.py`): `fields` carry them."""


class Turn:
    """One turn from admission to record (see the module). A route asks it once: `whole`,
    `stream` or `count`."""

    def __init__(
        self,
        parts: Completions,
        caller: Caller,
        conversation: Conversation,
        attempt: Attempt,
        work: Work,
        side: str | None,
        keep: Keep | None,
    ):
        self.parts = parts
        self.caller = caller
        self.conversation = conversation
        self.attempt = attempt
        self.work = work
        self.side = side
        """The side-request rule the request matched (`side.py`); None: not a side request."""
        self.keep = keep
        stop = conversation.parser_request.stop
        self.stops = [stop] if isinstance(stop, str) else list(stop or [])
        """The stop strings the request asks for: the reply says which one ended it."""

    # -- asked whole, streamed or counted ------------------------------------------------

    async def whole(self) -> Answer:
        """The reply, sampled and recorded, or the recorded one for a retry."""
        async with self._admitted() as (rendered, admitted):
            session, reply = admitted.session, admitted.replay
            if reply is None:
                prepared = await self._prepare(rendered, admitted)
                ids, parts = prepared.plan.ids, self.parts
                generation = await parts.replicas.generate(
                    session.id, ids, prepared.fields, return_prompt_ids=parts.verify_prompt_ids
                )
                self._verify(ids, generation.prompt_token_ids)
                request = self.conversation.parser_request
                message = parts.parser.parse(generation.token_ids, generation.finish_reason, request, ids)
                shown = shown_logprobs(self.conversation.top_logprobs, generation)
                completion_id, created = _new_completion_id(), int(time.time())
                reply = await self._record(
                    rendered, session, prepared, generation, message, completion_id, created, shown
                )
            answer = Answer(reply, session.id, await self._answered(session, reply))
        if self.side is not None:
            await self._close_side(self.side)
        return answer

    async def stream(self) -> AsyncGenerator[StreamEvent]:
        """The events of the turn, streamed (`wire/events.py`). Everything that can fail before
        vLLM answers (the render, the session, the context length, an unreachable vLLM) fails
        before the first event, so the route can send a plain error response: the first event
        goes out only once vLLM has sampled."""
        async with self._admitted() as (rendered, admitted):
            session, reply = admitted.session, admitted.replay
            if reply is not None:
                yield Replayed(reply, session.id, await self._answered(session, reply))
            else:
                async with aclosing(self._sampled(rendered, admitted)) as events:
                    async for event in events:
                        yield event
        if self.side is not None:
            await self._close_side(self.side)

    async def count(self) -> int:
        """How many prompt ids the turn would send now: the same render and plan against the
        chains of the session it would join, without admission, sampling or recording
        (Anthropic's `count_tokens`)."""
        rendered = await self._render()
        matched = self.parts.admission.joined(self.caller, rendered.text.encode())
        return len((await self.work.run(plan_match, matched, rendered.text, self.parts.tokenizer)).ids)

    # -- 2. render, 3. admit ---------------------------------------------------------------

    @asynccontextmanager
    async def _admitted(self) -> AsyncIterator[tuple[Rendered, Admitted]]:
        """The turn rendered and admitted to its session (`Turns.open`), holding its claim
        until the block ends, however it ends."""
        rendered = await self._render()
        caller, call_ids, attempt = self.caller, self.conversation.call_ids, self.attempt
        async with self.parts.admission.open(caller, rendered.text.encode(), call_ids, attempt) as admitted:
            yield rendered, admitted

    async def _render(self) -> Rendered:
        """The prompt text, rendered from the messages with their echoes restored to what the
        proxy returned to the session the request joins (`Turns.returned_to`). A large request
        renders in a worker thread, and one that cannot fit the context whatever its tokens is
        refused there, before any tokenizing."""
        returned = self.parts.admission.returned_to(self.caller)
        if not self.work.off_loop:
            return self._rendered(returned)
        max_model_len = (await self.parts.replicas.model()).max_model_len
        return await self.work.run(self._render_fitting, returned, max_model_len)

    def _rendered(self, returned: Find) -> Rendered:
        conversation = self.conversation
        messages = restore(conversation.messages, returned)
        text = self.parts.renders.render(messages, conversation.tools, conversation.template_kwargs)
        return Rendered(text, messages, conversation.tools, conversation.template_kwargs)

    def _render_fitting(self, returned: Find, max_model_len: int) -> Rendered:
        rendered = self._rendered(returned)
        at_least = self.parts.tokenizer.min_tokens(rendered.text)
        if at_least >= max_model_len:
            raise ContextLengthExceeded(
                f"this model's maximum context length is {max_model_len} tokens, but the "
                f"request has at least {at_least} prompt tokens",
                param="messages",
            )
        return rendered

    # -- 4. plan, 5. sample ----------------------------------------------------------------

    async def _prepare(self, rendered: Rendered, admitted: Admitted) -> Prepared:
        """The prompt ids (continuing the furthest of the chains the turn was admitted with, or
        opening one), the model and the sampling."""
        parts, conversation = self.parts, self.conversation
        plan = await self.work.run(plan_match, admitted.match, rendered.text, parts.tokenizer)
        model = await parts.replicas.model()
        max_tokens = _max_tokens(
            model.max_model_len, len(plan.ids), conversation.max_tokens, conversation.fit_max_tokens
        )
        requested = {**conversation.sampling, "max_tokens": max_tokens}
        fields, applied = effective_sampling(requested, parts.sampling_pins)
        constraint = parts.parser.structured_outputs(conversation.parser_request)
        if constraint is not None:
            fields["structured_outputs"] = constraint
        model_id = parts.served_model_name or model.id
        return Prepared(plan, model_id, fields, applied, constraint is not None)

    async def _sampled(self, rendered: Rendered, admitted: Admitted) -> AsyncGenerator[StreamEvent]:
        """A new reply, streamed as vLLM samples it, then recorded (`Closed`)."""
        prepared = await self._prepare(rendered, admitted)
        parts, session, ids = self.parts, admitted.session, prepared.plan.ids
        top = self.conversation.top_logprobs
        completion_id, created = _new_completion_id(), int(time.time())
        reply_stream = parts.parser.stream(self.conversation.parser_request, ids)
        generation: Generation | None = None
        started = False
        # Closed here, not when collected: the replica's in-flight slot is freed at once.
        items = parts.replicas.stream(
            session.id, ids, prepared.fields, return_prompt_ids=parts.verify_prompt_ids
        )
        async with aclosing(items):
            async for item in items:
                if not started:
                    # vLLM echoes the prompt on its first chunk: checked before any event,
                    # so a mismatch is a plain error response, as a whole reply's is.
                    self._verify(ids, item.prompt_token_ids)
                    started = True
                    yield Opened(completion_id, created, prepared.model_id, session.id, len(ids))
                if isinstance(item, Generation):
                    generation = item
                    break
                shown = None if top is None else shown_logprobs(top, item)
                delta = reply_stream.feed(item.token_ids)
                if delta is not None or shown is not None:
                    yield Delta(delta or DeltaMessage(), shown)
        if generation is None:
            raise UpstreamError("vLLM's stream ended without its final result")
        last = reply_stream.finish(generation.finish_reason)
        shown = shown_logprobs(top, generation)
        reply = await self._record(
            rendered, session, prepared, generation, reply_stream.reply, completion_id, created, shown
        )
        yield Closed(reply, last, await self._answered(session, reply))

    def _verify(self, sent: Sequence[int], echoed: list[int] | None) -> None:
        """With `--verify-prompt-ids`, the prompt ids vLLM says it read must be the ids sent
        (compared as lists: the ids sent may be a packed array): a turn is recorded only on
        the prompt the model saw. Whole and streamed turns alike."""
        if self.parts.verify_prompt_ids and echoed != list(sent):
            raise UpstreamError("vLLM reports prompt ids that differ from the ids the proxy sent")

    # -- 6. record, 7. end -----------------------------------------------------------------

    async def _record(
        self,
        rendered: Rendered,
        session: Session,
        prepared: Prepared,
        generation: Generation,
        message: ParsedReply,
        completion_id: str,
        created: int,
        logprobs: list[TokenLogprobs] | None,
    ) -> RecordedReply:
        """The reply in neutral form, recorded with the turn (a retry of this request is
        answered from it, logprobs included) and with its echo view, rendered against the
        turn's render (in a worker thread for a large request, as its prompt was)."""
        reply = RecordedReply(
            completion_id=completion_id,
            created=created,
            model=prepared.model_id,
            message=message,
            finish_reason=generation.finish_reason,
            prompt_tokens=len(prepared.plan.ids),
            completion_tokens=len(generation.token_ids),
            logprobs=logprobs,
        )
        generation = replace(generation, constrained=prepared.constrained)
        parts, sampled, finish = self.parts, generation.token_ids, generation.finish_reason
        ends_turn = parts.parser.ends_with_stop_id(sampled, finish, self.conversation.parser_request)
        sampled_bytes = parts.tokenizer.ids_bytes(sampled)
        echo = await self.work.run(echo_view, parts.renders, rendered, message, sampled_bytes, ends_turn)
        await parts.sessions.record(
            session,
            prepared.plan,
            generation,
            self.attempt.request_hash,
            reply,
            sampling=prepared.applied,
            idempotency_key=self.attempt.idempotency_key,
            echo=echo,
        )
        return reply

    async def _answered(self, session: Session, reply: RecordedReply) -> str | None:
        """What follows a reply, new or a retry's, before it goes out: what the format keeps of
        it (`Keep`), kept; and the requested stop string that ended it, returned, read from the
        ids its turn recorded: the turn stopped without the model's own stop id, on the first
        stop string in its text (Anthropic's `stop_sequence`)."""
        if self.keep is not None:
            await self.keep(reply, session.id)
        if not self.stops or reply.finish_reason != "stop":
            return None
        for segment in session.segments:
            for turn in segment.turns:
                if turn.completion_id == reply.completion_id:
                    ids = segment.token_ids[turn.completion_start : turn.completion_end]
                    if ids and ids[-1] in self.parts.parser.stop_ids:
                        return None
                    text = self.parts.tokenizer.ids_bytes(ids).decode(errors="replace")
                    found = [(text.find(stop), stop) for stop in self.stops if stop in text]
                    return min(found)[1] if found else None
        return None

    async def _close_side(self, rule: str) -> None:
        """A side request's session closed, once its turn is recorded and its claim released
        (its caller names the session it was given, `Completions.turn`)."""
        if self.caller.session_id is not None:
            await self.parts.close(self.caller.session_id, None, side_info(rule), SessionStatus.SIDE)


def shown_logprobs(asked: int | None, sampled: Generation | TokenDelta) -> list[TokenLogprobs] | None:
    """The logprobs a reply shows (`Conversation.top_logprobs`): vLLM's floats for the sampled
    ids, the ones the turn records, with the top alternatives vLLM gave; None if not asked."""
    if asked is None:
        return None
    top = sampled.top_logprobs or [[] for _ in sampled.token_ids]
    return [
        TokenLogprobs(token_id, logprob, alternatives)
        for token_id, logprob, alternatives in zip(sampled.token_ids, sampled.logprobs, top, strict=True)
    ]


def _new_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def _max_tokens(max_model_len: int, prompt_len: int, requested: int | None, fit: bool) -> int:
    """`requested`, or the context left where it asks for none (or asks for more, with `fit`)."""
    room = max_model_len - prompt_len
    if room <= 0 or (requested is not None and requested > room and not fit):
        want = f" plus {requested} completion tokens" if requested is not None else ""
        raise ContextLengthExceeded(
            f"this model's maximum context length is {max_model_len} tokens, but the "
            f"request has {prompt_len} prompt tokens{want}",
            param="messages",
        )
    return min(requested, room) if requested is not None else room
