"""Request bodies of the JSON routes: the reward body as a model, the session and weights
bodies' decoders, and the schemas the served OpenAPI declares for every POST body (so clients
and fuzzers see what each route takes).

Every body goes through `decode_json_object` first; the models here then check shape and
type. The chat route keeps its raw bytes (it hashes them and needs the messages exactly as
sent), so its schema is declared for the OpenAPI only and vLLM's own model validates it.
"""

from __future__ import annotations

from typing import Any, TypeVar

import orjson
import pydantic
from pydantic import BaseModel, Field, StrictBool, field_validator

from molt_proxy.errors import BadRequest
from molt_proxy.wire.jsonbody import check_json_safe, decode_json_object

M = TypeVar("M", bound=BaseModel)

MAX_INFO_BYTES = 64 * 1024
"""The largest reward `info` taken, as compact JSON. It is stored once per session and sent
with each of its trajectories to the trainer, whose pages of 100 must stay small; what a
rollout says about an attempt (exit code, durations, a check's output, a stderr tail) fits."""
MAX_INFO_DEPTH = 8
"""The deepest nesting of objects and arrays in `info` (itself at depth 1)."""


class RewardBody(BaseModel):
    """`POST /v1/rewards`: a final reward closes the session; `final: false` with a
    `completion_id` rewards that one turn."""

    session_id: str | None = Field(None, min_length=1)
    completion_id: str | None = Field(None, min_length=1)
    reward: float = Field(strict=True, allow_inf_nan=False)
    """Finite: one NaN in the store would make every later trajectory read fail."""
    final: StrictBool = True
    info: dict[str, Any] = Field(default_factory=dict)
    """Free-form, stored once per session and given with its trajectories: JSON with finite
    numbers only, at most `MAX_INFO_BYTES` and `MAX_INFO_DEPTH` deep."""

    @field_validator("info")
    @classmethod
    def _json_safe(cls, info: dict[str, Any]) -> dict[str, Any]:
        return _checked_info(info)

    @classmethod
    def decode(cls, body: bytes, reward_range: tuple[float, float]) -> RewardBody:
        """The body, its reward inside `reward_range` (`Settings.reward_range`)."""
        reward = validated(cls, decode_json_object(body))
        if (reward.session_id is None) == (reward.completion_id is None):
            raise BadRequest("give exactly one of 'session_id' and 'completion_id'", param="session_id")
        low, high = reward_range
        if not low <= reward.reward <= high:
            raise BadRequest(
                f"'reward' must be within [{low:g}, {high:g}] (serve --reward-range), not {reward.reward:g}",
                param="reward",
            )
        return reward


class CloseBody(BaseModel):
    """`POST /v1/sessions/{id}/close`: end a session without a reward (the harness crashed or
    timed out), saying why in `info`; the trainer skips it as it skips one the TTL closed."""

    info: dict[str, Any] = Field(default_factory=dict)
    """As a reward's `info`."""

    @field_validator("info")
    @classmethod
    def _json_safe(cls, info: dict[str, Any]) -> dict[str, Any]:
        return _checked_info(info)

    @classmethod
    def decode(cls, body: bytes) -> CloseBody:
        """The body; an empty one is `{}`."""
        return validated(cls, decode_json_object(body, allow_empty=True))


def _checked_info(info: dict[str, Any]) -> dict[str, Any]:
    try:
        check_json_safe(info, max_depth=MAX_INFO_DEPTH)
    except BadRequest as exc:
        raise ValueError(exc.message) from None
    size = len(orjson.dumps(info))
    if size > MAX_INFO_BYTES:
        raise ValueError(f"info is {size} bytes as JSON; at most {MAX_INFO_BYTES} are taken")
    return info


EVAL_GROUP_PREFIX = "eval/"
"""Sessions in a group named so are evaluation episodes: recorded and streamed, never trained on."""


def decode_session_body(body: bytes) -> tuple[str | None, str | None]:
    """`POST /v1/sessions`: the optional `session_id` and `group_id` (an empty body is none).
    `"train": false` makes the session an evaluation episode: its group is put under
    `EVAL_GROUP_PREFIX` (`eval/<group_id>`, or `eval/` without one), which the trainer skips."""
    data = decode_json_object(body, allow_empty=True)
    session_id, group_id = optional_str(data, "session_id"), optional_str(data, "group_id")
    train = data.get("train", True)
    if not isinstance(train, bool):
        raise BadRequest("'train' must be a boolean", param="train")
    if not train and not (group_id or "").startswith(EVAL_GROUP_PREFIX):
        group_id = EVAL_GROUP_PREFIX + (group_id or "")
    return session_id, group_id


def decode_weights_body(body: bytes) -> tuple[str, object]:
    """`POST /v1/admin/weights`: the folder, and the version as sent (`weights.check_version`
    checks it against the store)."""
    data = decode_json_object(body)
    path = optional_str(data, "path")
    if path is None:
        raise BadRequest("'path' is required", param="path")
    return path, data.get("version")


def optional_str(data: dict[str, Any], key: str) -> str | None:
    """`data[key]`: absent (None) or a non-empty string."""
    value = data.get(key)
    if value is not None and (not isinstance(value, str) or not value):
        raise BadRequest(f"'{key}' must be a non-empty string", param=key)
    return value


def validated(model: type[M], data: dict[str, Any]) -> M:
    """`model` from a decoded body, its first error as a 400 naming the field."""
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        error = exc.errors()[0]
        param = ".".join(str(part) for part in error["loc"]) or None
        raise BadRequest(f"invalid value for '{param}': {error['msg'][:300]}", param=param) from None


def request_body(schema: dict[str, Any], *, required: bool = True) -> dict[str, Any]:
    """`openapi_extra` for a route that reads its body itself."""
    content = {"application/json": {"schema": schema}}
    return {"requestBody": {"required": required, "content": content}}


_NAME = {"type": "string", "minLength": 1}
SESSION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"session_id": _NAME, "group_id": _NAME, "train": {"type": "boolean", "default": True}},
}
WEIGHTS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"path": _NAME, "version": {"type": "integer", "minimum": 0}},
    "required": ["path", "version"],
}
_MESSAGE = {
    "type": "object",
    "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {
            "anyOf": [
                {"type": "string"},
                {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                        "required": ["type", "text"],
                    },
                },
                {"type": "null"},
            ]
        },
        "tool_call_id": {"type": "string"},
        "tool_calls": {"type": "array", "items": {"type": "object"}},
        "reasoning_content": {"type": "string"},
    },
    "required": ["role"],
}
_TOOL = {
    "type": "object",
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "properties": {
                "name": _NAME,
                "description": {"type": "string"},
                "parameters": {"type": "object"},
            },
            "required": ["name"],
        },
    },
    "required": ["type", "function"],
}
JSON_SCHEMA_FORMAT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "description": {"type": "string"},
        "schema": {"type": "object"},
        "strict": {"type": "boolean"},
    },
    "required": ["name", "schema"],
}
"""A json_schema output format: chat's `response_format.json_schema`, and (with `type`) the
Responses API's `text.format`."""
_RESPONSE_FORMAT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "type": {"enum": ["text", "json_object", "json_schema"]},
        "json_schema": JSON_SCHEMA_FORMAT,
    },
    "required": ["type"],
}
_STRUCTURED_OUTPUTS: dict[str, Any] = {
    "type": "object",
    "description": "vLLM's structured outputs: exactly one of these constraints.",
    "properties": {
        "json": {"anyOf": [{"type": "object"}, {"type": "string"}]},
        "regex": {"type": "string"},
        "choice": {"type": "array", "items": {"type": "string"}},
        "grammar": {"type": "string"},
        "json_object": {"type": "boolean"},
    },
    "minProperties": 1,
    "maxProperties": 1,
}
CHAT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "OpenAI Chat Completions (the fields vLLM's ChatCompletionRequest takes; a subset here).",
    "properties": {
        "model": {"type": "string"},
        "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
        "max_tokens": {"type": "integer", "minimum": 1},
        "max_completion_tokens": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": -1},
        "min_p": {"type": "number", "minimum": 0, "maximum": 1},
        "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "repetition_penalty": {"type": "number", "exclusiveMinimum": 0},
        "seed": {"type": "integer"},
        "stop": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
        "n": {"type": "integer", "const": 1},
        "stream": {"type": "boolean"},
        "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
        "logprobs": {"type": "boolean"},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
        "tools": {"type": "array", "items": _TOOL},
        "tool_choice": {"anyOf": [{"enum": ["none", "auto"]}, {"type": "object"}]},
        "metadata": {"type": "object"},
        "chat_template_kwargs": {"type": "object"},
        "response_format": _RESPONSE_FORMAT,
        "structured_outputs": _STRUCTURED_OUTPUTS,
        "logit_bias": {
            "type": "object",
            "propertyNames": {"pattern": "^[0-9]+$"},
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        },
    },
    "required": ["messages"],
}
