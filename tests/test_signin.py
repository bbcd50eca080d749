"""Signed-in browsers and token guessing: server-side sessions that sign-out ends (here, and
everywhere), that expire and that no other server accepts; wrong tokens limited per client
address with a growing lockout, a right one never slowed; tokens too short refused at start."""

from __future__ import annotations

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
from rollout_lens.server.webapp.http.ratelimit import FREE_FAILURES
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


def test_wrong_sign_ins_lock_the_address_out_for_growing_times(guarded: TestClient) -> None:
    """After a few checked guesses (401) the address is locked out: answered 429 with
    Retry-After, unchecked and at once, for a wait that doubles with each further wrong token.
    A right token from another address is never slowed; a right one clears its address."""
    wrong = [guarded.post("/login", data={"token": f"guess-{i:016d}"}) for i in range(6)]
    assert [r.status_code for r in wrong] == [401] * (FREE_FAILURES + 1)
    locked = guarded.post("/login", data={"token": TOKEN})  # even the right one waits its turn
    assert locked.status_code == 429 and locked.headers["retry-after"] == "1"
    assert "too many wrong tokens from this address: try again in 1 s" in locked.text
    elsewhere = _copy(guarded, "", address="10.1.2.3")
    elsewhere.cookies.delete("rl_session")
    t0 = time.perf_counter()
    assert (
        elsewhere.post("/login", data={"token": TOKEN}, follow_redirects=False).status_code == 303
    )
    assert time.perf_counter() - t0 < 1
    time.sleep(1.1)
    assert guarded.post("/login", data={"token": "still-wrong-000000"}).status_code == 401
    doubled = guarded.post("/login", data={"token": TOKEN})
    assert doubled.status_code == 429 and doubled.headers["retry-after"] == "2"
    started = time.perf_counter()
    burst = [guarded.post("/login", data={"token": f"g-{i:016d}"}).status_code for i in range(300)]
    assert time.perf_counter() - started < 30  # nothing sleeps
    assert burst.count(401) <= 3 and burst.count(429) >= 297  # 2 s, 4 s, 8 s: a few checked

    for _ in range(FREE_FAILURES - 1):
        assert elsewhere.post("/login", data={"token": "x" * 16}).status_code == 401
    assert (
        elsewhere.post("/login", data={"token": TOKEN}, follow_redirects=False).status_code == 303
    )
    again = [elsewhere.post("/login", data={"token": "x" * 16}).status_code for _ in range(6)]
    assert again == [401] * (FREE_FAILURES + 1)  # the right token cleared the count


def test_wrong_bearer_tokens_lock_the_address_out(
    guarded: TestClient, session_factory: sessionmaker[Session]
) -> None:
    script = TestClient(guarded.app, base_url="http://127.0.0.1", client=("10.5.5.5", 1))
    wrong = {"Authorization": "Bearer not-the-token-000000"}
    statuses = [
        script.post("/api/runs", json={"steps": 1}, headers=wrong).status_code for _ in range(300)
    ]
    assert statuses[: FREE_FAILURES + 2] == [401] * (FREE_FAILURES + 1) + [429]
    assert statuses.count(401) <= FREE_FAILURES + 4  # past the lockouts of 1, 2, 4 s at most
    refused = script.get("/api/runs", headers=wrong)  # reading with a wrong token counts too
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
    assert "too many wrong tokens" in refused.json()["detail"]
    right = {"Authorization": f"Bearer {TOKEN}"}
    other = TestClient(guarded.app, base_url="http://127.0.0.1", client=("10.6.6.6", 1))
    assert other.post("/api/runs", json={"steps": 1}, headers=right).status_code == 201
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


def test_the_limiter_remembers_a_bounded_number_of_addresses() -> None:
    from rollout_lens.server.webapp.http.ratelimit import MAX_ADDRESSES, FailureLimiter

    limiter = FailureLimiter()
    for _ in range(FREE_FAILURES + 1):
        limiter.failed("first")
    assert limiter.retry_after("first") == 1
    for i in range(MAX_ADDRESSES):
        limiter.failed(f"10.{i // 65536}.{i // 256 % 256}.{i % 256}")
    assert len(limiter) == MAX_ADDRESSES
    assert limiter.retry_after("first") == 0  # the least recently failing one went first
