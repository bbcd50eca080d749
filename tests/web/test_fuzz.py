"""The OpenAPI schema fuzzed with schemathesis: every operation, a bounded, derandomized search.

No answer may be a server error, and every answer whose status code the schema declares must
have the body the schema declares for it (422s included: `{"detail": message, "errors": [...]}`).
Runs on an SQLite file and on PostgreSQL (which refuses NUL characters in text, unlike SQLite). Requests come as a script sends them (no
cookies, no Origin): the Guard lets them change things without a CSRF token, so the mutating
operations are fuzzed too. They cannot train anything: the broker is down (an address nothing
listens on, and the broker check refuses at once), so a launch or resume that passes validation
is answered 503 ("the task queue cannot be reached"), the one server-side status allowed, and only
for those two; nothing is ever queued.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from rollout_lens.server.core.config import Settings
from rollout_lens.server.core.errors import BrokerUnavailable
from rollout_lens.server.webapp import control
from rollout_lens.server.webapp.app import create_app
from schemathesis.specs.openapi.checks import response_schema_conformance
from sqlalchemy.orm import Session, sessionmaker

from tests.factories import make_run

# Nothing listens on port 1: connecting is refused at once.
DOWN_BROKER = "redis://127.0.0.1:1/0"
# The documented 503 of a down broker, for the operations that queue a run.
QUEUEING = {("POST", "/api/runs"), ("POST", "/api/runs/{run_id}/resume")}


def _broker_down(*_: Any, **__: Any) -> Any:
    raise BrokerUnavailable("the task queue at redis://127.0.0.1:1/0 cannot be reached (test)")


@pytest.fixture
def fuzz_app(
    session_factory: sessionmaker[Session], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[FastAPI]:
    """The app on the test's database (an SQLite file, then PostgreSQL) with two recorded runs,
    and a broker that is down."""
    for seed in (0, 1):
        make_run(session_factory, steps=4, seed=seed)
    # Refused at once (kombu's one retry after 2 s would make every accepted launch take 2 s).
    monkeypatch.setattr(control, "check_broker", _broker_down)
    monkeypatch.setattr(control, "enqueue_run", _broker_down)
    url = session_factory.kw["bind"].url.render_as_string(hide_password=False)
    # schemathesis calls the app as http://testserver: let the Host check admit that name.
    settings = Settings(
        data_dir=tmp_path, database_url=url, broker_url=DOWN_BROKER, allowed_hosts="testserver"
    )
    app = create_app(settings, session_factory=session_factory)
    with TestClient(app):  # runs the lifespan (and stops the sweeper afterwards)
        yield app


def _schema() -> Any:
    """The published schema, as /openapi.json serves it, from an app that is never started: the
    schema does not depend on its database. (Loaded through the app, its lifespan started the
    sweeper on an empty in-memory database at collection: an error logged from a thread, and a
    connection closed by the garbage collector in another.) Each case is sent to the test's own
    app (`fuzz_app`)."""
    app = create_app(Settings(database_url="sqlite://", allowed_hosts="testserver"))
    return schemathesis.openapi.from_dict(app.openapi())


schema = _schema()


@schema.parametrize()
@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_no_server_error_and_responses_match_the_schema(fuzz_app: FastAPI, case: Any) -> None:
    response = case.call(app=fuzz_app)
    operation = (case.method.upper(), case.path)
    allowed = {503} if operation in QUEUEING else set()
    assert response.status_code < 500 or response.status_code in allowed, (
        f"{case.method} {case.formatted_path} answered {response.status_code}: "
        f"{response.text[:500]}"
    )
    case.validate_response(response, checks=[response_schema_conformance])
