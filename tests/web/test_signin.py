"""Signed-in browsers and token guessing: server-side sessions that sign-out ends (here, and
everywhere), that expire and that no other server accepts; wrong tokens limited per client
address and token bucket with a growing lockout that others' wrong tokens cannot aim at a right
one, nothing sleeping; a CSRF cookie replaced at sign-in; tokens too short refused at start."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from rollout_lens.server.core.config import Settings
from rollout_lens.server.store import browser_sessions
from rollout_lens.server.store.db import make_engine, make_session_factory
from rollout_lens.server.store.migrate import upgrade
from rollout_lens.server.store.models import BrowserSessionRow, RunRow
from rollout_lens.server.webapp.http.ratelimit import FREE_FAILURES, FailureLimiter
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from tests.web_support import browser_like, client_for

TOKEN = "team-token-0123456789"
OTHER = "other-token-9876543210"


def _runs(factory: sessionmaker[Session]) -> int:
    with factory() as session:
        return int(session.scalar(select(func.count()).select_from(RunRow)) or 0)


def _sign_in(client: TestClient, token: str = TOKEN) -> str:
    response = client.post("/login", data={"token": token}, follow_redirects=False)
    assert response.status_code == 303, response.text[:300]
    return str(client.cookies["rl_session"])


def _copy(client: TestClient, cookie: str, address: str = "testclient") -> TestClient:
    """Another browser (or an attacker) holding a copy of the session cookie."""
    copy = browser_like(TestClient(client.app, base_url="http://127.0.0.1", client=(address, 1)))
    copy.cookies.set("rl_session", cookie)
    return copy


def _launch(client: TestClient) -> int:
    return client.post("/api/runs", json={"steps": 1}).status_code


@pytest.fixture
def guarded(session_factory: sessionmaker[Session], tmp_path: Path) -> TestClient:
    return client_for(session_factory, data_dir=tmp_path, auth_token=f"{TOKEN},{OTHER}")


def test_sign_out_ends_the_session_on_the_server(
    guarded: TestClient, session_factory: sessionmaker[Session]
) -> None:
    cookie = _sign_in(guarded)
    assert TOKEN not in cookie and browser_sessions.token_digest(TOKEN) != cookie
    with session_factory() as session:
        (stored,) = session.scalars(select(BrowserSessionRow)).all()
        assert stored.id_hash != cookie  # the table holds a hash: a reader cannot replay it
    thief = _copy(guarded, cookie)
    assert _launch(thief) == 201
    assert guarded.post("/logout", follow_redirects=False).status_code == 303
    assert _launch(thief) == 401  # the copy is refused: the session is gone
    assert _launch(guarded) == 401
    with session_factory() as session:
        assert session.scalar(select(func.count()).select_from(BrowserSessionRow)) == 0
    assert _runs(session_factory) == 1


def test_a_csrf_cookie_planted_before_sign_in_is_replaced(guarded: TestClient) -> None:
    """Someone who set the browser's CSRF cookie before sign-in (a sibling subdomain, a shared
    machine) knows it: sign-in gives a new one, and the planted one no longer passes."""
    planted = "planted-csrf-token-0123456789abcdefghijklmnop"
    browser = TestClient(guarded.app, base_url="http://127.0.0.1")
    browser.cookies.set("rl_csrf", planted, domain="127.0.0.1", path="/")
    origin = {"Origin": "http://127.0.0.1"}
    form = {"token": TOKEN, "csrf_token": planted}  # the login page carried the planted one
    signed = browser.post("/login", data=form, headers=origin, follow_redirects=False)
    assert signed.status_code == 303
    fresh = signed.cookies.get("rl_csrf")
    assert fresh and fresh != planted and len(fresh) >= 32
    assert "HttpOnly" in ";".join(signed.headers.get_list("set-cookie"))
    launch = {"steps": 1}
    stale = browser.post("/api/runs", json=launch, headers=origin | {"X-CSRF-Token": planted})
    assert stale.status_code == 403 and "CSRF" in stale.json()["detail"]
    ok = browser.post("/api/runs", json=launch, headers=origin | {"X-CSRF-Token": fresh})
    assert ok.status_code == 201


def test_a_cookie_is_worth_nothing_on_another_server_with_the_same_token(
    guarded: TestClient, tmp_path: Path
) -> None:
    cookie = _sign_in(guarded)
    url = f"sqlite:///{tmp_path / 'other-server.db'}"
    engine = make_engine(url)
    upgrade(engine)
    other = client_for(make_session_factory(engine), data_dir=tmp_path, auth_token=TOKEN)
    other.cookies.set("rl_session", cookie)
    assert _launch(other) == 401
    assert "logout-button" not in other.get("/").text
    engine.dispose()


def test_sign_out_everywhere_ends_every_session_of_that_token(
    guarded: TestClient, session_factory: sessionmaker[Session]
) -> None:
    laptop = _sign_in(guarded)
    phone = _copy(guarded, "", address="10.0.0.2")
    phone.cookies.delete("rl_session")
    phone_cookie = _sign_in(phone)
    colleague = _copy(guarded, "", address="10.0.0.3")
    colleague.cookies.delete("rl_session")
    _sign_in(colleague, OTHER)
    assert laptop != phone_cookie
    page = guarded.get("/").text
    assert 'id="logout-everywhere-button"' in page
    guarded.post("/logout", data={"everywhere": "1"}, follow_redirects=False)
    assert _launch(phone) == 401 and _launch(guarded) == 401
    assert _launch(colleague) == 201  # signed in with another token


def test_sessions_expire_and_end_when_the_token_changes(
    session_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    short = client_for(session_factory, data_dir=tmp_path, auth_token=TOKEN, session_hours=1 / 3600)
    response = short.post("/login", data={"token": TOKEN}, follow_redirects=False)
    assert "Max-Age=1" in response.headers["set-cookie"]
    assert _launch(short) == 201
    time.sleep(1.2)
    assert _launch(short) == 401  # expired on the server, whatever the browser keeps
    kept = client_for(session_factory, data_dir=tmp_path, auth_token=TOKEN)
    cookie = _sign_in(kept)
    assert _launch(kept) == 201
    rotated = client_for(session_factory, data_dir=tmp_path, auth_token=OTHER)
    rotated.cookies.set("rl_session", cookie)
    assert _launch(rotated) == 401  # its token is no longer one of the server's


# --- guessing tokens --------------------------------------------------------------------------


class _Clock:
    """The limiter's clock, moved by hand: a lockout's end is reached without waiting."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _no_sleeping(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing may sleep while tokens are checked: a locked-out guess is answered at once."""

    def forbidden(*_: object) -> None:
        raise AssertionError("a token check slept")

    monkeypatch.setattr(time, "sleep", forbidden)
    monkeypatch.setattr(asyncio, "sleep", forbidden)


def _limiter(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> tuple[FailureLimiter, _Clock]:
    limiter: FailureLimiter = client.app.state.token_limiter  # type: ignore[attr-defined]
    clock = _Clock()
    limiter.clock = clock
    _no_sleeping(monkeypatch)
    return limiter, clock


def _same_bucket(limiter: FailureLimiter, token: str, n: int, *, avoid: str = TOKEN) -> list[str]:
    """`n` wrong tokens in `token`'s bucket (a guesser's, found by trying many), none in
    `avoid`'s unless it shares that bucket."""
    wanted = limiter.bucket(token)
    found = [
        f"guess-{i:016d}" for i in range(200_000) if limiter.bucket(f"guess-{i:016d}") == wanted
    ]
    assert len(found) >= n and (limiter.bucket(avoid) != wanted or token == avoid)
    return found[:n]


def _wrong_bucket_token(limiter: FailureLimiter) -> str:
    """A wrong token whose bucket is not the right token's."""
    return next(
        t
        for t in (f"wrong-{i:016d}" for i in range(1000))
        if limiter.bucket(t) != limiter.bucket(TOKEN)
    )


def test_wrong_sign_ins_lock_their_bucket_out_for_growing_times(
    guarded: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a few checked guesses (401) in one bucket, that bucket of the address is locked
    out: answered 429 with Retry-After, unchecked and at once, for a wait that doubles with each
    further wrong token. Nothing sleeps: the clock is moved by hand."""
    limiter, clock = _limiter(guarded, monkeypatch)
    guesses = _same_bucket(limiter, _wrong_bucket_token(limiter), 400)
    wrong = [guarded.post("/login", data={"token": g}).status_code for g in guesses[:6]]
    assert wrong == [401] * (FREE_FAILURES + 1)
    locked = guarded.post("/login", data={"token": guesses[6]})
    assert locked.status_code == 429 and locked.headers["retry-after"] == "1"
    assert "too many wrong tokens from this address: try again in 1 s" in locked.text
    clock.now += 1.1
    assert guarded.post("/login", data={"token": guesses[7]}).status_code == 401
    doubled = guarded.post("/login", data={"token": guesses[8]})
    assert doubled.status_code == 429 and doubled.headers["retry-after"] == "2"
    burst = [guarded.post("/login", data={"token": g}).status_code for g in guesses[9:309]]
    assert burst == [429] * 300  # the clock did not move: every one unchecked
    clock.now += 2.1
    assert guarded.post("/login", data={"token": guesses[309]}).status_code == 401
    assert guarded.post("/login", data={"token": guesses[310]}).headers["retry-after"] == "4"


def test_wrong_tokens_from_the_users_address_do_not_lock_out_the_right_one(
    guarded: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Someone sharing the user's address (loopback, NAT, a proxy) sends wrong tokens: the
    right token still signs in (303, not 429), however many they send, unless theirs fall in
    its own bucket, which no one can aim at."""
    limiter, _ = _limiter(guarded, monkeypatch)
    for i in range(300):  # a guesser spraying tokens: every bucket it hits is slowed
        guarded.post("/login", data={"token": f"spray-{i:016d}"})
    for guess in _same_bucket(limiter, _wrong_bucket_token(limiter), 8):
        guarded.post("/login", data={"token": guess})  # a bucket locked for sure
    signed_in = guarded.post("/login", data={"token": TOKEN}, follow_redirects=False)
    assert signed_in.status_code == 303
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    assert guarded.post("/api/runs", json={"steps": 1}, headers=bearer).status_code == 201
    # the honest limit: wrong tokens in the right token's own bucket lock it out too
    for guess in _same_bucket(limiter, TOKEN, FREE_FAILURES + 1):
        guarded.post("/login", data={"token": guess})
    assert guarded.post("/login", data={"token": TOKEN}).status_code == 429


def test_wrong_bearer_tokens_lock_their_bucket_out(
    guarded: TestClient, session_factory: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    limiter, clock = _limiter(guarded, monkeypatch)
    script = TestClient(guarded.app, base_url="http://127.0.0.1", client=("10.5.5.5", 1))
    guesses = _same_bucket(limiter, _wrong_bucket_token(limiter), 40)
    statuses = [
        script.post(
            "/api/runs", json={"steps": 1}, headers={"Authorization": f"Bearer {g}"}
        ).status_code
        for g in guesses[:30]
    ]
    assert statuses == [401] * (FREE_FAILURES + 1) + [429] * 24
    refused = script.get("/api/runs", headers={"Authorization": f"Bearer {guesses[30]}"})
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert "too many wrong tokens" in refused.json()["detail"]
    right = {"Authorization": f"Bearer {TOKEN}"}
    assert script.post("/api/runs", json={"steps": 1}, headers=right).status_code == 201
    other = TestClient(guarded.app, base_url="http://127.0.0.1", client=("10.6.6.6", 1))
    blocked = {"Authorization": f"Bearer {guesses[31]}"}
    assert other.post("/api/runs", json={"steps": 1}, headers=blocked).status_code == 401
    assert _runs(session_factory) == 1


def test_short_tokens_are_refused_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValidationError, match="at least 16 characters") as refused:
        Settings(auth_token=f"{TOKEN}, abc")
    assert "abc" not in str(refused.value) and TOKEN not in str(refused.value)
    assert Settings(auth_token=f"{TOKEN}, {OTHER}").auth_token_list == [TOKEN, OTHER]
    from rollout_lens.cli import main

    monkeypatch.setenv("ROLLOUT_LENS_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("ROLLOUT_LENS_AUTH_TOKEN", "x")
    assert main(["serve", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "auth_token: each access token needs at least 16 characters" in err
    assert "token 1 of 1 is shorter" in err
    assert not (tmp_path / "rollout-lens.db").exists()


def test_the_limiter_remembers_a_bounded_number_of_entries() -> None:
    from rollout_lens.server.webapp.http.ratelimit import MAX_ENTRIES

    limiter = FailureLimiter()
    for _ in range(FREE_FAILURES + 1):
        limiter.failed("first", "a-wrong-token-000")
    assert limiter.retry_after("first", "a-wrong-token-000") == 1
    for i in range(MAX_ENTRIES):
        limiter.failed(f"10.{i // 65536}.{i // 256 % 256}.{i % 256}", "x")
    assert len(limiter) == MAX_ENTRIES
    assert limiter.retry_after("first", "a-wrong-token-000") == 0  # the least recent went first
