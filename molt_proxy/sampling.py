"""Sampling for training runs: the `--sampling` pins, vLLM's normalisation made explicit, and
the record of what was applied (`types.Sampling`).

Pure, and independent of the API format: a wire module turns a request into vLLM sampling
fields (`Conversation.sampling`); `effective_sampling` pins and normalises them and says what
vLLM will apply, so the fields sent and the fields recorded are the same. It does not check
what agents send (the wire module does, at the edge), nor the pins (`config.py` reads and
checks them with the other settings).

RL wants on-policy samples, and many agents hard-code a temperature of 0.7 or greedy
decoding: `--sampling temperature=1,top_p=1` overrides whatever they send.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from molt_proxy.types import Sampling

# vLLM 0.32 `SamplingParams.__post_init__`: a temperature in (0, 0.01) runs at 0.01, and 0 is
# greedy, which sets top_p 1, top_k 0 and min_p 0.
_MIN_TEMPERATURE = 0.01


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
