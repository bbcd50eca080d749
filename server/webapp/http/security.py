"""Who may change what, and from where: one ASGI middleware in front of every request.

In order, for every HTTP request:

1. **Host.** The `Host` header must name this dashboard: `localhost`, an IP address, the host
   `serve` listens on, or one of `ROLLOUT_LENS_ALLOWED_HOSTS` (`*`: any). Any other name is a
   421 — a DNS-rebinding page (evil.example resolving to 127.0.0.1) never reaches the API.
   A NUL byte in the path or query string is a 400 (no parameter has a use for one).
2. **Cross-site.** A state-changing request (POST, PUT, PATCH, DELETE) whose `Sec-Fetch-Site` is
   `cross-site` or `same-site`, or whose `Origin` is not this dashboard's own (scheme, host and
   port), is a 403.
3. **Token.** With `ROLLOUT_LENS_AUTH_TOKEN` set, state-changing requests (every request, with
   `ROLLOUT_LENS_AUTH_READ`) need one of its tokens: `Authorization: Bearer <token>`, or the
   session cookie the sign-in form (`/login`) sets: the random id of a server-side session
   (server/store/browser_sessions.py). Tokens are compared in constant time and never logged or echoed;
   wrong ones lock their client address out for a growing time, per token bucket, so that they
   cannot lock out a right one (server/webapp/http/ratelimit.py: 429).
4. **Body.** A state-changing request's body is read here, at most MAX_BODY_BYTES (else 413), and
   replayed to the app; a body of recorded steps or an export file (ROLLOUT_LENS_RECORD_MAX_MB)
   sent with a Bearer token is bounded here and read by its route, once it has a write slot
   (server/webapp/ingest.py: a busy dashboard answers 503 without reading it).
5. **CSRF.** A state-changing request from a browser (one that carries cookies, `Origin` or
   `Sec-Fetch-*` headers) and not authenticated by a Bearer header must carry the CSRF token of
   its double-submit cookie: in the form field `csrf_token` or the `X-CSRF-Token` header. Pages
   put the token in their forms and in `<meta name="csrf-token">` for scripts.

Every response gets the security headers (CSP without inline scripts, nosniff, referrer policy,
frame denial), an unexpected error's 500 too (answered here: Starlette's own error middleware
sits outside). Refusals are rendered by the one error handler (JSON for the API, a page
otherwise).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
from collections.abc import Iterable
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

from rollout_lens.server.core.config import Settings
from rollout_lens.server.store import browser_sessions
from rollout_lens.server.webapp.http.ratelimit import (
    FailureLimiter,
    client_address,
    too_many_message,
)
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

CSP = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",  # no inline scripts, no eval: page data is a JSON block
        "style-src 'self' 'unsafe-inline'",  # Plotly and Swagger UI set styles at run time
        "img-src 'self' data:",
        "font-src 'self' data:",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ]
)
SECURITY_HEADERS = {
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
    "x-frame-options": "DENY",
    "cross-origin-opener-policy": "same-origin",
}

SESSION_COOKIE = "rl_session"
CSRF_COOKIE = "rl_csrf"
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "x-csrf-token"
UNSAFE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})
PUBLIC_PREFIXES = ("/static/", "/login", "/logout")  # reachable without a token
MAX_BODY_BYTES = 1 << 20  # the largest body of a POST, PUT, PATCH or DELETE (the API and forms)
RECORD_PREFIX = "/api/record/"  # recording over HTTP: full or recording tokens
# bodies up to record_max_bytes: a batch of steps, an export file to import
RECORD_STEPS = re.compile(r"^/api/record/(runs/[^/]+/steps|import)$")
log = logging.getLogger(__name__)


# --- tokens ---------------------------------------------------------------------------------------


def matches_token(candidate: str, tokens: Iterable[str]) -> bool:
    """Whether `candidate` is one of `tokens`, comparing each in constant time (all of them)."""
    return find_token(candidate, tokens) is not None


def is_loopback_host(host: str) -> bool:
    """Whether serving on `host` is reachable from this machine only."""
    import ipaddress

    name = host.strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _split_host(host: str) -> tuple[str, str]:
    """`Example.org:8000` → (`example.org`, `8000`); `[::1]:8000` → (`[::1]`, `8000`); a bare
    IPv6 address (an ALLOWED_HOSTS entry) → (`[::1]`, ``)."""
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        return (host, "") if end < 0 else (host[: end + 1], host[end + 1 :].removeprefix(":"))
    if host.count(":") == 1:
        name, port = host.split(":")
        return name, port
    return (f"[{host}]", "") if ":" in host else (host, "")


def allowed_hosts(settings: Settings) -> frozenset[str]:
    """The names the Host header may carry with any port, and `name:port` for an entry that
    names its port (it matches that port only)."""
    entries = (_split_host(entry) for entry in settings.allowed_host_list)
    return LOOPBACK_NAMES | {f"{name}:{port}" if port else name for name, port in entries}


def safe_next(target: str) -> str:
    """A sign-in's `next`: a path on this site only (never `//other.example` or a full URL)."""
    if not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    return target


def _token_fingerprint(token: str) -> str:
    """What the dashboard keeps of a token (runs.recorded_by): a SHA-256, never the token."""
    return hashlib.sha256(b"rollout-lens-recorder:" + token.encode()).hexdigest()


def token_name(token: str) -> str:
    """How pages name a token (who cancelled a run): its fingerprint's first 8 hex digits, the
    same whether it came as a Bearer header or through a signed-in browser."""
    return f"token {_token_fingerprint(token)[:8]}"


def caller_name(request: Request) -> str | None:
    """Who sent `request`, as the Guard found it (`token 1a2b3c4d`, `a browser signed in with
    token 1a2b3c4d`); None on a dashboard without tokens."""
    name = request.scope.get("state", {}).get("caller")
    return str(name) if name else None


def find_token(candidate: str, tokens: Iterable[str]) -> str | None:
    """The token `candidate` equals, compared in constant time against every token."""
    found = None
    for token in tokens:
        if hmac.compare_digest(candidate.encode(), token.encode()):
            found = token
    return found


# --- the middleware -------------------------------------------------------------------------------


class Refused(Exception):
    """A request the guard turns away (rendered by the app's one error handler)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


class _SecuredSend:
    """The `send` of a guarded request: the security headers on every response, and the CSRF
    cookie of a browser that had none (`new_csrf`); `started` once the response has begun."""

    def __init__(self, scope: Scope, send: Send, *, new_csrf: str | None) -> None:
        self.scope, self.send, self.new_csrf = scope, send, new_csrf
        self.started = False

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            out = MutableHeaders(scope=message)
            for name, value in SECURITY_HEADERS.items():
                if name not in out:
                    out[name] = value
            sets_csrf = any(
                v.startswith(f"{CSRF_COOKIE}=") for v in out.getlist("set-cookie")
            )  # sign-in gives the browser a new one: it is not to be overwritten here
            if self.new_csrf and not sets_csrf and not self.scope["path"].startswith("/static/"):
                cookie = f"{CSRF_COOKIE}={self.new_csrf}; Path=/; HttpOnly; SameSite=Lax"
                secure = self.scope.get("scheme") == "https"
                out.append("set-cookie", cookie + ("; Secure" if secure else ""))
        await self.send(message)


class Guard:
    """The pure ASGI middleware described in the module docstring."""

    def __init__(
        self,
        app: ASGIApp,
        settings: Settings,
        session_factory: sessionmaker[Session],
        limiter: FailureLimiter,
    ) -> None:
        self.app = app
        self.tokens = settings.auth_token_list
        self.record_tokens = settings.record_token_list
        self.record_max_bytes = settings.record_max_bytes
        self.auth_read = settings.auth_read
        self.any_host = "*" in settings.allowed_host_list
        self.hosts = allowed_hosts(settings)
        self.session_factory = session_factory
        self.limiter = limiter

    def _signed_in(self, cookie: str) -> str | None:
        """Who signed in, if `cookie` is a live server-side session of a current token (a
        database read, run in a worker thread): the caller's name (caller_name)."""
        try:
            with self.session_factory() as session:
                found = browser_sessions.signed_in_with(session, cookie, self.tokens)
        except Exception:  # a database that cannot answer signs no one in (and is logged)
            log.exception("could not read the session of a signed-in browser")
            return None
        if found is None:
            return None
        token = next(
            (
                t
                for t in self.tokens
                if hmac.compare_digest(found, browser_sessions.token_digest(t))
            ),
            None,
        )
        return "a browser signed in" + (f" with {token_name(token)}" if token else "")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        cookies = Request(scope).cookies
        csrf, fresh_csrf = await self._browser_state(scope, cookies)
        send_with_headers = _SecuredSend(scope, send, new_csrf=csrf if fresh_csrf else None)
        try:
            receive = await self._check(scope, receive, headers, cookies, csrf, fresh_csrf)
        except Refused as refusal:
            response = await self._refusal(scope, refusal)
            await response(scope, receive, send_with_headers)
            return
        try:
            await self.app(scope, receive, send_with_headers)
        except Refused as refusal:  # a body past its limit, found as the route read it
            if send_with_headers.started:
                raise
            response = await self._refusal(scope, refusal)
            await response(scope, receive, send_with_headers)
        except Exception:
            if send_with_headers.started:  # a streamed body failed half-way: nothing more to send
                raise
            # Answered here, inside the Guard, so that a 500 carries the security headers too
            # (Starlette's own error middleware sits outside every middleware).
            log.exception("unexpected error answering %s %s", scope["method"], scope["path"])
            response = await _server_error(scope)
            await response(scope, receive, send_with_headers)

    async def _browser_state(self, scope: Scope, cookies: dict[str, str]) -> tuple[str, bool]:
        """The request's state as the pages read it: its CSRF token, whether tokens are on, and
        who signed in; returns the CSRF token and whether it is new (no cookie held one)."""
        state = scope.setdefault("state", {})
        csrf = cookies.get(CSRF_COOKIE, "")
        fresh_csrf = len(csrf) < 32
        if fresh_csrf:
            csrf = secrets.token_urlsafe(32)
        state["csrf_token"] = csrf
        state["auth_enabled"] = bool(self.tokens)
        session_cookie = cookies.get(SESSION_COOKIE, "")
        signed_in: str | None = None
        if self.tokens and session_cookie and not scope["path"].startswith("/static/"):
            signed_in = await run_in_threadpool(self._signed_in, session_cookie)
        state["signed_in"] = signed_in is not None
        if signed_in:
            state["caller"] = signed_in  # a Bearer token in the same request names it instead
        return csrf, fresh_csrf

    async def _check(
        self,
        scope: Scope,
        receive: Receive,
        headers: Headers,
        cookies: dict[str, str],
        csrf: str,
        fresh_csrf: bool,
    ) -> Receive:
        """Raise Refused, or return the `receive` to pass on (a form's body is read and replayed)."""
        name, port = _split_host(headers.get("host", ""))
        known = name in self.hosts or f"{name}:{port}" in self.hosts
        if not (self.any_host or known or _is_ip_literal(name)):
            raise Refused(
                421,
                "this dashboard is not served under that host name; add it to "
                "ROLLOUT_LENS_ALLOWED_HOSTS to reach it that way",
            )
        if _has_nul(scope):
            raise Refused(400, "refused: the request's path or query holds a NUL byte (%00)")
        method = scope["method"]
        unsafe = method in UNSAFE_METHODS
        if unsafe:
            self._check_same_origin(headers, scope.get("scheme", "http"))
        path: str = scope["path"]
        bearer = self._bearer(scope, headers)
        recording = path.startswith(RECORD_PREFIX)
        if recording and (self.tokens or self.record_tokens) and not bearer:
            raise Refused(
                401,
                "recording needs a token: send `Authorization: Bearer <token>` (an access token "
                "or a recording token)",
                {"www-authenticate": "Bearer"},
            )
        if unsafe and not recording and scope["state"].get("token_scope") == "record":
            raise Refused(403, "a recording token may record runs and read, nothing else")
        if self.tokens and (unsafe or self.auth_read) and not path.startswith(PUBLIC_PREFIXES):
            signed_in = scope["state"]["signed_in"]
            if not (bearer or signed_in):
                if method == "GET" and not path.startswith("/api/") and path != "/openapi.json":
                    raise Refused(303, "sign in", {"location": _login_url(scope)})
                raise Refused(
                    401,
                    "this dashboard needs a token: send `Authorization: Bearer <token>`, "
                    "or sign in at /login",
                    {"www-authenticate": "Bearer"},
                )
        if not unsafe:
            return receive
        limit = self.record_max_bytes if RECORD_STEPS.match(path) else MAX_BODY_BYTES
        csrf_checked = not bearer and _from_browser(headers)
        if limit != MAX_BODY_BYTES and not csrf_checked:
            # a body of steps or an export file: read by the route, after it has a write slot
            # (a busy dashboard answers 503 without reading it), within the same limit
            return _bounded_receive(receive, headers, limit=limit)
        body, receive = await _read_body(receive, headers, limit=limit)
        if csrf_checked:
            self._check_csrf(headers, body, csrf, fresh_csrf)
        return receive

    def _bearer(self, scope: Scope, headers: Headers) -> bool:
        """Whether the request carries a valid Bearer token: 401 for one that is wrong, 429 (not
        checked) while its address is locked out for sending wrong ones (server.webapp.http.ratelimit)."""
        scheme, _, value = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not (self.tokens or self.record_tokens):
            return False
        address, token = client_address(scope), value.strip()
        wait = self.limiter.retry_after(address, token)
        if wait:
            raise Refused(429, too_many_message(wait), {"retry-after": str(wait)})
        full = matches_token(token, self.tokens)
        recorder = matches_token(token, self.record_tokens)
        if not (full or recorder):
            self.limiter.failed(address, token)
            raise Refused(401, "the token is not valid", {"www-authenticate": "Bearer"})
        scope["state"]["token_scope"] = "full" if full else "record"
        # what a recorded run keeps of the token that created it (server.webapp.ingest)
        scope["state"]["token_fp"] = _token_fingerprint(token)
        scope["state"]["caller"] = token_name(token)
        return True

    @staticmethod
    def _check_same_origin(headers: Headers, scheme: str) -> None:
        site = headers.get("sec-fetch-site", "").lower()
        if site in ("cross-site", "same-site"):
            raise Refused(
                403,
                "refused: this request came from another web site (Sec-Fetch-Site: "
                f"{site}); change runs from the dashboard's own pages",
            )
        origin = headers.get("origin")
        if origin is not None:
            own = headers.get("host", "").lower()
            parts = urlsplit(origin)
            # The scheme too: http://host and https://host are two origins (a page served over
            # plain HTTP on the same name may not act on the TLS one, nor the other way round).
            if origin == "null" or parts.netloc.lower() != own or parts.scheme.lower() != scheme:
                raise Refused(
                    403,
                    "refused: this request came from another web site (its Origin is not this "
                    "dashboard's); change runs from the dashboard's own pages",
                )

    @staticmethod
    def _check_csrf(headers: Headers, body: bytes, csrf: str, fresh_csrf: bool) -> None:
        sent = headers.get(CSRF_HEADER, "")
        content_type = headers.get("content-type", "").split(";")[0].strip().lower()
        if not sent and content_type == "application/x-www-form-urlencoded":
            values = parse_qs(body.decode("utf-8", "replace")).get(CSRF_FIELD, [""])
            sent = values[0]
        if fresh_csrf or not sent or not hmac.compare_digest(sent.encode(), csrf.encode()):
            raise Refused(
                403,
                "refused: the form's security token is missing or out of date (CSRF check); "
                "reload the page and try again",
            )

    @staticmethod
    async def _refusal(scope: Scope, refusal: Refused) -> Response:
        if refusal.status == 303:
            return RedirectResponse(refusal.headers["location"], status_code=303)
        from rollout_lens.server.webapp.http.error_pages import handle_error

        response = await handle_error(
            Request(scope), HTTPException(refusal.status, refusal.message)
        )
        response.headers.update(refusal.headers)
        return response


async def _server_error(scope: Scope) -> Response:
    """The 500 of an unexpected error, rendered like every other error (HTML or JSON by
    `Accept`); its detail stays in the log."""
    from rollout_lens.server.webapp.http.error_pages import handle_error

    message = "the server hit an unexpected error; its log has the details"
    return await handle_error(Request(scope), HTTPException(500, message))


def _is_ip_literal(name: str) -> bool:
    """An address rather than a name: DNS rebinding needs a name, so any address may be used
    (a team server reached as http://10.0.0.5:8000/)."""
    import ipaddress

    try:
        ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return False
    return True


def _has_nul(scope: Scope) -> bool:
    """Whether the path or the query string holds a NUL byte, which no parameter has a use for
    (and PostgreSQL refuses in any string: it would be a 500 there)."""
    query: bytes = scope.get("query_string", b"")
    return "\x00" in scope["path"] or b"\x00" in query or b"%00" in query


def _from_browser(headers: Headers) -> bool:
    """Whether a request may come from a browser: it has cookies or browser-set headers. A
    script or the Python client sends none of them, and needs no CSRF token."""
    return any(h in headers for h in ("cookie", "origin", "sec-fetch-site", "sec-fetch-mode"))


def _login_url(scope: Scope) -> str:
    target = scope.get("root_path", "") + scope["path"]
    if scope.get("query_string"):
        target += "?" + scope["query_string"].decode("latin-1")
    return f"/login?next={quote(target, safe='')}"


def _too_large(size: str, limit: int = MAX_BODY_BYTES) -> Refused:
    """The 413 of a body past its limit, naming the limit."""
    what = "the API and forms" if limit == MAX_BODY_BYTES else "recorded steps"
    return Refused(
        413,
        f"the request body is larger than {limit:,} bytes ({size}), the limit for {what}; "
        "nothing was changed",
    )


async def _read_body(
    receive: Receive, headers: Headers, *, limit: int = MAX_BODY_BYTES
) -> tuple[bytes, Receive]:
    """The whole body of a state-changing request and a `receive` that replays it; a 413 past
    `limit` (MAX_BODY_BYTES), said by Content-Length before reading or found while reading."""
    declared = headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(f"{int(declared):,} declared", limit)
    chunks: list[bytes] = []
    size = 0
    more = True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large("more were sent", limit)
        chunks.append(chunk)
        more = message.get("more_body", False)
    body = b"".join(chunks)
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return body, replay


def _bounded_receive(receive: Receive, headers: Headers, *, limit: int) -> Receive:
    """`receive` that raises _read_body's 413 past `limit` (Content-Length checked now, the
    bytes as they come): the app reads the body when it chooses, the Guard still bounds it."""
    declared = headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(f"{int(declared):,} declared", limit)
    size = 0

    async def bounded() -> Message:
        nonlocal size
        message = await receive()
        if message["type"] == "http.request":
            size += len(message.get("body", b""))
            if size > limit:
                raise _too_large("more were sent", limit)
        return message

    return bounded


def csrf_cookie(*, secure: bool) -> dict[str, Any]:
    """Arguments of Response.set_cookie for a fresh CSRF token: sign-in replaces whatever CSRF
    cookie the browser had (one planted before sign-in, by a sibling subdomain say, must not
    outlive it)."""
    return {
        "key": CSRF_COOKIE,
        "value": secrets.token_urlsafe(32),
        "httponly": True,
        "samesite": "lax",
        "secure": secure,
        "path": "/",
    }


def session_cookie(value: str, *, max_age: int, secure: bool) -> dict[str, Any]:
    """Arguments of Response.set_cookie for a signed-in browser (`value`: its session's id)."""
    return {
        "key": SESSION_COOKIE,
        "value": value,
        "max_age": max_age,
        "httponly": True,
        "samesite": "strict",
        "secure": secure,
        "path": "/",
    }
