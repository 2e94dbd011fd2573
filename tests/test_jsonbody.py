"""The request decoder's fast path (`wire/jsonbody.py`): orjson reads a body only where its
reading is Python's `json` reading and passes the same checks; at each edge where the two
differ (integers of 19 digits and more, nesting past `MAX_DEPTH` in a body with many brackets)
the body is read strictly, so what is accepted, and as what, is unchanged."""

from __future__ import annotations

import json

import pytest

from molt_proxy.errors import BadRequest
from molt_proxy.wire.jsonbody import MAX_DEPTH, decode_json_object


def _nested(levels: int) -> bytes:
    return b'{"a": ' + b"[" * (levels - 1) + b"1" + b"]" * (levels - 1) + b"}"


@pytest.mark.parametrize(
    "body",
    [
        b'{"seed": 9223372036854775807, "neg": -9223372036854775808, "f": 1e308, "g": -0.0, "h": 1.5e-400}',
        b'{"text": "caf\\u00e9 \\ud83d\\ude00 \xe2\x9c\x93", "code": "' + b"{[" * 80 + b'", "n": null}',
        _nested(MAX_DEPTH),
        b'{"digits": "12345678901234567890123", "x": [1, 2.5, true, false, {}]}',
    ],
)
def test_what_is_accepted_reads_as_pythons_json_reads_it(body):
    decoded = decode_json_object(body)
    assert decoded == json.loads(body)
    assert json.dumps(decoded) == json.dumps(json.loads(body))  # ints stay ints, floats floats


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"seed": 9223372036854775808}', "'seed' is an integer out of the 64-bit range"),
        (b'{"seed": 18446744073709551616}', "'seed' is an integer out of the 64-bit range"),
        (b'{"seed": -9223372036854775809}', "'seed' is an integer out of the 64-bit range"),
        (_nested(MAX_DEPTH + 1), f"the request body nests deeper than {MAX_DEPTH} levels"),
    ],
)
def test_what_orjson_alone_would_accept_is_refused_as_before(body, message):
    with pytest.raises(BadRequest) as refused:
        decode_json_object(body)
    assert refused.value.message == message
