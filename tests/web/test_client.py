"""The Python client and the download route, against a live `rollout-lens serve`."""

from __future__ import annotations

import io
import json
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest
from rollout_lens.server import store
from rollout_lens.server.exchange import export
from rollout_lens.server.store.db import make_engine, make_session_factory, session_scope
from rollout_lens.server.store.migrate import upgrade
from rollout_lens.server.store.serialize import rollout_dict, step_dict

from rollout_lens import Client
from rollout_lens.client import ROLLOUT_KEYS, ClientError
from tests.factories import make_run
from tests.web_support import loopback

ROOT = Path(__file__).resolve().parents[2]
STEPS = 30  # enough rollouts for an export of several chunks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, int]]:
    """(base URL, database URL, run id): a dashboard serving an SQLite file with one run."""
    data = tmp_path_factory.mktemp("served")
    database = f"sqlite:///{data / 'rollout-lens.db'}"
    engine = make_engine(database)
    upgrade(engine)
    run_id = make_run(make_session_factory(engine), steps=STEPS, name="served run")
    engine.dispose()
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_LENS_")} | {
        "PYTHONPATH": str(ROOT),
        "ROLLOUT_LENS_DATA_DIR": str(data),
        # A broker that is never asked for anything: serve starts no local worker.
        "ROLLOUT_LENS_BROKER_URL": "redis://127.0.0.1:1/0",
    }
    with subprocess.Popen(
        [sys.executable, "-m", "rollout_lens", "serve", "--port", str(port)],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as proc:
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    loopback("GET", f"{base}/api/runs", timeout=1).raise_for_status()
                    break
                except httpx.HTTPError:
                    assert proc.poll() is None, proc.communicate()[0]
                    assert time.monotonic() < deadline, "the server did not start"
                    time.sleep(0.1)
            yield base, database, run_id
        finally:
            proc.terminate()
            proc.communicate(timeout=30)


def _read_db(database: str):  # type: ignore[no-untyped-def]
    engine = make_engine(database)
    return engine, make_session_factory(engine)


def test_runs_and_run(served: tuple[str, str, int]) -> None:
    base, _, run_id = served
    with Client(base) as lens:
        assert [(r["id"], r["name"]) for r in lens.runs()] == [(run_id, "served run")]
        run = lens.run(run_id)
    assert run["name"] == "served run" and run["current_step"] == STEPS
    assert run["last_step"] == STEPS and "reward_mean" in run["series_names"]


def test_series_is_a_dataframe_by_step_with_every_step(served: tuple[str, str, int]) -> None:
    pytest.importorskip("pandas")  # the optional `pandas` extra (the train extra brings it)
    base, database, run_id = served
    engine, factory = _read_db(database)
    with session_scope(factory) as session:
        steps = [step_dict(s) for s in store.steps(session, run_id=run_id)]
        metric = store.metric_series(session, run_id=run_id)["ctrl/</assistant>/max"]
    engine.dispose()
    with Client(base) as lens:
        frame = lens.series(run_id)
        picked = lens.series(run_id, names=["reward_mean", "ctrl/</assistant>/max"])
    assert frame.index.name == "step" and list(frame.index) == list(range(1, STEPS + 1))
    assert list(frame["reward_mean"]) == [s["reward_mean"] for s in steps]
    assert list(frame["ctrl/</assistant>/max"]) == [v for _, v in metric]
    assert list(picked.columns) == ["reward_mean", "ctrl/</assistant>/max"]


def test_series_without_pandas_is_a_list_of_records(
    served: tuple[str, str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    base, _, run_id = served
    monkeypatch.setitem(sys.modules, "pandas", None)  # `import pandas` now fails
    with Client(base) as lens:
        rows = lens.series(run_id, names=["loss"])
        with pytest.raises(ClientError, match="has no series nonsense"):
            lens.series(run_id, names=["nonsense"])
    assert isinstance(rows, list) and len(rows) == STEPS
    assert set(rows[0]) == {"step", "loss"} and rows[0]["step"] == 1


def test_an_unknown_series_is_the_apis_error_with_its_status(served: tuple[str, str, int]) -> None:
    """The client finds unknown names itself (it reads the export): its error carries the
    status the API answers the same names with, not None, and is importable from the package."""
    import httpx

    from rollout_lens import ClientError as PublicClientError

    base, _, run_id = served
    api = httpx.get(f"{base}/api/runs/{run_id}/series", params={"names": "nonsense"})
    with Client(base) as lens, pytest.raises(PublicClientError) as caught:
        lens.series(run_id, names=["nonsense"])
    assert PublicClientError is ClientError
    assert api.status_code >= 400 and caught.value.status == api.status_code
    assert "nonsense" in api.text and "nonsense" in str(caught.value)


def test_rollouts_of_a_step(served: tuple[str, str, int]) -> None:
    base, database, run_id = served
    engine, factory = _read_db(database)
    with session_scope(factory) as session:
        tokens = list(store.get_run(session, run_id=run_id).control_tokens)
        pairs = store.step_rollouts(session, run_id=run_id, step=2)
        texts = store.token_texts(session, run_id=run_id)
        expected = [rollout_dict(r, p, tokens, texts) for r, p in pairs]
    engine.dispose()
    with Client(base) as lens:
        got = lens.step_rollouts(run_id, 2)
    assert [tuple(r) for r in got] == [ROLLOUT_KEYS] * len(expected)
    assert json.dumps(got) == json.dumps(expected)


@pytest.mark.parametrize(
    ("fmt", "what"), [("jsonl", "rollouts"), ("parquet", "rollouts"), ("csv", "steps")]
)
def test_export_downloads_what_the_cli_writes(
    served: tuple[str, str, int], tmp_path: Path, fmt: str, what: str
) -> None:
    base, database, run_id = served
    engine, factory = _read_db(database)
    with session_scope(factory) as session:
        expected = b"".join(export.export_chunks(session, run_id=run_id, fmt=fmt, what=what))
    engine.dispose()
    with Client(base) as lens:
        path = lens.export(run_id, tmp_path / f"run.{fmt}", format=fmt, what=what)
    got = path.read_bytes()
    if fmt == "parquet":
        mine, theirs = pq.read_table(io.BytesIO(got)), pq.read_table(io.BytesIO(expected))
        assert mine.equals(theirs) and mine.schema.metadata == theirs.schema.metadata
    else:
        assert got == expected


def test_the_download_route_streams_an_attachment(served: tuple[str, str, int]) -> None:
    base, _, run_id = served
    with httpx.stream("GET", f"{base}/api/runs/{run_id}/export", params={"format": "jsonl"}) as r:
        chunks = list(r.iter_raw())
        headers = r.headers
    assert r.status_code == 200
    assert headers["content-disposition"] == (
        f'attachment; filename="rollout-lens-run-{run_id}-rollouts.jsonl"'
    )
    assert headers["content-type"].startswith("application/x-ndjson")
    assert "content-length" not in headers and headers["transfer-encoding"] == "chunked"
    assert len(chunks) > 1  # handed out as it was read, not built whole
    body = b"".join(chunks).decode().splitlines()
    assert json.loads(body[-1]) == {"kind": "end", "steps": STEPS, "rollouts": STEPS * 8}


def test_the_run_page_links_the_downloads(served: tuple[str, str, int]) -> None:
    base, _, run_id = served
    page = httpx.get(f"{base}/runs/{run_id}").text
    for query in ("format=jsonl", "format=parquet", "format=csv&amp;what=steps"):
        assert f'href="/api/runs/{run_id}/export?{query}' in page
    link = f"{base}/api/runs/{run_id}/export?format=parquet&what=steps"
    table = pq.read_table(io.BytesIO(httpx.get(link).content))
    assert table.num_rows == STEPS and "reward_mean" in table.column_names


def test_errors_carry_the_servers_message(served: tuple[str, str, int], tmp_path: Path) -> None:
    base, _, run_id = served
    with Client(base, token="secret") as lens:
        assert lens._http.headers["authorization"] == "Bearer secret"
        with pytest.raises(ClientError, match="404: run 999 does not exist") as missing:
            lens.run(999)
        assert missing.value.status == 404
        with pytest.raises(ClientError, match="400: rollouts export as jsonl or parquet"):
            lens.export(run_id, tmp_path / "x.csv", format="csv")
        with pytest.raises(ClientError, match="422: invalid request: format"):
            lens.export(run_id, tmp_path / "x.xml", format="xml")
    assert not list(tmp_path.iterdir())  # no file for a refused download
    with (
        Client(f"http://127.0.0.1:{_free_port()}") as nowhere,
        pytest.raises(
            ClientError, match="cannot reach Rollout Lens at http://127.0.0.1:.*ConnectError"
        ) as unreachable,
    ):
        nowhere.runs()
    assert unreachable.value.status is None


def test_rollouts_of_a_step_of_many_groups_come_in_one_request(tmp_path: Path) -> None:
    """A step of 502 groups (past one page of the step's groups), the first of 70 rollouts (past
    one page of a group's rollouts) and of 300 tokens each (past the group JSON's default cut):
    Client.step_rollouts reads them all, in group order, with every array, in one request."""
    from rollout_lens.server.core.config import Settings
    from rollout_lens.server.core.records import RolloutRecord
    from rollout_lens.server.webapp.app import create_app

    from tests.factories import make_groups, record_step
    from tests.web_support import serve_app

    database = f"sqlite:///{tmp_path / 'groups.db'}"
    engine = make_engine(database)
    upgrade(engine)
    factory = make_session_factory(engine)
    run_id = make_run(factory, steps=0, name="many groups")
    rng = random.Random(11)
    big = make_groups(rng, groups=1, group_size=70, tokens=300)
    small: list[RolloutRecord] = []
    for g in range(1, 502):
        (one,) = make_groups(rng, groups=1, group_size=1)
        one.group = g
        small.append(one)
    record_step(factory, run_id, 1, values={"reward_mean": 0.5}, rollouts=big + small)
    with session_scope(factory) as session:
        tokens = list(store.get_run(session, run_id=run_id).control_tokens)
        pairs = store.step_rollouts(session, run_id=run_id, step=1)
        texts = store.token_texts(session, run_id=run_id)
        expected = [rollout_dict(r, p, tokens, texts) for r, p in pairs]
    app = create_app(Settings(database_url=database, data_dir=tmp_path), session_factory=factory)
    with serve_app(app) as base, Client(base) as lens:
        got = lens.step_rollouts(run_id, 1)
    engine.dispose()
    assert len(got) == 70 + 501 and [(r["group"], r["index"]) for r in got[:3]] == [
        (0, 0),
        (0, 1),
        (0, 2),
    ]
    assert json.dumps(got) == json.dumps(expected)
