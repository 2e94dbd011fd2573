"""Sampling for training runs: the `--sampling` pins, vLLM's normalisation made explicit, and
the record of what was applied (`types.Sampling`).

Pure, and independent of the API format: a wire module turns a request into vLLM sampling
fields (`Conversation.sampling`); `effective_sampling` pins and normalises them and says what
vLLM will apply, so the fields sent and the fields recorded are the same. It does not check
what agents send (the wire module does, at the edge).

RL wants on-policy samples, and many agents hard-code a temperature of 0.7 or greedy
decoding: `--sampling temperature=1,top_p=1` overrides whatever they send.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from molt_proxy.types import Sampling

PINNABLE: dict[str, type] = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "presence_penalty": float,
    "frequency_penalty": float,
    "repetition_penalty": float,
}
"""The fields `--sampling` may pin, with their types."""

# vLLM 0.32 `SamplingParams.__post_init__`: a temperature in (0, 0.01) runs at 0.01, and 0 is
# greedy, which sets top_p 1, top_k 0 and min_p 0.
_MIN_TEMPERATURE = 0.01


def parse_pins(spec: str) -> dict[str, float | int]:
    """`"temperature=1,top_p=1"` → `{"temperature": 1.0, "top_p": 1.0}`; ValueError on an
    unknown field, a malformed pair or a value out of vLLM's range."""
    pins: dict[str, float | int] = {}
    for pair in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, value = (part.strip() for part in pair.partition("="))
        if not sep or not name or not value:
            raise ValueError(f"sampling pin {pair!r} is not NAME=VALUE")
        kind = PINNABLE.get(name)
        if kind is None:
            raise ValueError(f"cannot pin sampling field {name!r}; known: {', '.join(PINNABLE)}")
        try:
            pins[name] = kind(value)
        except ValueError:
            raise ValueError(
                f"sampling pin {name}={value!r} is not {'an integer' if kind is int else 'a number'}"
            ) from None
    check_pins(pins)
    return pins


def check_pins(pins: Mapping[str, float | int]) -> None:
    """Known fields with values vLLM accepts (`SamplingParams._verify_args`); ValueError if not."""
    for name, value in pins.items():
        if name not in PINNABLE:
            raise ValueError(f"cannot pin sampling field {name!r}; known: {', '.join(PINNABLE)}")
        accepts, allowed = _RANGES.get(name, _PENALTY)
        if not (math.isfinite(value) and accepts(value)):
            raise ValueError(f"sampling pin {name}={value} is out of range: {allowed}")


_PENALTY = (lambda v: -2.0 <= v <= 2.0, "[-2, 2]")
_RANGES = {
    "temperature": (lambda v: 0.0 <= v <= 2.0, "[0, 2]"),
    "top_p": (lambda v: 0.0 < v <= 1.0, "(0, 1]"),
    "top_k": (lambda v: v >= -1, "-1 or 0 (off), or at least 1"),
    "min_p": (lambda v: 0.0 <= v <= 1.0, "[0, 1]"),
    "repetition_penalty": (lambda v: v > 0.0, "above 0"),
}


def effective_sampling(
    fields: dict[str, Any], pins: Mapping[str, float | int]
) -> tuple[dict[str, Any], Sampling]:
    """vLLM sampling fields with `pins` set and vLLM's own normalisation written out, and the
    record of what vLLM will apply with them."""
    fields = {**fields, **pins}
    if 0.0 < fields["temperature"] < _MIN_TEMPERATURE:
        fields["temperature"] = _MIN_TEMPERATURE
    if fields["top_k"] == -1:
        fields["top_k"] = 0  # both mean off
    if fields["temperature"] == 0.0:
        fields.update(top_p=1.0, top_k=0, min_p=0.0)
    logit_bias = fields.get("logit_bias")
    record = Sampling(
        temperature=float(fields["temperature"]),
        top_p=float(fields["top_p"]),
        top_k=int(fields["top_k"]),
        min_p=float(fields["min_p"]),
        presence_penalty=float(fields["presence_penalty"]),
        frequency_penalty=float(fields["frequency_penalty"]),
        repetition_penalty=float(fields["repetition_penalty"]),
        logit_bias={int(k): float(v) for k, v in logit_bias.items()} if logit_bias else None,
        seed=fields.get("seed"),
        min_tokens=int(fields.get("min_tokens") or 0),
        pinned=sorted(pins),
    )
    return fields, record
