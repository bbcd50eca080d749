"""Notices a form action leaves for the page it redirects to: a signed, short-lived cookie.

Only the server writes one (signed with a key each app makes at start, itsdangerous), so no link
can put words of its own on a real page (the old `?notice=` could). Read once: the page that
shows it deletes the cookie.
"""

from __future__ import annotations

import secrets

from itsdangerous import BadData, URLSafeTimedSerializer
from starlette.requests import Request
from starlette.responses import Response

FLASH_COOKIE = "rl_notice"
MAX_AGE_S = 60  # a redirect is followed at once; a notice older than this is stale
MAX_CHARS = 500  # a notice is a sentence (an error message), not a page


def make_signer() -> URLSafeTimedSerializer:
    """A signer with a fresh random key (one per app: a restart only drops unread notices)."""
    return URLSafeTimedSerializer(secrets.token_bytes(32), salt="rollout-lens notice")


def _signer(request: Request) -> URLSafeTimedSerializer:
    signer: URLSafeTimedSerializer = request.app.state.flash_signer
    return signer


def leave(request: Request, response: Response, text: str, *, path: str) -> None:
    """Set `text` as the notice the page at `path` shows next."""
    value = _signer(request).dumps(text[:MAX_CHARS])
    secure = request.url.scheme == "https"
    response.set_cookie(
        FLASH_COOKIE,
        value,
        max_age=MAX_AGE_S,
        path=path,
        httponly=True,
        samesite="lax",
        secure=secure,
    )


def read(request: Request) -> str:
    """The notice left for this page: "" for none, and for a forged or stale one."""
    value = request.cookies.get(FLASH_COOKIE)
    if value is None:
        return ""
    try:
        text = _signer(request).loads(value, max_age=MAX_AGE_S)
    except BadData:
        return ""
    return text if isinstance(text, str) else ""


def forget(request: Request, response: Response, *, path: str) -> None:
    """Delete the notice once its page is shown: a reload does not show it again."""
    if FLASH_COOKIE in request.cookies:
        response.delete_cookie(FLASH_COOKIE, path=path, httponly=True, samesite="lax")
