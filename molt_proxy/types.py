"""The data contract of molt-proxy: turns, segments and trajectories.

Imports nothing from the package. Every `[T]` field or property of a segment or trajectory is
aligned 1:1 with `token_ids`; shapes are written as `[T]` for the segment length.
"""

from __future__ import annotations

import enum
from array import array
from dataclasses import asdict, dataclass, field
from typing import Any

# A prompt token was not sampled by any policy; its weight version says so.
NOT_SAMPLED = -1


class SessionStatus(enum.StrEnum):
    OPEN = "open"
    REWARDED = "rewarded"
    UNREWARDED = "unrewarded"  # closed by TTL or shutdown without a final reward
    SIDE = "side"  # a harness's side request (`side.py`): served and kept, never trained on


@dataclass(slots=True)
class Sampling:
    """The sampling parameters vLLM applied to one turn: what the agent asked for, with the
    proxy's explicit defaults, its `--sampling` pins and vLLM's own normalisation filled in
    (a temperature below 0.01 runs at 0.01; greedy turns run with top_p 1, top_k 0, min_p 0).
    The trainer recomputes each sampled token's logprob under the same processing."""

    temperature: float = 1.0
    """Logits are divided by it; 0 is greedy (argmax), whose logprob vLLM reports at T = 1."""
    top_p: float = 1.0
    """Nucleus truncation; 1 is off."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 is off."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely one; 0 is off."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    """Token id → bias added to its logit before everything else."""
    seed: int | None = None
    """Picks the sample, not the distribution: it does not change any logprob."""
    min_tokens: int = 0
    """Stop tokens are suppressed until the turn has this many tokens."""
    pinned: list[str] = field(default_factory=list)
    """The fields the proxy's `--sampling` set, whatever the agent sent."""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Sampling:
        """The inverse of `asdict` through JSON, which turns `logit_bias`'s keys into strings
        (and through Parquet, which gives every record every key seen, null where absent)."""
        fields = {name: data[name] for name in cls.__dataclass_fields__ if name in data}
        if fields.get("logit_bias") is not None:
            bias = fields["logit_bias"].items()
            fields["logit_bias"] = {int(k): float(v) for k, v in bias if v is not None}
        return cls(**fields)


@dataclass(slots=True)
class Turn:
    """One completion inside a segment; offsets index the segment's `token_ids`, so the sampled
    ids of the turn are `token_ids[completion_start:completion_end]`."""

    completion_id: str
    """The `id` of the reply the agent received (`chatcmpl-...`); rewards may name it."""
    prompt_start: int
    """Index of the first token this request appended (its new prompt suffix)."""
    completion_start: int
    """Index of the first sampled token."""
    completion_end: int
    """One past the last sampled token."""
    finish_reason: str
    """vLLM's reason the turn ended: `stop` (a stop token or string) or `length`."""
    created: float = 0.0
    """When the turn was committed (Unix seconds)."""
    reward: float | None = None
    """A per-turn reward (`POST /v1/rewards` with this completion id and `final: false`)."""
    sampling: Sampling | None = None
    """What vLLM sampled this turn with; None in records from before it was recorded (the
    trainer then cannot reproduce the turn's distribution and leaves its tokens out)."""
    constrained: bool = False
    """vLLM sampled this turn under structured outputs (`tool_choice` required or named,
    `parallel_tool_calls: false`, `response_format` JSON, `structured_outputs`): each sampled
    token was drawn from the grammar-masked distribution, renormalised over the tokens the
    grammar allowed, and its recorded logprob is that distribution's, not the policy's (see
    docs/sampling.md). False in records from before it was recorded."""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Turn:
        """A turn from `asdict`'s form; keys it does not know are ignored."""
        turn = cls(**{name: data[name] for name in cls.__dataclass_fields__ if name in data})
        if isinstance(turn.sampling, dict):
            turn.sampling = Sampling.from_json(turn.sampling)
        return turn


@dataclass(slots=True)
class Segment:
    """The exact token record of one unbroken stretch of a conversation, packed: an open
    session holds it in memory for as long as the episode runs, so ids and the sampled tokens'
    logprobs are typed arrays, and the loss mask and weight versions, which change only at turn
    boundaries (and at a weight refresh), are spans; the aligned [T] lists are properties."""

    index: int
    token_ids: array = field(default_factory=lambda: array("i"))
    """[T] every id the model saw or sampled, in order (int32)."""
    sampled_logprobs: array = field(default_factory=lambda: array("d"))
    """The rollout logprob of each sampled token, in order (`logprobs` spreads them over the
    turns' completions). Doubles: exactly the floats vLLM returned."""
    version_runs: list[tuple[int, int]] = field(default_factory=list)
    """(start, version): from index `start` on, the tokens' weight version (`weight_versions`),
    one entry where it changes."""
    turns: list[Turn] = field(default_factory=list)
    text: bytes = b""
    """The bytes `token_ids` decode to: the prefix a continuing request must start with."""
    echo: bytes | None = None
    """`text` with each turn's sampled bytes replaced by its echo view (the bytes the template
    renders for the reply as returned, `echo.py`), once a turn has one; a request that starts
    with it continues the segment too. None: no turn has one, it would equal `text`."""

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def loss_mask(self) -> list[int]:
        """[T] 1 where the policy sampled the token (each turn's completion), 0 for prompt tokens."""
        mask = [0] * len(self.token_ids)
        for turn in self.turns:
            mask[turn.completion_start : turn.completion_end] = [1] * (
                turn.completion_end - turn.completion_start
            )
        return mask

    @property
    def logprobs(self) -> list[float]:
        """[T] rollout logprob of each sampled token (processed distribution); 0.0 where mask is 0."""
        logprobs = [0.0] * len(self.token_ids)
        done = 0
        for turn in self.turns:
            n = turn.completion_end - turn.completion_start
            logprobs[turn.completion_start : turn.completion_end] = self.sampled_logprobs[done : done + n]
            done += n
        return logprobs

    @property
    def weight_versions(self) -> list[int]:
        """[T] weight version that sampled each token; NOT_SAMPLED (-1) where mask is 0."""
        versions: list[int] = []
        ends = [start for start, _ in self.version_runs[1:]] + [len(self.token_ids)]
        for (start, version), end in zip(self.version_runs, ends, strict=True):
            versions += [version] * (end - start)
        return versions

    def add_run(self, count: int, version: int) -> None:
        """Append the version of `count` tokens just appended, all of one version (a prompt's
        ids, NOT_SAMPLED): one run, with no loop over a prompt of a million ids on the loop."""
        if count and (not self.version_runs or self.version_runs[-1][1] != version):
            self.version_runs.append((len(self.token_ids) - count, version))

    def add_versions(self, versions: list[int]) -> None:
        """Append the weight versions of the tokens just appended (`versions` ends at the end)."""
        start = len(self.token_ids) - len(versions)
        for i, version in enumerate(versions):
            if not self.version_runs or self.version_runs[-1][1] != version:
                self.version_runs.append((start + i, version))


@dataclass(slots=True)
class Trajectory:
    """A finalized segment with its session's reward: what the trainer reads.

    The JSON form (`to_json`) is the schema documented in docs/using-it.md, used by the HTTP
    stream, the exports and the trainer alike.
    """

    seq: int
    """Position in the store's finalized stream (dense, increasing): the trainer's cursor. The
    segments of one session are finalized in one transaction, so their seqs are consecutive."""
    trajectory_id: str
    """`<session_id>:<segment>`."""
    session_id: str
    """The episode; all its segments share its group and reward."""
    segment: int
    """This segment's index in the session: 0, 1, ..., num_segments - 1, in the order its
    chains opened (`stitching.py`)."""
    num_segments: int
    """How many segments (trajectories) the session finalized with: a group baseline must see
    the whole session, so the trainer waits for all of them."""
    group_id: str
    """The group for GRPO/RLOO baselines (given at session creation, else a prompt hash)."""
    token_ids: list[int]
    """[T] every id the model saw or sampled, in order."""
    loss_mask: list[int]
    """[T] 1 where the policy sampled the token, 0 for prompt tokens."""
    logprobs: list[float]
    """[T] rollout logprob of each sampled token (processed distribution); 0.0 where mask is 0."""
    weight_versions: list[int]
    """[T] weight version that sampled each token (0: vLLM's boot weights); NOT_SAMPLED (-1)
    where mask is 0."""
    turns: list[Turn]
    """[turns] the completions of this segment, in order."""
    reward: float | None
    """The session's final reward; None when it closed unrewarded (never trained on)."""
    info: dict[str, Any]
    """The reward's `info`, as posted."""
    status: SessionStatus
    """How the session closed: rewarded, unrewarded (TTL or shutdown), or side (a harness's
    side request). The server's alone: a client writes only `reward` and `info`."""
    model: str
    """The served model."""
    created: float
    """Finalization time (Unix seconds)."""

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["status"] = self.status.value
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Trajectory:
        """The inverse of `to_json`. Keys it does not know (from a newer proxy) are ignored;
        a record stored before `num_segments` existed reads 1 (each segment on its own)."""
        fields = {name: data[name] for name in cls.__dataclass_fields__ if name in data}
        fields.setdefault("num_segments", 1)
        fields["turns"] = [Turn.from_json(t) for t in data["turns"]]
        fields["status"] = SessionStatus(data["status"])
        return cls(**fields)


@dataclass(slots=True)
class Generation:
    """What vLLM sampled for one prompt (upstream's typed result)."""

    token_ids: list[int]
    """[N] sampled ids, the stop token included when the model emitted it."""
    logprobs: list[float]
    """[N] logprob of each sampled id under the processed sampling distribution."""
    weight_versions: list[int]
    """[N] weight version that sampled each id."""
    finish_reason: str
    prompt_token_ids: list[int] | None = None
    """The prompt ids vLLM reports it received, when it reports them."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """[N][k] (id, logprob) of the k most likely ids at each sampled position, most likely
    first, when the request asked vLLM for them (an agent's `top_logprobs`); else None."""
    constrained: bool = False
    """Sampled under structured outputs (a grammar mask): the turn records it."""


@dataclass(slots=True)
class ParsedReply:
    """The assistant message vLLM's parsers read from the sampled ids, in no wire format."""

    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    """[calls] `{"id", "type": "function", "function": {"name", "arguments"}}`, the shape vLLM's
    tool parsers produce; `arguments` is the exact JSON text the model sampled where found."""

    def as_message(self) -> dict[str, Any]:
        """The assistant message of the chat template's (and chat completions') shape: what an
        agent echoes, and what the echo view renders."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


@dataclass(slots=True)
class TokenLogprobs:
    """One sampled token as an agent asked to see it (OpenAI's `logprobs`): not part of the
    record, whose logprobs are `Segment.logprobs` (the same floats)."""

    token_id: int
    logprob: float
    """The sampled id's logprob under the processed distribution, as recorded."""
    top: list[tuple[int, float]]
    """[k] (id, logprob) of the k most likely ids at this position, most likely first."""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TokenLogprobs:
        return cls(data["token_id"], data["logprob"], [(int(i), float(lp)) for i, lp in data["top"]])


@dataclass(slots=True)
class RecordedReply:
    """What one turn answered, kept (in memory and in the store) so that a byte-identical retry
    is answered again without sampling. Format-neutral: each wire format encodes it its own way,
    and `finish_reason` is vLLM's (a wire format maps `stop` with tool calls as it needs)."""

    completion_id: str
    created: int
    """When the reply was made (Unix seconds), as the reply said."""
    model: str
    message: ParsedReply
    finish_reason: str
    """vLLM's reason: `stop` or `length`."""
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprobs] | None = None
    """[N] every sampled token's logprob (and top alternatives), when the request asked for
    them: kept so that a replayed reply shows the same ones; None when it did not ask."""

    @property
    def call_ids(self) -> set[str]:
        """The ids of the tool calls the reply made: an agent's later history echoes them."""
        return {call["id"] for call in self.message.tool_calls}

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RecordedReply:
        logprobs = data.get("logprobs")
        if logprobs is not None:
            logprobs = [TokenLogprobs.from_json(entry) for entry in logprobs]
        return cls(**{**data, "message": ParsedReply(**data["message"]), "logprobs": logprobs})


@dataclass(slots=True)
class StoredSession:
    """A session's row in the store."""

    id: str
    group_id: str | None
    api_key_hash: str | None
    """SHA-256 of the session's key (`auth.key_id`): the key itself is never stored."""
    owner: str | None
    """The id of the agent key that created the session; None: the admin's or an open proxy's."""
    inferred: bool
    """Joined by continuation (no session id): only such sessions are candidates for it."""
    status: SessionStatus
    created: float


@dataclass(slots=True, frozen=True)
class EchoView:
    """How a reply reads back in the history where that differs from its sampled bytes
    (`echo.echo_view`): a request whose render shows it continues the reply's segment over
    the sampled ids (`Segment.echo`)."""

    view: bytes
    """The bytes the chat template renders for the reply as the proxy returned it."""
    dropped: bytes = b""
    """The end of the turn's prompt that the view stands for too: the end of the generation
    prompt the template leaves out of the history (Qwen3's empty `<think>` block with thinking
    off); b"" mostly."""


@dataclass(slots=True)
class StoredTurn:
    """One committed turn of an open session, as the store keeps it: only what the turn
    appended, so an open session is rebuilt by replaying its turns in order."""

    completion_id: str
    segment: int
    """The index of the segment (chain) the turn joined; a new index opened a new chain."""
    new_ids: list[int]
    """[P] the prompt ids the request appended before the completion."""
    generation: Generation
    created: float
    request_hash: str
    """SHA-256 of the request body: a byte-identical retry is answered with `reply`."""
    reply: RecordedReply | None
    """None for a row whose reply this version cannot read (it is then never replayed)."""
    reward: float | None = None
    sampling: Sampling | None = None
    """What vLLM sampled the turn with (JSON in the `sampling` column; NULL before it existed)."""
    idempotency_key: str | None = None
    """The request's `Idempotency-Key`, if it sent one: a retry with the key gets `reply`."""
    echo: EchoView | None = None
    """The reply's echo view, where it has one (`echo.echo_view`)."""
