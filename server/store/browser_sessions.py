"""Signed-in browsers, kept server-side: a random cookie value per sign-in, stored hashed, with
an expiry; signing out deletes it, and "sign out everywhere" every session of the same token.

The cookie is only a random id: it says nothing about the token, is worth nothing on another
server (even one with the same token) and nothing after sign-out or expiry. A session counts only
while the token it signed in with is still one of ROLLOUT_LENS_AUTH_TOKEN's.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable
from datetime import timedelta

from rollout_lens.server.store.models import BrowserSessionRow, utcnow
from sqlalchemy import delete, select
from sqlalchemy.orm import Session

_DIGEST_KEY = b"rollout-lens session v2"


def _id_hash(cookie: str) -> str:
    """What the table keeps of a cookie: its SHA-256 (the value is 256 random bits)."""
    return hashlib.sha256(cookie.encode()).hexdigest()


def token_digest(token: str) -> str:
    """Which token a session signed in with, without the token: an HMAC keyed by it."""
    return hmac.new(token.encode(), _DIGEST_KEY, hashlib.sha256).hexdigest()


def start(session: Session, *, token: str, lifetime: timedelta) -> str:
    """A new session for `token`; returns the cookie's value. Expired sessions are deleted on
    the way (the table holds live ones and a few stale ones at most)."""
    now = utcnow()
    session.execute(delete(BrowserSessionRow).where(BrowserSessionRow.expires_at <= now))
    cookie = secrets.token_urlsafe(32)
    session.add(
        BrowserSessionRow(
            id_hash=_id_hash(cookie),
            token_digest=token_digest(token),
            created_at=now,
            expires_at=now + lifetime,
        )
    )
    return cookie


def signed_in_with(session: Session, cookie: str, tokens: Iterable[str]) -> str | None:
    """The digest of the token a live session signed in with, if `cookie` is one and that token
    is still valid; None otherwise."""
    if not cookie:
        return None
    digest = session.scalar(
        select(BrowserSessionRow.token_digest).where(
            BrowserSessionRow.id_hash == _id_hash(cookie), BrowserSessionRow.expires_at > utcnow()
        )
    )
    if digest is None:
        return None
    valid = False
    for token in tokens:  # constant time against every token
        valid |= hmac.compare_digest(digest, token_digest(token))
    return digest if valid else None


def end(session: Session, cookie: str) -> None:
    """Sign this browser out: its session is deleted."""
    session.execute(delete(BrowserSessionRow).where(BrowserSessionRow.id_hash == _id_hash(cookie)))


def end_everywhere(session: Session, cookie: str) -> int:
    """Sign out every browser signed in with the same token as this one; how many were."""
    digest = session.scalar(
        select(BrowserSessionRow.token_digest).where(BrowserSessionRow.id_hash == _id_hash(cookie))
    )
    if digest is None:
        return 0
    result = session.execute(
        delete(BrowserSessionRow).where(BrowserSessionRow.token_digest == digest)
    )
    return int(result.rowcount or 0)  # type: ignore[attr-defined]
