"""Who stopped a run: a cancel from a signed-in browser's form names the token it signed in with
(by its fingerprint, never the token), one from a dashboard without tokens names the dashboard;
the run card and the runs list show it, escaped."""

from __future__ import annotations

from pathlib import Path

from rollout_lens.server import store
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.store.models import RunSource, RunStatus
from rollout_lens.server.webapp.http.security import token_name
from sqlalchemy.orm import Session, sessionmaker

from tests.web_support import client_for, parse

TOKEN = "team-token-0123456789"


def _recorded_run(factory: sessionmaker[Session], key: str) -> int:
    """A running run a user's script records over HTTP."""
    with session_scope(factory) as session:
        run = store.create_run(
            session,
            name="a user's run",
            model="m",
            total_steps=10,
            group_size=4,
            status=RunStatus.running,
            source=RunSource.callback,
        )
        store.set_record_owner(session, run_id=run.id, key=key, recorded_by=None)
        return run.id


def test_a_signed_in_browser_cancels_and_the_pages_say_which_token(
    session_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    client = client_for(session_factory, data_dir=tmp_path, auth_token=TOKEN)
    signed = client.post("/login", data={"token": TOKEN}, follow_redirects=False)
    assert signed.status_code == 303
    run_id = _recorded_run(session_factory, "browser-key-0001")
    response = client.post(f"/runs/{run_id}/cancel", follow_redirects=False)
    assert response.status_code == 303
    who = f"dashboard (a browser signed in with {token_name(TOKEN)})"
    with session_scope(session_factory) as session:
        run = store.get_run(session, run_id=run_id)
        assert (run.status, run.ended_by) == ("cancelled", who)
    assert TOKEN not in who
    page = parse(client.get(f"/runs/{run_id}").text)
    assert page.find("dd", data_field="ended_by").text == who
    row = parse(client.get("/").text).find("tr", data_run_id=str(run_id))
    assert row.find("td", data_field="status").attrs["title"] == f"ended by {who}"


def test_without_tokens_the_dashboard_is_who_and_the_text_is_escaped(
    session_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    client = client_for(session_factory, data_dir=tmp_path)
    run_id = _recorded_run(session_factory, "open-key-0001")
    live = client.post(f"/api/runs/{run_id}/cancel").json()
    assert live["status"] == "cancelled" and live["text"]["ended_by"] == "dashboard"
    # whatever a row holds is shown as text
    with session_scope(session_factory) as session:
        store.get_run(session, run_id=run_id).ended_by = "<b>x</b>"
    html = client.get(f"/runs/{run_id}").text
    assert "<b>x</b>" not in html
    assert parse(html).find("dd", data_field="ended_by").text == "<b>x</b>"
