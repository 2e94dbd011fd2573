"""What a web browser may ask of the proxy: the guard against cross-site writes and DNS
rebinding, as Jupyter and Ollama guard their loopback servers.

In the open mode (no admin key, loopback) every request is trusted, and the operator's own
browser can reach loopback: any page it has open could POST turns and rewards (a "simple"
cross-site request, `Content-Type: text/plain`, needs no CORS preflight), and a page whose
name an attacker's DNS points at 127.0.0.1 can read `/v1/trajectories` as same-origin. So,
before any route runs and whatever the mode:

- a request whose `Origin` is not an allowed one is refused (403). Browsers send `Origin` on
  every cross-origin request and on every POST; CLI clients and SDKs send none, so they
  are unaffected. Allowed: the proxy's own origin (the viewer at `/ui` calls the API),
  loopback origins (`http://localhost:*`, `http://127.0.0.1:*`, `http://[::1]:*`) and
  `--allowed-origins` (`*`: any);
- a request whose `Host` names neither the address the proxy is bound to, an IP address,
  `localhost` nor an `--allowed-hosts` name is refused (403). A rebinding page's requests
  carry its own domain name as `Host`. A proxy bound to a non-loopback address was exposed
  on purpose (its keys guard it) and checks `Host` only against `--allowed-hosts`, if given;
- a POST whose body says it is not JSON (a `Content-Type` other than `application/json` or
  `application/*+json`) is refused (415): every body the proxy takes is JSON, and a
  cross-site form or `text/plain` post is how a page writes without a preflight. A body with
  no `Content-Type` at all is read as JSON (scripts send such bodies; a page can too, with a
  `Blob`, but its browser then sends its `Origin`).

This module does not own keys (`auth.py`) nor the error bodies (`app.py`).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable, Iterable
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from molt_proxy.errors import Forbidden, MoltError, UnsupportedMediaType


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, IPv6 with or without brackets) is this machine."""
    host = host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def _hostname(netloc: str) -> str:
    """`netloc` without its port: `example.com:8000` → `example.com`, `[::1]:80` → `::1`."""
    return (urlsplit(f"//{netloc}").hostname or "").lower()


class BrowserPolicy:
    """Which `Origin`s, `Host`s and content types a request may carry (the module docstring)."""

    def __init__(self, bound_host: str, allowed_origins: Iterable[str], allowed_hosts: Iterable[str]):
        self.allowed_origins = frozenset(origin.rstrip("/").lower() for origin in allowed_origins)
        self.allowed_hosts = frozenset(host.lower() for host in allowed_hosts)
        bound = bound_host.strip("[]").lower()
        self.check_host = is_loopback(bound) or bool(self.allowed_hosts)
        self.bound = bound

    def refusal(self, method: str, headers: dict[bytes, bytes]) -> MoltError | None:
        """Why the request is refused, or None where it may go on."""
        host = headers.get(b"host", b"").decode("latin-1")
        if not self._host_allowed(_hostname(host)):
            return Forbidden(
                f"Host {host[:100]!r} is not this proxy's address: give it to `serve --allowed-hosts`"
                " to reach the proxy by that name",
                code="host_not_allowed",
            )
        origin = headers.get(b"origin")
        if origin is not None and not self._origin_allowed(origin.decode("latin-1"), host):
            return Forbidden(
                f"requests from the web page at {origin.decode('latin-1')[:100]!r} are refused: give its"
                " origin to `serve --allowed-origins` to let it call the proxy",
                code="origin_not_allowed",
            )
        content_type = headers.get(b"content-type")
        if (
            method == "POST"
            and content_type is not None
            and _has_body(headers)
            and not _is_json(content_type)
        ):
            kind = content_type.decode("latin-1")[:100]
            return UnsupportedMediaType(
                f"the request body must be JSON (Content-Type: application/json), not {kind!r}"
            )
        return None

    def _host_allowed(self, host: str) -> bool:
        if not self.check_host or "*" in self.allowed_hosts:
            return True
        # No Host at all (HTTP/1.0) is no browser's request.
        named = host in self.allowed_hosts or host == self.bound
        return not host or named or is_loopback(host) or _is_ip(host)

    def _origin_allowed(self, origin: str, host: str) -> bool:
        origin = origin.rstrip("/").lower()
        if "*" in self.allowed_origins or origin in self.allowed_origins:
            return True
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            return False  # `null` (a sandboxed frame, a file), or anything else odd
        return parts.netloc == host.lower() or is_loopback(parts.hostname or "")


def _has_body(headers: dict[bytes, bytes]) -> bool:
    length = headers.get(b"content-length")
    return b"transfer-encoding" in headers or (length is not None and length.strip() not in (b"", b"0"))


def _is_json(content_type: bytes) -> bool:
    kind = content_type.split(b";", 1)[0].strip().lower()
    return kind == b"application/json" or (kind.startswith(b"application/") and kind.endswith(b"+json"))


class BrowserGuard:
    """ASGI middleware: `policy`'s refusals answered by `refuse(send, error, path)` before the
    app sees the request."""

    def __init__(
        self,
        app: ASGIApp,
        policy: BrowserPolicy,
        refuse: Callable[[Send, MoltError, str], Awaitable[None]],
    ):
        self.app, self.policy, self.refuse = app, policy, refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            error = self.policy.refusal(scope["method"], dict(scope["headers"]))
            if error is not None:
                return await self.refuse(send, error, scope["path"])
        await self.app(scope, receive, send)
