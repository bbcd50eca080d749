"""A busy dashboard (every write slot held, as by other trainers' bodies) answers a body of
steps or an export file 503 before reading it: the app pulls none of its bytes, against the real
app under uvicorn. A free slot reads it whole; a body past the cap is a 413 as it streams."""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import pytest
from rollout_lens.server.core.config import Settings
from rollout_lens.server.webapp.app import create_app
from sqlalchemy.orm import Session, sessionmaker

from bench.busy_body import Counted
from tests.factories import CONTROL_TOKENS
from tests.web_support import serve_app

RECORDER = "record-token-0123456789abcdef"
CAP_MB = 8


@pytest.fixture
def served(session_factory: sessionmaker[Session]) -> Iterator[tuple[Counted, str]]:
    url = session_factory.kw["bind"].url.render_as_string(hide_password=False)
    settings = Settings(database_url=url, record_token=RECORDER, record_max_mb=CAP_MB)
    counted = Counted(create_app(settings, session_factory=session_factory))
    with serve_app(counted) as base:
        yield counted, base


@pytest.mark.parametrize("engine", ["sqlite"], indirect=True)
def test_a_busy_dashboard_refuses_a_body_without_reading_it(
    served: tuple[Counted, str],
) -> None:
    counted, base = served
    headers = {"authorization": f"Bearer {RECORDER}"}
    body = os.urandom(CAP_MB * 2**20 - 1024)  # within the cap: only the slots refuse it
    with httpx.Client(base_url=base, headers=headers, timeout=60) as http:
        spec = {"key": "busy-key-0001", "name": "busy", "control_tokens": CONTROL_TOKENS}
        run_id = http.post("/api/record/runs", json=spec).json()["id"]
        steps = f"/api/record/runs/{run_id}/steps"
        slots = counted.app.state.ingest.writing
        held = [slots.acquire(blocking=False) for _ in range(8)]
        try:
            for path in (steps, "/api/record/import"):
                counted.read = 0
                busy = http.post(path, content=body)
                assert busy.status_code == 503 and busy.headers["retry-after"] == "1", busy.text
                assert counted.read == 0, path
        finally:
            for taken in held:
                if taken:
                    slots.release()
        counted.read = 0
        free = http.post(steps, content=body)  # read whole, then refused by the wire
        assert free.status_code == 422 and counted.read == len(body), free.text
        counted.read = 0
        too_big = http.post(steps, content=iter([body, body]))  # chunked: no Content-Length
        assert too_big.status_code == 413 and "larger than" in too_big.json()["detail"]
        assert counted.read <= len(body) + 2**20
        assert slots.acquire(blocking=False) and slots.acquire(blocking=False)  # none leaked
        slots.release()
        slots.release()
