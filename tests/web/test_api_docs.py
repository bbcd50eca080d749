"""The API as a client reads it: times with their zone, a 422 that names unknown series, and an
OpenAPI schema with readable operation names and response schemas, under a /docs that leads back."""

from __future__ import annotations

from datetime import datetime

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from tests.factories import make_run
from tests.web_support import parse


def test_api_times_carry_their_zone(
    session_factory: sessionmaker[Session], client: TestClient
) -> None:
    run_id = make_run(session_factory, steps=2)
    run = client.get(f"/api/runs/{run_id}").json()["run"]
    for key in ("created_at", "heartbeat_at"):
        moment = datetime.fromisoformat(run[key])
        assert moment.utcoffset() is not None and moment.utcoffset().total_seconds() == 0, run[key]
    listed = client.get("/api/runs").json()["runs"][0]
    assert listed["created_at"].endswith("+00:00")


def test_unknown_series_are_a_422_that_names_them_and_the_known_ones(
    session_factory: sessionmaker[Session], client: TestClient
) -> None:
    run_id = make_run(session_factory, steps=2)
    response = client.get(f"/api/runs/{run_id}/series?names=reward_mean,nonexistent,also_not")
    assert response.status_code == 422
    body = response.json()
    assert "unknown series nonexistent, also_not" in body["detail"]
    assert "this run has reward_mean, true_accuracy" in body["detail"]
    assert body["errors"][0]["loc"] == ["query", "names"]
    assert body["errors"][0]["input"] == ["nonexistent", "also_not"]
    # Known names, and series the run's config promises before their first point, are fine.
    assert client.get(f"/api/runs/{run_id}/series?names=reward_mean").status_code == 200


def test_openapi_operations_have_readable_names_and_response_schemas(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    operations = [
        (method, path, op) for path, ops in spec["paths"].items() for method, op in ops.items()
    ]
    assert len(operations) >= 14
    for method, path, op in operations:
        summary = op["summary"]
        assert not summary.endswith(" Api") and summary[:1].isupper() and " " in summary, (
            method,
            path,
            summary,
        )
        if path == "/api/runs/{run_id}/export":
            continue  # a file download (JSON Lines or Parquet)
        if path.endswith(".jsonl"):  # a dataset, a step's rollouts: JSON Lines
            assert op["responses"]["200"]["content"]["application/x-ndjson"]["schema"]
            continue
        ok = op["responses"].get("200") or op["responses"]["201"]
        assert ok["content"]["application/json"]["schema"], (method, path)
    summaries = {op["summary"] for _, _, op in operations}
    assert {"Launch runs", "Delete a run", "List runs", "Get a run's chart series"} <= summaries
    run = spec["components"]["schemas"]["Run"]["properties"]
    assert "UTC" in run["created_at"]["description"]


def test_the_api_docs_lead_back_to_the_dashboard(client: TestClient) -> None:
    page = parse(client.get("/docs").text)
    assert page.by_id("back-to-dashboard").attrs["href"] == "/"
