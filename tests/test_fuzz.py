"""Schemathesis against the served OpenAPI: no input gives a 5xx, every 4xx has the OpenAI
error body (issue 9), or Anthropic's on its routes (issue 12), or Google's on the Gemini
routes (issue 30); the Responses API's routes (issue 13) have OpenAI's.

The POST routes declare their request-body schemas (chat, sessions, rewards, weights), so
schemathesis generates bodies that follow them and, in its negative mode, bodies that break
them. The proxy runs in process in front of the instant stand-in vLLM, so 200s are cheap;
what matters is the status and shape of every refusal. Bounded by `EXAMPLES` per operation.
Generating the bodies is the cost (over 90% of this file's CPU; the requests under 10%), so an
operation served at both `/v1/...` and `/s/{session_id}/v1/...` (one handler and one decoder)
is sent each generated case at both. The trajectory stream is not fuzzed: it answers SSE only
when asked with `Accept: text/event-stream`, which schemathesis does not send, and never ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from tests.inprocess import inprocess_proxy

EXAMPLES = 30
ANTHROPIC_EXAMPLES = 15
"""The Anthropic routes (four operations over one decoder, whose rules `tests/test_anthropic.py`
covers case by case) get fewer, to keep this test's time small; so do the Responses API's
(six operations over one decoder, `tests/test_responses.py`) and the Gemini API's (ten over
one decoder, `tests/test_gemini.py`)."""


@pytest.fixture(scope="module")
def proxy_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with inprocess_proxy(tmp_path_factory.mktemp("fuzz") / "p.db") as url:
        yield url


OPERATIONS = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/s/{session_id}/v1/chat/completions"),
    ("POST", "/v1/messages"),
    ("POST", "/s/{session_id}/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("POST", "/s/{session_id}/v1/messages/count_tokens"),
    ("POST", "/v1/responses"),
    ("POST", "/s/{session_id}/v1/responses"),
    ("GET", "/v1/responses/{response_id}"),
    ("GET", "/s/{session_id}/v1/responses/{response_id}"),
    ("DELETE", "/v1/responses/{response_id}"),
    ("DELETE", "/s/{session_id}/v1/responses/{response_id}"),
    ("POST", "/v1/sessions"),
    ("GET", "/v1/sessions/{session_id}"),
    ("POST", "/v1/sessions/{session_id}/close"),
    ("POST", "/v1/rewards"),
    ("GET", "/v1/trajectories"),
    ("POST", "/v1/admin/weights"),
    ("POST", "/v1/admin/weights/transfer"),
    ("POST", "/v1/admin/advantages"),
    ("GET", "/v1/models"),
    ("GET", "/s/{session_id}/v1/models"),
    ("POST", "/v1beta/models/{model}:generateContent"),
    ("POST", "/s/{session_id}/v1beta/models/{model}:generateContent"),
    ("POST", "/v1beta/models/{model}:streamGenerateContent"),
    ("POST", "/s/{session_id}/v1beta/models/{model}:streamGenerateContent"),
    ("POST", "/v1beta/models/{model}:countTokens"),
    ("POST", "/s/{session_id}/v1beta/models/{model}:countTokens"),
    ("GET", "/v1beta/models"),
    ("GET", "/s/{session_id}/v1beta/models"),
    ("GET", "/v1beta/models/{model}"),
    ("GET", "/s/{session_id}/v1beta/models/{model}"),
    ("GET", "/health"),
]
"""Every operation served, each fuzzed (a new route must be added here)."""
BREAKABLE = [(method, path) for method, path in OPERATIONS if method == "POST" or path == "/v1/trajectories"]
"""Operations with a body or a query, which the negative mode breaks (a path segment is any string)."""
SESSION = "/s/{session_id}"
"""The prefix that names a session: the operation under it is the unprefixed one's."""
FIRST = [(method, path) for method, path in OPERATIONS if not path.startswith(SESSION)]
"""What each test case names: the operation, fuzzed together with its twin under `SESSION`."""
CASES = [(*op, GenerationMode.POSITIVE) for op in FIRST] + [
    (*op, GenerationMode.NEGATIVE) for op in BREAKABLE if op in FIRST
]


GOOGLE_STATUSES = {
    "INVALID_ARGUMENT",
    "FAILED_PRECONDITION",
    "UNAUTHENTICATED",
    "PERMISSION_DENIED",
    "NOT_FOUND",
}


@pytest.fixture(scope="module")
def served_openapi(proxy_url: str) -> Any:
    return schemathesis.openapi.from_url(f"{proxy_url}/openapi.json")


def test_every_served_operation_is_fuzzed_and_every_post_declares_its_body(served_openapi):
    served = {(op.ok().method.upper(), op.ok().path) for op in served_openapi.get_all_operations()}
    assert served == set(OPERATIONS)
    for method, path in OPERATIONS:
        if method == "POST":
            body = served_openapi[path][method].definition.raw["requestBody"]
            schema = body["content"]["application/json"]["schema"]
            assert schema["type"] == "object" and schema["properties"], path
        raw = served_openapi[path][method].definition.raw
        breakable = "requestBody" in raw or any(p["in"] == "query" for p in raw.get("parameters", []))
        assert breakable == ((method, path) in BREAKABLE), (method, path)


def openai_error_body(response: schemathesis.Response, path: str) -> None:
    """The check: a 4xx carries `{"error": {"message", "type", "param", "code"}}`, or on the
    Anthropic routes Anthropic's `{"type": "error", "error": {"type", "message"}}`, or on the
    Gemini routes Google's `{"error": {"code", "message", "status"}}`."""
    if not 400 <= response.status_code < 500:
        return
    body = response.json()
    if "/v1beta/" in path:
        assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "status"}, body
        assert body["error"]["code"] == response.status_code and body["error"]["message"], body
        assert body["error"]["status"] in GOOGLE_STATUSES, body
        return
    if "/v1/messages" in path:
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        assert body["error"]["message"] and body["error"]["type"], body
        return
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] is None or isinstance(error["code"], str), error


def unprefixed(case: schemathesis.Case, operation: Any) -> schemathesis.Case:
    """`case` (of an operation under `SESSION`) for `operation`, the same one without it."""
    return operation.Case(
        path_parameters={k: v for k, v in case.path_parameters.items() if k != "session_id"},
        headers=case.headers,
        cookies=case.cookies,
        query=case.query,
        body=case.body,
        media_type=case.media_type,
    )


@pytest.mark.parametrize(("method", "path", "mode"), CASES, ids=str)
def test_no_input_gives_a_5xx_and_every_4xx_has_the_openai_error_body(served_openapi, method, path, mode):
    """Each case of `path`'s twin under `SESSION`, where it has one, is sent to both."""
    operation = served_openapi[path][method]
    twin = served_openapi[SESSION + path][method] if (method, SESSION + path) in OPERATIONS else None

    fewer = ("/v1/messages", "/v1/responses", "/v1beta/")
    examples = ANTHROPIC_EXAMPLES if any(part in path for part in fewer) else EXAMPLES

    def check(case: schemathesis.Case) -> None:
        response = case.call(timeout=60)
        assert response.status_code < 500, f"{case.method} {case.formatted_path}: {response.text[:500]}"
        openai_error_body(response, path)

    @given(case=(twin or operation).as_strategy(generation_mode=mode))
    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def fuzz(case: schemathesis.Case) -> None:
        check(case)
        if twin is not None:
            check(unprefixed(case, operation))

    fuzz()
