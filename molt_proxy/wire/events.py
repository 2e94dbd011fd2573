"""A turn's answer in no wire format, which each wire format encodes its own way. A whole
reply is an `Answer`; a streamed one is what `Turn.stream` (`completions.py`) yields, which a
format's `Encoder` turns into its events (OpenAI's chunks, Anthropic's message events, ...):

    Replayed                         a retry of the last request: its recorded reply, whole
    Opened, Delta*, Closed           a new turn: vLLM has answered, text as sampled, the end

`Closed` comes once the turn is recorded; a stream cut short before it recorded nothing.
A stream that fails after its first line went out ends with the format's error events, the
same way for every format (`wire.sse.encoded`).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.entrypoints.generate.base.protocol import DeltaMessage

from molt_proxy.types import RecordedReply, TokenLogprobs


@dataclass(slots=True, frozen=True)
class Answer:
    """A whole reply (new, or replayed for a retry) and the session it belongs to."""

    reply: RecordedReply
    session_id: str
    stop_sequence: str | None = None
    """The requested stop string that ended the reply, if one did (Anthropic reports it)."""


@dataclass(slots=True, frozen=True)
class Opened:
    """vLLM has sampled the first ids: the reply begins."""

    completion_id: str
    created: int
    """Unix seconds, as every event of the reply says."""
    model: str
    session_id: str
    prompt_tokens: int = 0
    """The prompt's length in ids (Anthropic's first event reports it)."""


@dataclass(slots=True, frozen=True)
class Delta:
    """What the parsers read from the ids sampled since the last event."""

    delta: DeltaMessage
    logprobs: list[TokenLogprobs] | None = None
    """Those ids' logprobs, when the request asked for them (else None); with them, a delta
    goes out even when the parsers hold its text back (an empty `delta`)."""


@dataclass(slots=True, frozen=True)
class Closed:
    """The turn is recorded: `last` is what the parsers released at the end, if anything."""

    reply: RecordedReply
    last: DeltaMessage | None
    stop_sequence: str | None = None
    """As `Answer.stop_sequence`."""


@dataclass(slots=True, frozen=True)
class Replayed:
    """The recorded reply to a byte-identical retry, sent again whole."""

    reply: RecordedReply
    session_id: str
    stop_sequence: str | None = None
    """As `Answer.stop_sequence`."""


StreamEvent = Opened | Delta | Closed | Replayed
