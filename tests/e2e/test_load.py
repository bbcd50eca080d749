"""bench/load.py in its quick form: a real `rollout-lens serve`, a recorder process writing a
step every 100 ms and 10 concurrent clients for 10 s, on SQLite and PostgreSQL. It asserts that
nothing failed (no error, no "database is locked", every step written), not how fast it was:
bench/load.py prints the figures."""

from __future__ import annotations

import pytest

from bench.load import ENDPOINTS, load_on

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "database", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def test_quick_load_has_no_errors(database: str) -> None:
    from bench.faults import PG_URL

    result = load_on(database, clients=10, seconds=8, interval=0.1, pg_url=PG_URL, small=True)
    failures = [e for s in result.endpoints.values() for e in s.errors]
    assert failures == [] and result.server_log_errors == [], (failures, result.server_log_errors)
    assert result.writer["errors"] == [] and result.locked == 0
    assert result.writer["steps"] >= 40  # ~80 steps at 100 ms; the recorder was not stalled
    for endpoint in ENDPOINTS:  # every client got through each page, more than once
        assert len(result.endpoints[endpoint].client_ms) >= 10, endpoint
