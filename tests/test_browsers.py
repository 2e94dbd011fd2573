"""A web page in the operator's browser cannot write to or read from an open proxy (issue 26,
item 1; `molt_proxy/browsers.py`): foreign `Origin`s and `Host`s are refused, and so are bodies
that are not JSON, while CLI clients, which send no `Origin`, work as before.

The real app in process, open mode (no key, loopback), in front of the stand-in vLLM
(`tests/inprocess.py`); the requests are the ones a browser sends for a cross-site `fetch`
or form post, and for a DNS-rebinding page.
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

import httpx
import openai
import pytest

from molt_proxy.browsers import BrowserPolicy
from tests.inprocess import chat_body, inprocess_proxy, post
from tests.test_viewer import chromium

CHAT = "/v1/chat/completions"
EVIL = "http://evil.example"
TEXT_PLAIN = {"content-type": "text/plain;charset=UTF-8"}


def refused_origin(origin: str) -> dict[str, object]:
    message = (
        f"requests from the web page at {origin!r} are refused: give its origin to"
        " `serve --allowed-origins` to let it call the proxy"
    )
    return {
        "error": {"message": message, "type": "permission_error", "param": None, "code": "origin_not_allowed"}
    }


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    db = tmp_path_factory.mktemp("browsers") / "store.db"
    with inprocess_proxy(
        db, allowed_origins=["https://notebook.example:8888"], allowed_hosts=["proxy.lan"]
    ) as url:
        yield url


def raw(proxy: str, method: str, path: str, headers: dict[str, str], body: bytes = b"") -> httpx.Response:
    """A request with exactly these headers (httpx adds only Host, unless one is given)."""
    return httpx.request(method, proxy + path, headers=headers, content=body, timeout=30)


def test_a_cross_site_text_plain_post_neither_chats_nor_rewards(proxy):
    body = httpx.Request("POST", "http://x", json=chat_body("from a web page")).content
    chat = raw(proxy, "POST", f"/s/from-web{CHAT}", {**TEXT_PLAIN, "origin": EVIL}, body)
    assert (chat.status_code, chat.json()) == (403, refused_origin(EVIL))
    assert httpx.get(f"{proxy}/v1/sessions/from-web").status_code == 404  # nothing recorded
    reward = raw(
        proxy, "POST", "/v1/rewards", {**TEXT_PLAIN, "origin": EVIL}, b'{"session_id":"s","reward":1}'
    )
    assert (reward.status_code, reward.json()) == (403, refused_origin(EVIL))
    # JSON from a foreign page (after a CORS preflight the proxy never answers) alike.
    as_json = raw(proxy, "POST", CHAT, {"content-type": "application/json", "origin": EVIL}, body)
    assert as_json.status_code == 403
    sessions = raw(proxy, "POST", "/v1/sessions", {"origin": "null"})  # a sandboxed frame or a file
    assert (sessions.status_code, sessions.json()) == (403, refused_origin("null"))
    assert httpx.get(f"{proxy}/v1/sessions/none", headers={"origin": EVIL}).status_code == 403


def test_a_body_that_is_not_json_is_415_even_without_an_origin(proxy):
    body = httpx.Request("POST", "http://x", json=chat_body()).content
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        refused = raw(proxy, "POST", CHAT, {"content-type": kind}, body)
        assert refused.status_code == 415, kind
        assert refused.json()["error"] == {
            "message": f"the request body must be JSON (Content-Type: application/json), not {kind!r}",
            "type": "invalid_request_error",
            "param": None,
            "code": "unsupported_media_type",
        }
    # No content type at all is read as JSON (scripts send that).
    missing = raw(proxy, "POST", "/v1/rewards", {}, b'{"session_id": "none", "reward": 1}')
    assert missing.status_code == 404
    # Anthropic's routes answer in Anthropic's shape.
    anthropic = raw(proxy, "POST", "/v1/messages", {"content-type": "text/plain"}, b"{}")
    assert anthropic.status_code == 415
    assert (
        anthropic.json()["type"] == "error" and anthropic.json()["error"]["type"] == "invalid_request_error"
    )
    # A POST without a body needs no content type (`POST /v1/sessions` creates one).
    assert raw(proxy, "POST", "/v1/sessions", {}).status_code == 201
    for kind in ("application/json; charset=utf-8", "application/vnd.api+json"):
        assert raw(proxy, "POST", "/v1/sessions", {"content-type": kind}, b"{}").status_code == 201


def test_a_dns_rebinding_page_cannot_read_trajectories(proxy):
    port = urlsplit(proxy).port
    for host in (f"evil.example:{port}", "evil.example", "127.0.0.1.evil.example"):
        read = httpx.get(f"{proxy}/v1/trajectories", headers={"host": host})
        assert read.status_code == 403, host
        assert read.json()["error"]["code"] == "host_not_allowed"
        assert read.json()["error"]["message"] == (
            f"Host {host!r} is not this proxy's address: give it to `serve --allowed-hosts`"
            " to reach the proxy by that name"
        )
    viewer = httpx.get(f"{proxy}/ui/api/trajectories", headers={"host": "evil.example"})
    assert viewer.status_code == 403
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "10.1.2.3", f"proxy.lan:{port}"):
        assert httpx.get(f"{proxy}/v1/trajectories", headers={"host": host}).status_code == 200, host


def test_loopback_own_and_allowed_origins_may_call(proxy):
    port = urlsplit(proxy).port
    allowed = (
        f"http://127.0.0.1:{port}",  # the viewer at /ui, same origin
        "http://localhost:3000",
        "http://[::1]:5173",
        "https://notebook.example:8888",
    )
    for origin in allowed:
        created = raw(
            proxy, "POST", "/v1/sessions", {"origin": origin, "content-type": "application/json"}, b"{}"
        )
        assert created.status_code == 201, origin
    refused = ("https://notebook.example", "http://notebook.example:8888", "https://localhost.evil.example")
    for origin in refused:
        assert raw(proxy, "POST", "/v1/sessions", {"origin": origin}).status_code == 403, origin


def test_cli_clients_send_no_origin_and_work_unchanged(proxy):
    client = openai.OpenAI(base_url=f"{proxy}/v1", api_key="unused")
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "cli"}])
    assert reply.choices[0].message.content == "Hello there."
    rewarded = post(proxy, "/v1/rewards", json={"completion_id": reply.id, "reward": 1.0})
    assert rewarded.status_code == 200, rewarded.text


def test_a_proxy_bound_to_all_interfaces_checks_host_only_against_allowed_hosts():
    exposed = BrowserPolicy("0.0.0.0", [], [])
    assert exposed.refusal("GET", {b"host": b"gpu-node-7:8000"}) is None
    named = BrowserPolicy("0.0.0.0", [], ["gpu-node-7"])
    assert named.refusal("GET", {b"host": b"gpu-node-7:8000"}) is None
    assert named.refusal("GET", {b"host": b"evil.example:8000"}).code == "host_not_allowed"
    # The Origin and content-type rules hold whatever the bound address.
    assert exposed.refusal("POST", {b"host": b"h", b"origin": EVIL.encode()}).code == "origin_not_allowed"


# -- a real browser --------------------------------------------------------------------------

ATTACK = """<!doctype html><title>a page on another site</title><script>
const turn = (text) => JSON.stringify({{model: "tiny", messages: [{{role: "user", content: text}}]}});
const post = (session, init) => fetch("{proxy}/s/" + session + "/v1/chat/completions",
                                      {{method: "POST", mode: "no-cors", ...init}});
Promise.all([
  post("as-text", {{headers: {{"content-type": "text/plain"}}, body: turn("written by a web page")}}),
  post("as-blob", {{body: new Blob([turn("written by a web page")])}}),  // no Content-Type at all
]).then(() => document.title = "sent", () => document.title = "failed");
</script>"""


@contextmanager
def attacker_site(proxy: str) -> Iterator[int]:
    """A web server on loopback serving the attacking page; yields its port. Chromium reaches it
    as `http://evil.example:<port>` (`--host-resolver-rules`), a foreign origin."""
    page = ATTACK.format(proxy=proxy).encode()

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("content-type", "text/html")
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()


def test_a_page_on_another_site_in_a_real_browser_writes_nothing(proxy, tmp_path):
    """Debian's Chromium loads a page of `evil.example` that posts two chat turns to the proxy
    as simple requests (`no-cors`, no preflight): one `text/plain`, one a `Blob` without a
    content type. Both are refused for their `Origin`. With every origin allowed, the browser's
    requests arrive: the `text/plain` one is still refused (415), the other writes its turn."""
    rules = "--host-resolver-rules=MAP evil.example 127.0.0.1"
    with attacker_site(proxy) as port:
        assert "<title>sent</title>" in chromium(f"http://evil.example:{port}/", rules, "--dump-dom")
    for session in ("as-text", "as-blob"):
        assert httpx.get(f"{proxy}/v1/sessions/{session}").status_code == 404
    with (
        inprocess_proxy(tmp_path / "store.db", allowed_origins=["*"]) as allowing,
        attacker_site(allowing) as port,
    ):
        chromium(f"http://evil.example:{port}/", rules, "--dump-dom")
        assert httpx.get(f"{allowing}/v1/sessions/as-text").status_code == 404
        written = httpx.get(f"{allowing}/v1/sessions/as-blob")
        assert written.status_code == 200 and len(written.json()["segments"][0]["turns"]) == 1


def test_a_dns_rebinding_page_in_a_real_browser_reads_nothing(proxy):
    """The attacker's name resolves to 127.0.0.1 (`--host-resolver-rules`), so the browser
    loads the proxy's own pages as `evil.example`: same-origin to the page, refused by Host."""
    port = urlsplit(proxy).port
    rules = "--host-resolver-rules=MAP evil.example 127.0.0.1"
    dom = chromium(f"http://evil.example:{port}/v1/trajectories", rules, "--dump-dom")
    assert "host_not_allowed" in dom and '"data"' not in dom
    assert '"data"' in chromium(f"http://127.0.0.1:{port}/v1/trajectories", "--dump-dom")
