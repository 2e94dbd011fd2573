"""The one JSON decoder for request bodies: what Python's `json` accepts but the proxy must not.

Python's `json` reads `NaN` and `Infinity`, turns `1e400` into `inf`, keeps a lone
surrogate (`"\\ud800"`) in a string that cannot be written as UTF-8 later, and recurses once
per nesting level. Each of these once got past the edge and failed later: a non-finite
reward made every trajectory read answer 500, a surrogate failed inside the render, deep
nesting raised `RecursionError`. They are refused here, as a 400, before any route sees the
body:

- `NaN`, `Infinity`, `-Infinity`, and numbers that overflow to infinity;
- integers outside int64 (what SQLite and vLLM's msgpack transport hold; Python's own limit
  of 4,300 digits is far past any field's meaning);
- nesting deeper than `MAX_DEPTH` objects and arrays;
- lone surrogates in any string or key.

Most bodies are read by orjson, about ten times faster, where its reading provably equals the
strict one's and passes these checks (`_fast`); any other body, and every refused one, is
read by Python's `json` and checked value by value, so what is refused and how is the same.
"""

from __future__ import annotations

import json
import math
import re
from itertools import accumulate
from typing import Any

import orjson

from molt_proxy.errors import BadRequest

MAX_DEPTH = 64
"""Deepest nesting of objects and arrays accepted. A tool's JSON schema nests a dozen levels;
the bound keeps templates, pydantic and `json.dumps` far from Python's recursion limit."""
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"0" * 9)
_LONG_NUMBER = b"0" * 19
"""19 digits in a row (digits read as 0): an integer that may be outside int64, which orjson
reads as a float. A search by `bytes.translate` and `in`, ten times faster than a regex."""


def decode_json_object(body: bytes, *, allow_empty: bool = False) -> dict[str, Any]:
    """Bytes → a JSON object safe to validate, store and re-encode; BadRequest otherwise, with
    `param` naming the offending value (`info.score`, `messages.0.content`)."""
    if allow_empty and not body.strip():
        return {}
    data = _fast(body)
    if data is None:
        data = _strict(body)
    if not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object")
    return data


def _fast(body: bytes) -> Any | None:
    """orjson's reading of `body`, where it is the strict one's and passes its checks; None:
    read it strictly. orjson refuses what the checks refuse but nesting and integers: it
    reads an integer past 2^64 as a float (one with 19 digits or more is read strictly) and
    nests to 1,024 levels (a body with more than `MAX_DEPTH` brackets is measured)."""
    if _LONG_NUMBER in body.translate(_DIGITS_AS_ZERO):
        return None
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if body.count(b"[") + body.count(b"{") > MAX_DEPTH and _depth(body) > MAX_DEPTH:
        return None
    return data


_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'"[]{}')
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def _depth(body: bytes) -> int:
    """How deep objects and arrays nest in `body`, JSON that orjson has read: the deepest
    running count of its brackets outside strings (none: 0). Read off the bytes, in C: an
    agent's history of 400 messages has more than `MAX_DEPTH` brackets, and walking its
    decoded value took a third of its decoding. Escaped backslashes, then escaped quotes, go
    first; then every string's quotes pair up, and the text between each pair is dropped."""
    text = body.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_STRUCTURE)
    outside = b"".join(text.split(b'"')[::2])
    return max(accumulate(map(_STEP.__getitem__, outside)), default=0)


def _strict(body: bytes) -> Any:
    try:
        data = json.loads(body, parse_constant=float, parse_int=_int)
    except RecursionError:
        raise BadRequest(f"the request body nests deeper than {MAX_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise BadRequest(f"the request body is not valid JSON: {str(exc)[:200]}") from None
    check_json_safe(data)
    return data


def check_json_safe(value: Any, param: str = "", *, max_depth: int = MAX_DEPTH) -> None:
    """Refuse, in a decoded value, what JSON must not carry here: deeper than `max_depth`, a
    lone surrogate, a non-finite number, an integer outside int64. Iterative, so depth costs no
    stack."""
    stack: list[tuple[Any, int, str]] = [(value, 0, param)]
    while stack:
        item, depth, path = stack.pop()
        if isinstance(item, dict | list):
            if depth >= max_depth:
                raise BadRequest(f"the request body nests deeper than {max_depth} levels", param=path or None)
            stack.extend(_children(item, depth, path))
        else:
            _check_leaf(item, path)


def _children(item: dict[Any, Any] | list[Any], depth: int, path: str) -> list[tuple[Any, int, str]]:
    """The values in a container, each with its depth and path; a key must be safe too."""
    pairs = item.items() if isinstance(item, dict) else enumerate(item)
    children = []
    for key, child in pairs:
        if isinstance(key, str) and _LONE_SURROGATE.search(key):
            raise BadRequest("a key holds a lone UTF-16 surrogate", param=path or None)
        children.append((child, depth + 1, f"{path}.{key}" if path else str(key)))
    return children


def _check_leaf(item: Any, path: str) -> None:
    """A string without lone surrogates, a finite float, an int64, a bool or null."""
    if isinstance(item, str):
        if _LONE_SURROGATE.search(item):
            raise BadRequest(f"'{path}' holds a lone UTF-16 surrogate", param=path or None)
    elif isinstance(item, bool) or item is None:
        return
    elif isinstance(item, float):
        if not math.isfinite(item):
            raise BadRequest(f"'{path}' must be a finite number", param=path or None)
    elif item is _OUT_OF_RANGE or isinstance(item, int) and not INT64_MIN <= item <= INT64_MAX:
        raise BadRequest(f"'{path}' is an integer out of the 64-bit range", param=path or None)
    elif not isinstance(item, int):
        raise BadRequest(f"'{path}' is a {type(item).__name__}, not JSON", param=path or None)


_OUT_OF_RANGE = object()
"""What an integer literal of more than 19 digits decodes to: `int()` of a huge literal costs
quadratic time (and fails past 4,300 digits), and the value is refused anyway."""


def _int(text: str) -> int | object:
    return _OUT_OF_RANGE if len(text) > 20 else int(text)
