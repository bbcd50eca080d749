"""Safe on a team server: range checks, headers, cross-site refusal, CSRF, tokens, deletion."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from rollout_lens.server.store.models import RunRow, RunStatus
from rollout_lens.server.webapp.http import security
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from tests.factories import make_run
from tests.web_support import CSRF, client_for, parse

HUGE = "99999999999999999999"


@pytest.mark.parametrize(
    "path",
    [
        f"/runs/{HUGE}",
        f"/api/runs/{HUGE}",
        f"/api/runs/{HUGE}/series",
        "/api/runs/1/series?since=" + HUGE,
        "/api/runs/1/series?since=-1",
        "/api/runs/1/alerts?since=" + HUGE,
        f"/runs/1/steps/{HUGE}",
        f"/api/runs/1/steps/{HUGE}",
        f"/api/compare?runs=1,{HUGE}",
        f"/compare?runs=1,{HUGE}",
        f"/runs/new?clone={HUGE}",
        f"/api/runs?after={HUGE}",
        f"/api/runs/{HUGE}/export",
        "/runs/-1",
    ],
)
def test_out_of_range_integers_are_a_4xx_with_a_message(client: TestClient, path: str) -> None:
    response = client.get(path)
    assert 400 <= response.status_code < 500, response.text
    assert "2147483647" in response.text or "greater than" in response.text


@pytest.mark.parametrize(
    ("path", "words"),
    [
        ("/api/runs/-1", "greater than or equal to 1"),
        (f"/api/runs/{HUGE}", "2147483647"),
        ("/api/runs/1/series?since=abc", "since: Input should be a valid integer"),
        ("/api/runs/1/steps/1.5", "step: Input should be a valid integer"),
    ],
)
def test_bad_path_and_query_numbers_are_a_422_naming_the_parameter(
    client: TestClient, path: str, words: str
) -> None:
    response = client.get(path)
    assert response.status_code == 422
    body = response.json()
    assert words in body["detail"] and body["errors"]


THOUSAND_IDS = ",".join(str(i) for i in range(1, 1001))


@pytest.mark.parametrize(
    "path",
    [
        f"/compare?runs={THOUSAND_IDS}",
        f"/api/compare?runs={THOUSAND_IDS}",
        f"/api/alerts?runs={THOUSAND_IDS}",
        f"/api/runs?ids={THOUSAND_IDS}",
    ],
)
def test_a_thousand_run_ids_are_refused_with_a_message(client: TestClient, path: str) -> None:
    response = client.get(path, headers={"accept": "application/json"})
    assert response.status_code == 400
    assert response.json() == {"detail": "at most 100 run ids at once, got 1000"}


def test_a_hundred_run_ids_are_still_read(client: TestClient, session_factory) -> None:  # type: ignore[no-untyped-def]
    run_id = make_run(session_factory, steps=1, seed=1)
    ids = ",".join(str(i) for i in range(1, 101))
    assert [r["id"] for r in client.get(f"/api/runs?ids={ids}").json()["runs"]] == [run_id]


@pytest.mark.parametrize(
    "path",
    [
        "/api/runs?q=%00",
        "/api/runs?sort=created%00",
        "/api/runs/1/series?names=loss%00",
        "/api/runs/%00",
        "/runs/1?notice=%00",
        "/?q=a%00b",
    ],
)
def test_a_nul_byte_in_the_path_or_query_is_a_400(client: TestClient, path: str) -> None:
    """No parameter has a use for a NUL, and PostgreSQL refuses one in any string (a 500)."""
    response = client.get(path, headers={"accept": "application/json"})
    assert response.status_code == 400
    assert "NUL byte" in response.json()["detail"]


def test_in_range_ids_still_work(client: TestClient, session_factory) -> None:  # type: ignore[no-untyped-def]
    run_id = make_run(session_factory, steps=3, seed=1)
    assert client.get(f"/api/runs/{run_id}/series?since=2147483647").status_code == 200
    assert client.get("/api/runs/2147483647").status_code == 404


# --- headers ------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/", "/runs/new", "/docs", "/runs/12345", "/api/runs", "/login"])
def test_every_response_carries_the_security_headers(client: TestClient, path: str) -> None:
    response = client.get(path)
    csp = response.headers["content-security-policy"]
    assert "script-src 'self';" in csp
    assert "unsafe-eval" not in csp
    assert "'unsafe-inline'" not in csp.split("script-src")[1].split(";")[0]
    assert "frame-ancestors 'none'" in csp
    assert response.headers["x-content-type-options"] == "nosniff"
    assert response.headers["x-frame-options"] == "DENY"
    assert response.headers["referrer-policy"] == "same-origin"


def test_pages_have_no_inline_scripts(client: TestClient, session_factory) -> None:  # type: ignore[no-untyped-def]
    run_id = make_run(session_factory, steps=2)
    for path in ("/", f"/runs/{run_id}", f"/runs/{run_id}/steps/1", "/runs/new", "/docs", "/x"):
        page = parse(client.get(path).text)
        for script in page.find_all("script"):
            assert script.attrs.get("src") or script.attrs.get("type") == "application/json", path
        assert not [n for n in page.iter() if any(a.startswith("on") for a in n.attrs)], path


# --- the same-origin rule, CSRF, Host -----------------------------------------------------------


def _runs(factory: sessionmaker[Session]) -> int:
    with factory() as session:
        return int(session.scalar(select(func.count()).select_from(RunRow)) or 0)


def _plain(client: TestClient) -> TestClient:
    """The same app with nothing a browser would add (a script, curl)."""
    return TestClient(client.app, base_url="http://127.0.0.1")


@pytest.mark.parametrize(
    "headers",
    [
        {"Origin": "http://evil.example"},
        {"Origin": "http://127.0.0.1:9999"},
        {"Origin": "https://127.0.0.1"},  # another scheme: another origin
        {"Origin": "null"},
        {"Sec-Fetch-Site": "cross-site"},
        {"Sec-Fetch-Site": "same-site"},
    ],
)
def test_cross_site_posts_are_refused(
    client: TestClient, session_factory: sessionmaker[Session], headers: dict[str, str]
) -> None:
    response = client.post(
        "/runs/new",
        data={"steps": "5", "csrf_token": CSRF},
        headers=headers,
        follow_redirects=False,
    )
    assert response.status_code == 403
    assert "another web site" in response.text
    response = client.post("/api/runs", json={"steps": 5}, headers=headers)
    assert response.status_code == 403
    assert "another web site" in response.json()["detail"]
    assert _runs(session_factory) == 0


def test_a_same_origin_form_needs_its_csrf_token(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    browser = _plain(client)
    form = parse(browser.get("/runs/new").text)
    token = form.find("input", name="csrf_token").attrs["value"]
    assert browser.cookies.get("rl_csrf") == token
    assert parse(browser.get("/").text).find("meta", name="csrf-token").attrs["content"] == token
    origin = {"Origin": "http://127.0.0.1", "Sec-Fetch-Site": "same-origin"}
    refused = browser.post("/runs/new", data={"steps": "5"}, headers=origin)
    assert refused.status_code == 403 and "CSRF" in refused.text
    wrong = browser.post("/runs/new", data={"steps": "5", "csrf_token": "x" * 43}, headers=origin)
    assert wrong.status_code == 403
    assert _runs(session_factory) == 0
    done = browser.post(
        "/runs/new",
        data={"steps": "5", "csrf_token": token},
        headers=origin,
        follow_redirects=False,
    )
    assert done.status_code == 303
    assert _runs(session_factory) == 1
    api = browser.post("/api/runs", json={"steps": 5}, headers=origin | {"X-CSRF-Token": token})
    assert api.status_code == 201
    assert browser.post("/api/runs", json={"steps": 5}, headers=origin).status_code == 403
    assert _runs(session_factory) == 2


def test_scripts_without_cookies_need_no_csrf_token(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    assert _plain(client).post("/api/runs", json={"steps": 5}).status_code == 201
    assert _runs(session_factory) == 1


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "localhost.evil", ""])
def test_other_host_names_are_refused(client: TestClient, host: str) -> None:
    response = client.get("/api/runs", headers={"Host": host})
    assert response.status_code == 421
    assert "ROLLOUT_LENS_ALLOWED_HOSTS" in response.json()["detail"]
    for ok in ("localhost:8000", "127.0.0.1", "[::1]:8000", "10.0.0.5:8000", "LOCALHOST"):
        assert client.get("/api/runs", headers={"Host": ok}).status_code == 200


def test_extra_allowed_hosts(session_factory: sessionmaker[Session], tmp_path: Path) -> None:
    client = client_for(session_factory, data_dir=tmp_path, allowed_hosts="lens.example")
    assert client.get("/api/runs", headers={"Host": "lens.example:80"}).status_code == 200
    assert client.get("/api/runs", headers={"Host": "evil.example"}).status_code == 421
    anyhost = client_for(session_factory, data_dir=tmp_path, allowed_hosts="*")
    assert anyhost.get("/api/runs", headers={"Host": "evil.example"}).status_code == 200


# --- tokens -------------------------------------------------------------------------------------

TOKEN = "s3cret-token-abc"


@pytest.fixture
def guarded(session_factory: sessionmaker[Session], tmp_path: Path) -> TestClient:
    return client_for(session_factory, data_dir=tmp_path, auth_token=f"other-token-0123, {TOKEN}")


def test_a_token_guards_every_change(
    guarded: TestClient, session_factory: sessionmaker[Session]
) -> None:
    run_id = make_run(session_factory, steps=2, status=RunStatus.completed)
    for method, path in [
        ("POST", "/api/runs"),
        ("POST", "/runs/new"),
        ("POST", f"/api/runs/{run_id}/cancel"),
        ("POST", f"/api/runs/{run_id}/resume"),
        ("POST", f"/runs/{run_id}/resume"),
        ("DELETE", f"/api/runs/{run_id}"),
        ("POST", f"/runs/{run_id}/delete"),
    ]:
        response = guarded.request(method, path, json={} if "api" in path else None)
        assert response.status_code == 401, (method, path)
        assert response.headers["www-authenticate"] == "Bearer"
        assert TOKEN not in response.text
    wrong = guarded.post("/api/runs", json={"steps": 5}, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and "nope" not in wrong.text
    assert _runs(session_factory) == 1
    # reading stays open by default
    assert guarded.get(f"/runs/{run_id}").status_code == 200
    assert guarded.get("/api/runs").status_code == 200
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    assert _plain(guarded).post("/api/runs", json={"steps": 5}, headers=bearer).status_code == 201
    assert _runs(session_factory) == 2


def test_sign_in_sets_a_strict_httponly_cookie_and_sign_out_clears_it(
    guarded: TestClient, session_factory: sessionmaker[Session]
) -> None:
    page = parse(guarded.get("/").text)
    assert page.by_id("login-link")
    wrong = guarded.post("/login", data={"token": "guess", "next": "/runs/new"})
    assert wrong.status_code == 401
    assert "not valid" in wrong.text and "guess" not in wrong.text
    response = guarded.post(
        "/login", data={"token": TOKEN, "next": "/runs/new"}, follow_redirects=False
    )
    assert response.status_code == 303 and response.headers["location"] == "/runs/new"
    cookie = response.headers["set-cookie"]
    assert "rl_session=" in cookie and "HttpOnly" in cookie and "SameSite=strict" in cookie
    assert TOKEN not in cookie
    assert parse(guarded.get("/").text).by_id("logout-button")
    launched = guarded.post("/runs/new", data={"steps": "5"}, follow_redirects=False)
    assert launched.status_code == 303
    assert _runs(session_factory) == 1
    guarded.post("/logout")
    assert guarded.post("/runs/new", data={"steps": "5"}).status_code == 401
    assert _runs(session_factory) == 1


def test_next_stays_on_this_site(guarded: TestClient) -> None:
    for target in ("//evil.example/", "http://evil.example/", "https:evil"):
        response = guarded.post(
            "/login", data={"token": TOKEN, "next": target}, follow_redirects=False
        )
        assert response.headers["location"] == "/"


def test_reading_can_need_the_token_too(
    session_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    client = client_for(session_factory, data_dir=tmp_path, auth_token=TOKEN, auth_read=True)
    page = client.get("/runs/new?preset=x", follow_redirects=False)
    assert page.status_code == 303
    assert page.headers["location"] == "/login?next=%2Fruns%2Fnew%3Fpreset%3Dx"
    assert client.get("/api/runs").status_code == 401
    assert client.get("/login").status_code == 200
    assert client.get("/static/app.js").status_code == 200
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    assert client.get("/api/runs", headers=bearer).status_code == 200
    client.post("/login", data={"token": TOKEN})
    assert client.get("/").status_code == 200


def test_tokens_compare_in_constant_time() -> None:
    assert security.matches_token("b", ["a", "b"])
    assert not security.matches_token("", ["a"])
    assert not security.matches_token("a", [])


# --- crafted reads: a 4xx naming the limit, never a 500 ----------------------------------------


@pytest.mark.parametrize(
    ("path", "words"),
    [
        ("/api/runs?q=" + "+".join(f"w{i}" for i in range(1000)), "at most 20 words, got 1000"),
        ("/?q=" + "+".join(f"w{i}" for i in range(21)), "at most 20 words, got 21"),
        ("/api/runs?q=" + "x" * 201, "at most 200 characters"),
        ("/api/runs/1/series?names=" + ",".join(f"s{i}" for i in range(2001)), "at most 500"),
    ],
)
def test_crafted_reads_are_a_400_naming_the_limit(
    client: TestClient, session_factory: sessionmaker[Session], path: str, words: str
) -> None:
    make_run(session_factory, steps=2)
    response = client.get(path, headers={"accept": "application/json"})
    assert response.status_code == 400, response.text[:300]
    assert words in response.json()["detail"]


def test_repeated_series_names_are_read_once(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    run_id = make_run(session_factory, steps=3)
    once = client.get(f"/api/runs/{run_id}/series?names=loss").json()
    repeated = client.get(f"/api/runs/{run_id}/series?names=" + ",".join(["loss"] * 2001))
    assert repeated.status_code == 200
    assert repeated.json()["series"] == once["series"]
    words = client.get("/api/runs?q=" + "+".join(["run"] * 1000))
    assert words.status_code == 200


def test_a_server_error_carries_the_security_headers(tmp_path: Path) -> None:
    """A real 500 (the runs table is gone): the same headers as every response, a page for a
    browser and JSON for a script, and the database's message only in the log."""
    from rollout_lens.server.store.db import make_engine, make_session_factory
    from rollout_lens.server.store.migrate import upgrade
    from sqlalchemy import text

    engine = make_engine(f"sqlite:///{tmp_path / 'broken.db'}")
    upgrade(engine)
    with engine.begin() as conn:
        conn.execute(text("PRAGMA foreign_keys=OFF"))
        conn.execute(text("DROP TABLE runs"))
    client = client_for(make_session_factory(engine), data_dir=tmp_path)
    page = client.get("/", headers={"accept": "text/html"})
    api = client.get("/api/runs")
    assert page.status_code == api.status_code == 500
    assert page.headers["content-type"].startswith("text/html")
    assert parse(page.text).find(cls="error-status").text == "500"
    assert "Something went wrong" in page.text
    assert api.json() == {"detail": "the server hit an unexpected error; its log has the details"}
    for response in (page, api):
        assert "script-src 'self'" in response.headers["content-security-policy"]
        assert response.headers["x-content-type-options"] == "nosniff"
        assert response.headers["x-frame-options"] == "DENY"
        assert "no such table" not in response.text
    engine.dispose()


# --- notices, Server-Timing, host entries with ports --------------------------------------------


def test_notices_come_only_from_the_server(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    """A link cannot put words on a real page (`?notice=`, a forged cookie); a form action's
    notice is shown once, on the page it redirects to."""
    run_id = make_run(session_factory, steps=2, status=RunStatus.completed)
    phishing = client.get(f"/runs/{run_id}?notice=Your+token+expired:+sign+in+at+evil.example")
    assert phishing.status_code == 200 and "evil.example" not in phishing.text
    assert not parse(phishing.text).find_all(id="notice")
    forged = TestClient(client.app, base_url="http://127.0.0.1", cookies={"rl_notice": "Hi.x.y"})
    assert not parse(forged.get(f"/runs/{run_id}").text).find_all(id="notice")
    response = client.post(f"/runs/{run_id}/cancel", follow_redirects=False)
    assert response.status_code == 303 and response.headers["location"] == f"/runs/{run_id}"
    assert "notice" not in response.headers["location"]
    cookie = response.headers["set-cookie"]
    assert "rl_notice=" in cookie and "HttpOnly" in cookie and "cancelled" not in cookie
    page = client.get(f"/runs/{run_id}")
    assert "only queued or running runs can be cancelled" in parse(page.text).by_id("notice").text
    again = client.get(f"/runs/{run_id}")  # shown once
    assert not parse(again.text).find_all(id="notice")


def test_server_timing_only_when_asked_for(
    session_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    plain = client_for(session_factory, data_dir=tmp_path)
    assert "server-timing" not in plain.get("/api/runs").headers
    timed = client_for(session_factory, data_dir=tmp_path, server_timing=True)
    assert timed.get("/api/runs").headers["server-timing"].startswith("app;dur=")


def test_allowed_hosts_with_a_port(session_factory: sessionmaker[Session], tmp_path: Path) -> None:
    client = client_for(
        session_factory, data_dir=tmp_path, allowed_hosts="lens.example:8443, docs.example"
    )
    assert client.get("/api/runs", headers={"Host": "lens.example:8443"}).status_code == 200
    assert client.get("/api/runs", headers={"Host": "LENS.example:8443"}).status_code == 200
    for other in ("lens.example:9000", "lens.example", "evil.example:8443"):
        assert client.get("/api/runs", headers={"Host": other}).status_code == 421, other
    assert client.get("/api/runs", headers={"Host": "docs.example:1234"}).status_code == 200


# --- bounded launch input -------------------------------------------------------------------------


def test_launch_text_and_lists_have_maximum_lengths(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    cases = [
        ({"model": "x" * 501}, "model: Model must be at most 500 characters"),
        ({"name": "n" * 201}, "name: Name must be at most 200 characters"),
        (
            {"control_tokens": ["a"] * 100_000},
            "control_tokens: Control tokens must have at most 64 items",
        ),
        (
            {"control_tokens": ["t" * 101]},
            "control_tokens: Control tokens must be at most 100 characters",
        ),
        ({"verifier": "v" * 10_000}, "verifier: Verifier must be at most 32 characters"),
    ]
    for body, words in cases:
        response = client.post("/api/runs", json={"steps": 1} | body)
        assert response.status_code == 422, body.keys()
        assert words in response.json()["detail"]
        assert len(response.content) < 5_000  # the input is not echoed back
    assert _runs(session_factory) == 0
    ok = client.post(
        "/api/runs", json={"steps": 1, "model": "m" * 500, "control_tokens": ["t"] * 64}
    )
    assert ok.status_code == 201
    assert len(client.get("/").content) < 200_000


def test_a_body_over_1_mb_is_a_413(session_factory: sessionmaker[Session], tmp_path: Path) -> None:
    """Declared (Content-Length) or streamed (chunked) to a real server: refused with a 413 that
    names the limit, and nothing is created; a form is capped the same way."""
    import httpx
    from rollout_lens.server.core.config import Settings
    from rollout_lens.server.webapp.app import create_app

    from tests.web_support import serve_app

    url = session_factory.kw["bind"].url.render_as_string(hide_password=False)
    app = create_app(Settings(database_url=url, data_dir=tmp_path), session_factory=session_factory)
    with serve_app(app) as base, httpx.Client(base_url=base, timeout=30) as http:
        declared = http.post("/api/runs", json={"steps": 1, "model": "x" * 2_000_000})
        assert declared.status_code == 413
        assert "larger than 1,048,576 bytes" in declared.json()["detail"]

        def chunks():  # no Content-Length: Transfer-Encoding: chunked
            yield b'{"steps": 1, "model": "'
            for _ in range(50):
                yield b"x" * 100_000
            yield b'"}'

        streamed = http.post(
            "/api/runs", content=chunks(), headers={"content-type": "application/json"}
        )
        assert streamed.status_code == 413
        assert "content-security-policy" in streamed.headers
        form = http.post("/runs/new", data={"name": "n" * 1_100_000, "steps": "1"})
        assert form.status_code == 413 and "1,048,576 bytes" in form.text
        fine = httpx.post(f"{base}/api/runs", json={"steps": 1, "name": "n" * 200}, timeout=30)
        assert fine.status_code == 201  # a script's (the client above now has cookies)
    assert _runs(session_factory) == 1


def test_queued_runs_are_capped(session_factory: sessionmaker[Session], tmp_path: Path) -> None:
    client = client_for(session_factory, data_dir=tmp_path, max_queued_runs=3)
    for _ in range(3):
        assert client.post("/api/runs", json={"steps": 100_000}).status_code == 201
    refused = client.post("/api/runs", json={"steps": 100_000})
    assert refused.status_code == 409
    detail = refused.json()["detail"]
    assert "the queue is full: 3 runs wait and at most 3 may" in detail
    assert "ROLLOUT_LENS_MAX_QUEUED_RUNS" in detail
    form = client.post("/runs/new", data={"steps": "5"})
    assert form.status_code == 409 and "the queue is full" in form.text
    failed = make_run(session_factory, steps=1, status=RunStatus.failed)
    resumed = client.post(f"/api/runs/{failed}/resume")
    assert resumed.status_code == 409 and "the queue is full" in resumed.json()["detail"]
    assert _runs(session_factory) == 4  # three queued, and the failed one, still failed
    client.post("/api/runs/1/cancel")  # room for one again
    assert client.post("/api/runs", json={"steps": 5}).status_code == 201
