"""One chat turn, end to end: render → session → stitch → generate → parse → record → reply.

This is the data path of DESIGN §2; everything it calls is pure or owned by one module.
A turn runs inside `Turns.open`, which admits it once no turn it must wait for is in flight:
turns on one chain run one after the other, turns on different chains of a session at once.
The whole and the streamed reply share their opening (`_turn`: render, session, replay of a
retry) and their closing (`_finish`: the reply recorded in neutral form). Neither what goes
in nor what comes out is in a wire format: the route decodes a request into a `Conversation`
(`conversation.py`) and encodes the events (`wire/events.py`).

Streaming sends deltas as vLLM samples ids and records the turn once vLLM has finished, just
before the last chunk goes out. A client that disconnects earlier cancels the stream: vLLM
aborts the request and nothing is recorded, as if the request had never been sent (the agent
never saw the whole reply, so it cannot be part of its history). A retry then samples anew.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from vllm.entrypoints.generate.base.protocol import DeltaMessage

from molt_proxy.conversation import Conversation
from molt_proxy.echo import Find, Rendered, echo_view, restore
from molt_proxy.errors import ContextLengthExceeded, UpstreamError
from molt_proxy.parsing import ReplyParser
from molt_proxy.rendering import Renders
from molt_proxy.replicas import Replicas
from molt_proxy.sampling import effective_sampling
from molt_proxy.session import Attempt, Caller, OpenTurn
from molt_proxy.sessions import Sessions
from molt_proxy.stitching import PromptPlan, plan_prompt
from molt_proxy.tokenizer import Tokenizer
from molt_proxy.turns import Turns
from molt_proxy.types import Generation, ParsedReply, RecordedReply, Sampling, Segment, TokenLogprobs
from molt_proxy.upstream import TokenDelta
from molt_proxy.wire.events import Answer, Closed, Delta, Opened, Replayed, StreamEvent

if TYPE_CHECKING:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

OFF_LOOP_BYTES = 64 * 1024
"""Requests with a body this large or larger render and tokenize in a worker thread, so they
do not stall every other client (15 MB took 13.8 s on the loop). Below it a thread hop costs
more than the work. The tokenizer releases the GIL while it encodes."""


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
    rendered: Rendered
    """The render the prompt was planned from: the reply's echo view is rendered against it."""
    request: ChatCompletionRequest
    """vLLM's request (`Conversation.parser_request`): its stop ids end a turn too."""
    off_loop: bool
    """A large request: its echo view is rendered in a worker thread, as its prompt was."""


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
        served_model_name: str | None = None,
    ):
        self.sessions = sessions
        self.turns = Turns(sessions)
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

    async def complete(
        self, caller: Caller, conversation: Conversation, body: bytes, attempt: Attempt
    ) -> Answer:
        async with self._turn(caller, conversation, body, attempt) as (turn, rendered):
            if turn.replay is not None:
                return Answer(turn.replay, turn.session.id)  # a retry of a request answered
            prepared = await self._prepare(turn, rendered, conversation, body)
            plan = prepared.plan
            generation = await self.replicas.generate(
                turn.session.id, plan.ids, prepared.fields, return_prompt_ids=self.verify_prompt_ids
            )
            self._verify(plan.ids, generation.prompt_token_ids)
            message = self.parser.parse(
                generation.token_ids, generation.finish_reason, conversation.parser_request, plan.ids
            )
            shown = shown_logprobs(conversation.top_logprobs, generation)
            reply = await self._finish(
                turn, prepared, generation, message, _new_completion_id(), int(time.time()), shown
            )
            return Answer(reply, turn.session.id)

    async def stream(
        self, caller: Caller, conversation: Conversation, body: bytes, attempt: Attempt
    ) -> AsyncGenerator[StreamEvent]:
        """The events of a streamed turn (`wire/events.py`).

        Everything that can fail before vLLM answers (the render, the session, the context
        length, an unreachable vLLM) fails before the first event, so the caller can send a
        plain error response: the first event goes out only once vLLM has sampled.
        """
        async with self._turn(caller, conversation, body, attempt) as (turn, rendered):
            if turn.replay is not None:
                yield Replayed(turn.replay, turn.session.id)
                return
            prepared = await self._prepare(turn, rendered, conversation, body)
            completion_id, created = _new_completion_id(), int(time.time())
            reply_stream = self.parser.stream(conversation.parser_request, prepared.plan.ids)
            generation: Generation | None = None
            started = False
            # Closed here, not when collected: the replica's in-flight slot is freed at once.
            items = self.replicas.stream(
                turn.session.id, prepared.plan.ids, prepared.fields, return_prompt_ids=self.verify_prompt_ids
            )
            async with aclosing(items):
                async for item in items:
                    if not started:
                        # vLLM echoes the prompt on its first chunk: checked before any event,
                        # so a mismatch is a plain error response, as a whole reply's is.
                        self._verify(prepared.plan.ids, item.prompt_token_ids)
                        started = True
                        prompt_tokens = len(prepared.plan.ids)
                        yield Opened(
                            completion_id, created, prepared.model_id, turn.session.id, prompt_tokens
                        )
                    if isinstance(item, Generation):
                        generation = item
                        break
                    shown = shown_logprobs(conversation.top_logprobs, item)
                    delta = reply_stream.feed(item.token_ids)
                    if delta is not None or shown is not None:
                        yield Delta(delta or DeltaMessage(), shown)
            if generation is None:
                raise UpstreamError("vLLM's stream ended without its final result")
            last = reply_stream.finish(generation.finish_reason)
            shown = shown_logprobs(conversation.top_logprobs, generation)
            reply = await self._finish(
                turn, prepared, generation, reply_stream.reply, completion_id, created, shown
            )
            yield Closed(reply, last)

    def _verify(self, sent: list[int], echoed: list[int] | None) -> None:
        """With `--verify-prompt-ids`, the prompt ids vLLM says it read must be the ids sent:
        a turn is recorded only on the prompt the model saw. Whole and streamed turns alike."""
        if self.verify_prompt_ids and echoed != sent:
            raise UpstreamError("vLLM reports prompt ids that differ from the ids the proxy sent")

    async def count(self, caller: Caller, conversation: Conversation, body: bytes) -> int:
        """How many prompt ids a turn for this request would send now: the same render and
        stitching plan against the chains of the session it would join, without sampling,
        recording or creating a session (Anthropic's `count_tokens`)."""
        rendered = await self._render(conversation, body, self.turns.returned_to(caller))
        segments = self.turns.joined_segments(caller, rendered.text.encode())
        return len((await self._plan(segments, rendered.text, body)).ids)

    @asynccontextmanager
    async def _turn(
        self, caller: Caller, conversation: Conversation, body: bytes, attempt: Attempt
    ) -> AsyncIterator[tuple[OpenTurn, Rendered]]:
        """The opening every turn shares: render the request, its echoes restored to what the
        proxy returned (`echo.py`), and open its session's turn (`turn.replay` says whether
        `attempt` retries a request answered), which the end of the block closes. Yields the
        turn and the render."""
        rendered = await self._render(conversation, body, self.turns.returned_to(caller))
        async with self.turns.open(caller, rendered.text.encode(), conversation.call_ids, attempt) as turn:
            yield turn, rendered

    async def _prepare(
        self, turn: OpenTurn, rendered: Rendered, conversation: Conversation, body: bytes
    ) -> Prepared:
        """The prompt ids (continuing one of the session's chains or opening one), the model and
        the sampling."""
        plan = await self._plan(turn.segments, rendered.text, body)
        model = await self.replicas.model()
        max_tokens = _max_tokens(
            model.max_model_len, len(plan.ids), conversation.max_tokens, conversation.fit_max_tokens
        )
        requested = {**conversation.sampling, "max_tokens": max_tokens}
        fields, applied = effective_sampling(requested, self.sampling_pins)
        constraint = self.parser.structured_outputs(conversation.parser_request)
        if constraint is not None:
            fields["structured_outputs"] = constraint
        model_id = self.served_model_name or model.id
        off_loop = len(body) >= OFF_LOOP_BYTES
        return Prepared(
            plan,
            model_id,
            fields,
            applied,
            constraint is not None,
            rendered,
            conversation.parser_request,
            off_loop,
        )

    async def _finish(
        self,
        turn: OpenTurn,
        prepared: Prepared,
        generation: Generation,
        message: ParsedReply,
        completion_id: str,
        created: int,
        logprobs: list[TokenLogprobs] | None,
    ) -> RecordedReply:
        """The closing every turn shares: the reply in neutral form, recorded with the turn
        (a retry of this request is answered from it, logprobs included) and with its echo
        view."""
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
        sampled = generation.token_ids
        ends_turn = self.parser.ends_with_stop_id(sampled, generation.finish_reason, prepared.request)
        view = (self.renders, prepared.rendered, message, self.tokenizer.ids_bytes(sampled), ends_turn)
        echo = await asyncio.to_thread(echo_view, *view) if prepared.off_loop else echo_view(*view)
        await turn.record(prepared.plan, generation, reply, prepared.applied, echo)
        return reply

    async def _render(self, conversation: Conversation, body: bytes, returned: Find) -> Rendered:
        """The prompt text, rendered from the messages with their echoes restored. A large
        request renders in a worker thread, and one that cannot fit the context whatever its
        tokens is refused there, before any tokenizing."""
        if len(body) < OFF_LOOP_BYTES:
            return self._rendered(conversation, returned)
        max_model_len = (await self.replicas.model()).max_model_len
        return await asyncio.to_thread(self._render_fitting, conversation, returned, max_model_len)

    def _rendered(self, conversation: Conversation, returned: Find) -> Rendered:
        messages = restore(conversation.messages, returned)
        text = self.renders.render(messages, conversation.tools, conversation.template_kwargs)
        return Rendered(text, messages, conversation.tools, conversation.template_kwargs)

    def _render_fitting(self, conversation: Conversation, returned: Find, max_model_len: int) -> Rendered:
        rendered = self._rendered(conversation, returned)
        at_least = self.tokenizer.min_tokens(rendered.text)
        if at_least >= max_model_len:
            raise ContextLengthExceeded(
                f"this model's maximum context length is {max_model_len} tokens, but the "
                f"request has at least {at_least} prompt tokens",
                param="messages",
            )
        return rendered

    async def _plan(self, segments: list[Segment], rendered: str, body: bytes) -> PromptPlan:
        """`plan_prompt` on the chains the turn was admitted with (its claim keeps the ones it
        may continue unchanged), in a worker thread for a large request."""
        if len(body) < OFF_LOOP_BYTES:
            return plan_prompt(segments, rendered, self.tokenizer)
        return await asyncio.to_thread(plan_prompt, segments, rendered, self.tokenizer)


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
