"""Signing in and out with an access token (ROLLOUT_LENS_AUTH_TOKEN): a form that sets an
HttpOnly, SameSite=Strict session cookie. The Guard (server/security.py) checks what it sets."""

from __future__ import annotations

from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from rollout_lens.server import security
from rollout_lens.server.deps import SettingsDep, render

router = APIRouter(include_in_schema=False)


@router.get("/login", name="login_page")
def login_page(request: Request, settings: SettingsDep, next: str = "/") -> HTMLResponse:
    context = {
        "next": security.safe_next(next),
        "error": "",
        "needed": bool(settings.auth_token_list),
    }
    return render(request, "login.html", context)


@router.post("/login", name="login")
def login(
    request: Request,
    settings: SettingsDep,
    token: str = Form(""),
    next: str = Form("/"),
) -> Response:
    """A right token: the session cookie, then back where the browser was going. A wrong one: the
    form again with a 401 (the token is never shown back)."""
    found = security.find_token(token, settings.auth_token_list)
    if found is None:
        context = {
            "next": security.safe_next(next),
            "error": "That token is not valid.",
            "needed": bool(settings.auth_token_list),
        }
        return render(request, "login.html", context, status_code=401)
    response = RedirectResponse(security.safe_next(next), status_code=303)
    response.set_cookie(**security.session_cookie(found, secure=request.url.scheme == "https"))
    return response


@router.post("/logout", name="logout")
def logout() -> RedirectResponse:
    response = RedirectResponse("/", status_code=303)
    response.delete_cookie(security.SESSION_COOKIE, path="/", httponly=True, samesite="strict")
    return response
