"""Signing in and out with an access token (ROLLOUT_LENS_AUTH_TOKEN): a form that starts a
server-side session (server/store/browser_sessions.py) and sets its random id in an HttpOnly,
SameSite=Strict cookie; signing out ends it on the server, here or everywhere. The Guard
(server/webapp/http/security.py) checks the cookie on every request."""

from __future__ import annotations

from datetime import timedelta

from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from rollout_lens.server.store import browser_sessions
from rollout_lens.server.webapp.http import security
from rollout_lens.server.webapp.http.deps import SessionDep, SettingsDep, render
from rollout_lens.server.webapp.http.ratelimit import (
    FailureLimiter,
    client_address,
    too_many_message,
)

router = APIRouter(include_in_schema=False)


def _form(next: str, needed: bool, error: str = "") -> dict[str, object]:
    """login.html's context (`next` kept on this site)."""
    return {"next": security.safe_next(next), "error": error, "needed": needed}


@router.get("/login", name="login_page")
def login_page(request: Request, settings: SettingsDep, next: str = "/") -> HTMLResponse:
    return render(request, "login.html", _form(next, bool(settings.auth_token_list)))


@router.post("/login", name="login")
def login(
    request: Request,
    settings: SettingsDep,
    session: SessionDep,
    token: str = Form(""),
    next: str = Form("/"),
) -> Response:
    """A right token: a new session and its cookie, then back where the browser was going. A
    wrong one: the form again with a 401 (the token is never shown back); 429 while this address
    is locked out for sending wrong ones in this token's bucket (server.webapp.http.ratelimit)."""
    needed = bool(settings.auth_token_list)
    limiter: FailureLimiter = request.app.state.token_limiter
    address = client_address(request.scope)
    wait = limiter.retry_after(address, token)
    if wait:
        context = _form(next, needed, too_many_message(wait))
        refused = render(request, "login.html", context, status_code=429)
        refused.headers["retry-after"] = str(wait)
        return refused
    found = security.find_token(token, settings.auth_token_list)
    if found is None:
        limiter.failed(address, token)
        context = _form(next, needed, "That token is not valid.")
        return render(request, "login.html", context, status_code=401)
    lifetime = timedelta(hours=settings.session_hours)
    cookie = browser_sessions.start(session, token=found, lifetime=lifetime)
    session.commit()
    response = RedirectResponse(security.safe_next(next), status_code=303)
    secure = request.url.scheme == "https"
    response.set_cookie(
        **security.session_cookie(cookie, max_age=int(lifetime.total_seconds()), secure=secure)
    )
    response.set_cookie(**security.csrf_cookie(secure=secure))
    return response


@router.post("/logout", name="logout")
def logout(request: Request, session: SessionDep, everywhere: str = Form("")) -> RedirectResponse:
    """End this browser's session on the server (with `everywhere`: every session signed in
    with the same token), and delete its cookie."""
    cookie = request.cookies.get(security.SESSION_COOKIE, "")
    if cookie:
        if everywhere:
            browser_sessions.end_everywhere(session, cookie)
        else:
            browser_sessions.end(session, cookie)
        session.commit()
    response = RedirectResponse("/", status_code=303)
    response.delete_cookie(security.SESSION_COOKIE, path="/", httponly=True, samesite="strict")
    return response
