"""The CLI by URL: runs, rollouts, export, import and import-verl against a real uvicorn dashboard
through its API (`--url`, `--token`, or ROLLOUT_LENS_URL / ROLLOUT_LENS_TOKEN); without one, a
folder with no database says so plainly and creates nothing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from rollout_lens.server import store
from rollout_lens.server.core.config import Settings
from rollout_lens.server.exchange.export import export_chunks
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.webapp.app import create_app
from sqlalchemy.orm import Session, sessionmaker

from rollout_lens.cli import main
from tests.factories import make_run
from tests.web_support import serve_app

FULL = "full-token-0123456789abcdef"
RECORDER = "record-token-0123456789abcdef"


@pytest.fixture
def dashboard(session_factory: sessionmaker[Session]) -> Iterator[str]:
    url = session_factory.kw["bind"].url.render_as_string(hide_password=False)
    settings = Settings(database_url=url, auth_token=FULL, record_token=RECORDER, auth_read=True)
    with serve_app(create_app(settings, session_factory=session_factory)) as base:
        yield base


@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder with no database, and no ROLLOUT_LENS_* settings naming one."""
    for name in ("ROLLOUT_LENS_DATABASE_URL", "ROLLOUT_LENS_DATA_DIR", "ROLLOUT_LENS_URL"):
        monkeypatch.delenv(name, raising=False)
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    monkeypatch.chdir(folder)
    return folder


@pytest.mark.parametrize(
    "argv",
    [["runs"], ["rollouts", "1"], ["prompts", "1"], ["export", "1"], ["runs", "--format", "json"]],
)
def test_a_folder_without_a_database_says_so_and_creates_nothing(
    elsewhere: Path, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "no Rollout Lens database here" in err and "--url" in err
    assert list(elsewhere.iterdir()) == []


def test_runs_rollouts_and_export_by_url(
    session_factory: sessionmaker[Session],
    dashboard: str,
    elsewhere: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run_id = make_run(session_factory, steps=4)
    assert main(["runs", "--url", dashboard, "--format", "json"]) == 1  # reading needs a token
    assert "needs a token" in capsys.readouterr().err
    assert main(["runs", "--url", dashboard, "--token", RECORDER, "--format", "json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [r["id"] for r in listed] == [run_id]
    monkeypatch.setenv("ROLLOUT_LENS_URL", dashboard)  # the environment, as a trainer's
    monkeypatch.setenv("ROLLOUT_LENS_TOKEN", FULL)
    assert main(["runs"]) == 0
    assert "factory run 0" in capsys.readouterr().out
    assert main(["rollouts", str(run_id), "--steps", "2:3", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["step"] for r in rows} == {2, 3} and len(rows) == 16
    out = elsewhere / "run.jsonl"
    assert main(["export", str(run_id), "-o", str(out)]) == 0
    with session_scope(session_factory) as session:
        local = b"".join(export_chunks(session, run_id=run_id))
    assert out.read_bytes() == local
    assert main(["export", "999", "-o", str(elsewhere / "none.jsonl")]) == 1
    assert not (elsewhere / "none.jsonl").exists()
    assert sorted(p.name for p in elsewhere.iterdir()) == ["run.jsonl"]  # no .rollout-lens


def test_import_and_import_verl_by_url(
    session_factory: sessionmaker[Session],
    dashboard: str,
    elsewhere: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run_id = make_run(session_factory, steps=3)
    exported = elsewhere / "run.jsonl"
    with session_scope(session_factory) as session, exported.open("wb") as f:
        for chunk in export_chunks(session, run_id=run_id):
            f.write(chunk)
    argv = ["import", str(exported), "--url", dashboard, "--token", RECORDER, "--name", "moved"]
    assert main(argv) == 0
    copy_id = int(capsys.readouterr().out.split("run_id=")[1])
    damaged = elsewhere / "damaged.jsonl"
    damaged.write_bytes(exported.read_bytes()[:-40])
    assert main(["import", str(damaged), "--url", dashboard, "--token", RECORDER]) == 1
    assert "cut short" in capsys.readouterr().err

    from tests import verl_dump
    from tests.store.test_verl_import import write_step

    host = verl_dump.trainer()
    dumps = elsewhere / "rollouts"
    dumps.mkdir()
    for step in (1, 2, 3):
        write_step(host, dumps, step)
    assert main(["import-verl", str(dumps), "--url", dashboard, "--token", RECORDER]) == 0
    verl_id = int(capsys.readouterr().out.split("run_id=")[1])
    with session_scope(session_factory) as session:
        copy, verl = store.get_run(session, run_id=copy_id), store.get_run(session, run_id=verl_id)
        assert copy.name == "moved" and copy.source == "import" and copy.current_step == 3
        assert verl.source == "verl-import" and verl.current_step == 3
        assert not any("imported from a rollout-lens export" in n for n in verl.notes)
        assert len(store.list_runs(session)) == 3  # the damaged file created nothing
    follow = ["import-verl", str(dumps), "--url", dashboard, "--follow"]
    assert main(follow) == 2 and "--follow" in capsys.readouterr().err
    assert sorted(p.name for p in elsewhere.iterdir()) == ["damaged.jsonl", "rollouts", "run.jsonl"]
