"""Cross-site attacks in a real Chromium: a page on a second loopback origin posts a form and
fetches to the dashboard and creates nothing; the dashboard's own form still launches. Also the
Content-Security-Policy: the run page's Plotly charts and the API docs work under it."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from rollout_lens.server.core.config import Settings
from rollout_lens.server.store.db import make_engine, make_session_factory
from rollout_lens.server.store.migrate import upgrade
from rollout_lens.server.store.models import RunRow, RunStatus
from rollout_lens.server.webapp.app import create_app
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from tests import web_support
from tests.factories import make_run

playwright = pytest.importorskip("playwright.sync_api")
uvicorn = pytest.importorskip("uvicorn")

pytestmark = pytest.mark.browser

ATTACK = """<!doctype html>
<html><body>
<form id="attack" method="post" action="TARGET/runs/new">
  <input name="steps" value="5"><input name="csrf_token" value="guessed">
</form>
<script>
  window.results = [];
  const note = (label) => (r) => window.results.push(label + ":" + (r.type === "opaque" ? "opaque" : r.status));
  const fail = (label) => () => window.results.push(label + ":blocked");
  const calls = [
    ["no-cors json", "TARGET/api/runs", {method: "POST", mode: "no-cors",
      headers: {"Content-Type": "text/plain"}, body: '{"steps": 5}'}],
    ["no-cors form", "TARGET/runs/new", {method: "POST", mode: "no-cors",
      headers: {"Content-Type": "application/x-www-form-urlencoded"}, body: "steps=5"}],
    ["cors json", "TARGET/api/runs", {method: "POST",
      headers: {"Content-Type": "application/json"}, body: '{"steps": 5}'}],
    ["cancel", "TARGET/api/runs/RUN/cancel", {method: "POST", mode: "no-cors"}],
    ["delete", "TARGET/api/runs/RUN", {method: "DELETE"}],
  ];
  window.done = Promise.all(calls.map(([label, url, init]) =>
    fetch(url, init).then(note(label), fail(label))));
</script>
</body></html>
"""


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
        pass


@contextlib.contextmanager
def _dashboard(data_dir: Path, **settings: Any) -> Iterator[tuple[str, sessionmaker[Session]]]:
    """The app under uvicorn on a loopback port, on a fresh SQLite file in data_dir."""
    url = f"sqlite:///{data_dir / 'rollout-lens.db'}"
    engine = make_engine(url)
    upgrade(engine)
    factory = make_session_factory(engine)
    config = Settings(database_url=url, data_dir=data_dir, lost_after_seconds=3600, **settings)
    try:
        with web_support.serve_app(create_app(config)) as base:
            yield base, factory
    finally:
        engine.dispose()


@pytest.fixture(scope="module")
def dashboard(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, sessionmaker[Session]]]:
    with _dashboard(tmp_path_factory.mktemp("security-browser")) as served:
        yield served


def _count(factory: sessionmaker[Session]) -> tuple[int, int]:
    """(runs, cancelled runs)"""
    with factory() as session:
        runs = session.scalar(select(func.count()).select_from(RunRow)) or 0
        cancelled = session.scalar(
            select(func.count()).select_from(RunRow).where(RunRow.status == RunStatus.cancelled)
        )
        return int(runs), int(cancelled or 0)


def test_a_page_on_another_origin_changes_nothing(
    browser: Any, dashboard: tuple[str, sessionmaker[Session]], tmp_path: Path
) -> None:
    target, factory = dashboard
    victim = make_run(factory, steps=2, status=RunStatus.queued)
    (tmp_path / "attack.html").write_text(
        ATTACK.replace("TARGET", target).replace("RUN", str(victim))
    )
    attacker = ThreadingHTTPServer(
        ("127.0.0.1", web_support.free_port()),
        functools.partial(_Quiet, directory=str(tmp_path)),
    )
    threading.Thread(target=attacker.serve_forever, daemon=True).start()
    before = _count(factory)
    context = browser.new_context()
    try:
        page = context.new_page()
        page.goto(f"http://127.0.0.1:{attacker.server_address[1]}/attack.html")
        page.evaluate("window.done")
        results = page.evaluate("window.results")
        assert "cors json:blocked" in results and "delete:blocked" in results, results
        with page.expect_navigation():
            page.evaluate("document.getElementById('attack').submit()")
        assert "another web site" in page.content()
        assert _count(factory) == before
        # the dashboard's own form, in the same browser, still launches
        page.goto(f"{target}/runs/new")
        page.fill("#f-steps", "5")
        with page.expect_navigation():
            page.click("#launch-button")
        assert "/runs/" in page.url and "another web site" not in page.content()
        assert _count(factory) == (before[0] + 1, before[1])
    finally:
        context.close()
        attacker.shutdown()
        attacker.server_close()


def test_charts_and_docs_work_under_the_csp(
    browser: Any, dashboard: tuple[str, sessionmaker[Session]]
) -> None:
    target, factory = dashboard
    run_id = make_run(factory, steps=12, seed=2, status=RunStatus.completed)
    context = browser.new_context(base_url=target)
    context.set_default_timeout(10_000)
    errors: list[str] = []
    try:
        page = context.new_page()
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        response = page.goto(f"/runs/{run_id}")
        assert (
            response is not None
            and "script-src 'self'" in response.headers["content-security-policy"]
        )
        page.wait_for_selector("body[data-charts-ready]")
        assert page.locator(".js-plotly-plot .main-svg").count() > 0
        assert page.locator(".js-plotly-plot .scatterlayer .trace").count() > 0
        page.goto("/docs")
        page.wait_for_selector(".swagger-ui .opblock")
        assert not errors, errors  # a CSP violation is a console error
        page.goto("/runs/99999")
        assert page.locator(".error-status").text_content() == "404"
        assert [e for e in errors if "Content Security Policy" in e] == []
    finally:
        context.close()


def test_the_delete_button_asks_first(
    browser: Any, dashboard: tuple[str, sessionmaker[Session]]
) -> None:
    target, factory = dashboard
    run_id = make_run(factory, steps=2, seed=5, status=RunStatus.completed)
    context = browser.new_context(base_url=target)
    context.set_default_timeout(10_000)
    asked: list[str] = []
    try:
        page = context.new_page()
        page.goto(f"/runs/{run_id}")
        page.once("dialog", lambda d: (asked.append(d.message), d.dismiss()))
        page.click("#delete-button")
        assert asked and f"#{run_id}" in asked[0]
        assert page.url.endswith(f"/runs/{run_id}")
        page.once("dialog", lambda d: d.accept())
        with page.expect_navigation():
            page.click("#delete-button")
        assert page.url == f"{target}/"
        with factory() as session:
            assert session.get(RunRow, run_id) is None
    finally:
        context.close()


def test_signing_in_with_a_token_in_the_browser(
    browser: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    token = "browser-token-0042"
    with _dashboard(tmp_path_factory.mktemp("guarded"), auth_token=token) as (target, factory):
        context = browser.new_context(base_url=target)
        context.set_default_timeout(10_000)
        try:
            page = context.new_page()
            page.goto("/runs/new")
            with page.expect_navigation():
                page.click("#launch-button")
            assert "needs a token" in page.content()
            assert _count(factory) == (0, 0)
            page.goto("/")
            with page.expect_navigation():
                page.click("#login-link")
            page.fill("#token", "wrong")
            with page.expect_navigation():
                page.click("#login-button")
            assert page.locator("#login-error").is_visible()
            assert "wrong" not in page.content()
            page.fill("#token", token)
            with page.expect_navigation():
                page.click("#login-button")
            (cookie,) = [c for c in context.cookies() if c["name"] == "rl_session"]
            assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
            assert token not in cookie["value"] and cookie["expires"] > 0  # it expires
            page.goto("/runs/new")
            page.fill("#f-steps", "5")
            with page.expect_navigation():
                page.click("#launch-button")
            assert _count(factory) == (1, 0)
            assert _launch_with_cookie(target, cookie["value"]) == 201  # a copy works…
            with page.expect_navigation():
                page.click("#logout-button")
            assert page.locator("#login-link").is_visible()
            assert not [c for c in context.cookies() if c["name"] == "rl_session"]
            assert _launch_with_cookie(target, cookie["value"]) == 401  # …until sign-out
            assert _count(factory) == (2, 0)
        finally:
            context.close()


def _launch_with_cookie(target: str, session_cookie: str) -> int:
    """A launch from another client holding a copy of a browser's session cookie."""
    import httpx

    csrf = "copied-csrf-0123456789abcdefghijklmnopq"
    response = httpx.post(
        f"{target}/api/runs",
        json={"steps": 1},
        cookies={"rl_session": session_cookie, "rl_csrf": csrf},
        headers={"X-CSRF-Token": csrf},
    )
    return response.status_code


def test_a_tool_result_with_markup_stays_text(
    browser: Any, dashboard: tuple[str, sessionmaker[Session]]
) -> None:
    """A tool-calling rollout whose tool result, arguments and token texts carry a script and
    an <img onerror>: in a real Chromium nothing runs and the result reads as the text it is."""
    from tests.factories import HOSTILE, make_tool_rollouts, record_step

    target, factory = dashboard
    run_id = make_run(factory, steps=0, seed=7, status=RunStatus.completed)
    record_step(factory, run_id, 1, values={"reward_mean": 1.0}, rollouts=make_tool_rollouts())
    context = browser.new_context(base_url=target)
    context.set_default_timeout(10_000)
    dialogs: list[str] = []
    try:
        page = context.new_page()
        page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        page.goto(f"/runs/{run_id}/steps/1")
        page.wait_for_load_state("load")
        result = page.locator("#rollout-0 .tool-result")
        assert result.count() == 1 and result.text_content() == HOSTILE
        assert page.locator("#rollout-0 .turn-tool .not-trained").is_visible()
        assert page.evaluate("window.__pwned") is None
        assert page.locator(".tool-result img, .tool-result script, .tool-args img").count() == 0
        assert not dialogs
    finally:
        context.close()
