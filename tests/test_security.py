"""Safe on a team server: range checks, headers, cross-site refusal, CSRF, tokens, deletion."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tests.factories import make_run

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


def test_in_range_ids_still_work(client: TestClient, session_factory) -> None:  # type: ignore[no-untyped-def]
    run_id = make_run(session_factory, steps=3, seed=1)
    assert client.get(f"/api/runs/{run_id}/series?since=2147483647").status_code == 200
    assert client.get("/api/runs/2147483647").status_code == 404
