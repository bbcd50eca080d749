"""Alerts reach people: each new alert POSTed once to every ROLLOUT_LENS_ALERT_WEBHOOK URL as a
Slack-compatible body, retried with backoff, off the recording path; a failed delivery shows on
the run page. Receivers are real HTTP servers on loopback; the dashboard is a real uvicorn."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from rollout_lens.server.core.config import Settings
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.store.models import AlertRow, RunStatus
from rollout_lens.server.webapp.alert_hooks import deliver_waiting
from rollout_lens.server.webapp.app import create_app
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from tests.factories import make_run
from tests.waiting import returns, until
from tests.web_support import record_collapse_run, serve_app

HOSTILE_NAME = "<!channel> & <https://evil.example|click>"


class Receiver:
    """A loopback webhook receiver: answers `fail_first` requests with `status`, then 200."""

    def __init__(self, *, fail_first: int = 0, status: int = 503) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.attempts = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                length = int(self.headers.get("content-length", "0"))
                body = json.loads(self.rfile.read(length))
                receiver.attempts += 1
                code = status if receiver.attempts <= fail_first else 200
                if code == 200:
                    receiver.bodies.append(body)
                self.send_response(code)
                self.end_headers()

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receivers() -> Iterator[tuple[Receiver, Receiver, Receiver]]:
    made = (Receiver(), Receiver(fail_first=2), Receiver(fail_first=10**6, status=404))
    yield made
    for r in made:
        r.close()


def _states(factory: sessionmaker[Session], run_id: int) -> list[str | None]:
    with session_scope(factory) as session:
        return list(
            session.scalars(
                select(AlertRow.notify_state).where(AlertRow.run_id == run_id).order_by(AlertRow.id)
            )
        )


def test_each_alert_reaches_every_webhook_once(
    session_factory: sessionmaker[Session], receivers: tuple[Receiver, Receiver, Receiver]
) -> None:
    ok, flaky, refusing = receivers
    url = session_factory.kw["bind"].url.render_as_string(hide_password=False)
    settings = Settings(
        database_url=url,
        alert_webhook=f"{ok.url},{flaky.url}",
        public_url="http://lens.example:8000",
    )
    app = create_app(settings, session_factory=session_factory, alert_poll_seconds=0.1)
    with serve_app(app) as base:
        # the receivers' refusals and retries never hold the recording up (a hang fails)
        run_id = returns(
            lambda: record_collapse_run(session_factory, name=HOSTILE_NAME), "the recording"
        )
        until(
            lambda: all(s == "sent" for s in _states(session_factory, run_id)),
            "every alert sent",
            timeout=60,
            seen=lambda: _states(session_factory, run_id),
        )
        page = httpx.get(f"{base}/runs/{run_id}").text
    alerts = _states(session_factory, run_id)
    assert len(alerts) >= 2
    for receiver in (ok, flaky):
        assert len(receiver.bodies) == len(alerts)  # each once, the flaky one after retries
        kinds = {b["kind"] for b in receiver.bodies}
        assert {"collapse", "control_token_spike"} <= kinds
    assert flaky.attempts == len(alerts) + 2
    body = ok.bodies[0]
    assert body["run_id"] == run_id and body["run"] == HOSTILE_NAME
    assert body["run_url"] == f"http://lens.example:8000/runs/{run_id}"
    assert body["rollouts_url"].startswith(
        f"http://lens.example:8000/runs/{run_id}/rollouts?steps="
    )
    assert str(body["step"]) in body["text"] and body["message"]
    # Slack's mrkdwn: the run's name cannot mention a channel or make a link of its own
    assert "<!channel>" not in body["text"] and "&lt;!channel&gt; &amp; &lt;https" in body["text"]
    assert 'id="alert-deliveries"' not in page
    refusing.close()


def test_a_failed_delivery_shows_on_the_run_page(
    session_factory: sessionmaker[Session], receivers: tuple[Receiver, Receiver, Receiver]
) -> None:
    _, _, refusing = receivers
    url = session_factory.kw["bind"].url.render_as_string(hide_password=False)
    settings = Settings(database_url=url, alert_webhook=refusing.url)
    app = create_app(settings, session_factory=session_factory, alert_poll_seconds=0.1)
    with serve_app(app) as base:
        run_id = record_collapse_run(session_factory)
        until(
            lambda: all(s == "failed" for s in _states(session_factory, run_id)),
            "every delivery failed",
            timeout=60,
            seen=lambda: _states(session_factory, run_id),
        )
        page = httpx.get(f"{base}/runs/{run_id}").text
    assert refusing.attempts == len(_states(session_factory, run_id))  # a 404 is not retried
    assert 'id="alert-deliveries"' in page and "could not be delivered" in page
    assert "HTTP 404" in page


def test_alerts_of_one_run_waiting_together_are_each_delivered(
    session_factory: sessionmaker[Session], receivers: tuple[Receiver, Receiver, Receiver]
) -> None:
    """Two alerts of one run that wait for the same poll (a busy recorder, or two rules firing
    at one step) are claimed together and each sent once: they share their run's row."""
    ok, _, _ = receivers
    run_id = make_run(session_factory, steps=0, name="two at once", status=RunStatus.running)
    with session_scope(session_factory) as session:
        for step, kind in ((2, "collapse"), (2, "control_token_spike"), (3, "collapse")):
            session.add(AlertRow(run_id=run_id, step=step, kind=kind, message=f"{kind} at {step}"))
    assert deliver_waiting(session_factory, [ok.url], "http://lens.example:8000") == 3
    assert _states(session_factory, run_id) == ["sent", "sent", "sent"]
    assert sorted((b["step"], b["kind"]) for b in ok.bodies) == [
        (2, "collapse"),
        (2, "control_token_spike"),
        (3, "collapse"),
    ]
    assert deliver_waiting(session_factory, [ok.url], "http://lens.example:8000") == 0
    assert len(ok.bodies) == 3
