"""One small exception tree; each error knows its HTTP status and OpenAI error type.

    MoltError                     500 internal_error
    ├── BadRequest                400 invalid_request_error
    │   └── ContextLengthExceeded 400 invalid_request_error / context_length_exceeded
    ├── Unauthorized              401 authentication_error
    ├── Forbidden                 403 permission_error
    ├── NotFound                  404 not_found_error
    ├── Conflict                  409 conflict_error
    ├── PayloadTooLarge           413 invalid_request_error
    ├── UnsupportedMediaType      415 invalid_request_error
    ├── UpstreamError             502 upstream_error
    │   └── UpstreamUnavailable   503 service_unavailable
    └── StoreUnavailable          503 service_unavailable / store_unavailable

Raise these anywhere; `app.py` maps them to the OpenAI error body once, or to Anthropic's
(`{"type": "error", "error": {"type", "message"}}`) on the Anthropic routes: each error also
knows its Anthropic type (`anthropic_type`), and an unreachable vLLM answers 529
`overloaded_error` there, the status Anthropic's clients retry on. On the Gemini routes
(`/v1beta/...`) the body is Google's (`{"error": {"code", "message", "status"}}`), with each
error's Google status (`google_status`): INVALID_ARGUMENT (400; also a closed session,
FAILED_PRECONDITION, and a body too large or of the wrong type, which Google answers 400),
UNAUTHENTICATED, PERMISSION_DENIED, NOT_FOUND, INTERNAL (500), UNAVAILABLE (502, 503).
"""

from __future__ import annotations

from typing import Any


class MoltError(Exception):
    status = 500
    type = "internal_error"
    code: str | None = None
    anthropic_type = "api_error"
    anthropic_status: int | None = None
    """The status on the Anthropic routes, where it differs from `status`."""
    google_status = "INTERNAL"
    google_code: int | None = None
    """The status on the Gemini routes, where it differs from `status`."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class BadRequest(MoltError):
    status = 400
    type = "invalid_request_error"
    anthropic_type = "invalid_request_error"
    google_status = "INVALID_ARGUMENT"


class ContextLengthExceeded(BadRequest):
    code = "context_length_exceeded"


class Unauthorized(MoltError):
    status = 401
    type = "authentication_error"
    anthropic_type = "authentication_error"
    google_status = "UNAUTHENTICATED"
    code = "invalid_api_key"


class Forbidden(MoltError):
    status = 403
    type = "permission_error"
    anthropic_type = "permission_error"
    google_status = "PERMISSION_DENIED"


class NotFound(MoltError):
    status = 404
    type = "not_found_error"
    anthropic_type = "not_found_error"
    google_status = "NOT_FOUND"


class Conflict(MoltError):
    status = 409
    type = "conflict_error"
    anthropic_type = "invalid_request_error"
    google_status = "FAILED_PRECONDITION"
    google_code = 400
    anthropic_status = 400  # Anthropic's clients retry a 409; a closed session stays closed


class PayloadTooLarge(MoltError):
    status = 413
    type = "invalid_request_error"
    anthropic_type = "request_too_large"
    google_status = "INVALID_ARGUMENT"
    google_code = 400
    code = "request_too_large"


class UnsupportedMediaType(MoltError):
    status = 415
    type = "invalid_request_error"
    anthropic_type = "invalid_request_error"
    google_status = "INVALID_ARGUMENT"
    google_code = 400
    code = "unsupported_media_type"


class UpstreamError(MoltError):
    status = 502
    type = "upstream_error"
    google_status = "UNAVAILABLE"  # gRPC's reading of a 502; Google's clients retry it


class UpstreamUnavailable(UpstreamError):
    status = 503
    type = "service_unavailable"
    anthropic_type = "overloaded_error"
    anthropic_status = 529


class StoreUnavailable(MoltError):
    """A write to the store failed (`store_writer.py`): nothing of it was kept, in memory or on
    disk, so the request may be sent again."""

    status = 503
    type = "service_unavailable"
    code = "store_unavailable"
    google_status = "UNAVAILABLE"
    anthropic_type = "overloaded_error"
    anthropic_status = 529
