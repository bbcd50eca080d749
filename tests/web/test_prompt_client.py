"""The prompt lens from Python and the shell: Client.prompts and Client.prompt_history as
DataFrames, and `rollout-lens prompts RUN` on the local database and by --url, against the
brute-force oracle over the rollouts, on a real uvicorn dashboard."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from rollout_lens.server.core.config import Settings
from rollout_lens.server.webapp.app import create_app
from sqlalchemy.orm import Session, sessionmaker

from rollout_lens import Client
from rollout_lens.cli import main
from tests.follow_support import use_database
from tests.prompt_lens_support import FIGURES, SCHEDULES, looks, oracle, schedule_run
from tests.web_support import serve_app

TOKEN = "full-token-0123456789abcdef"


@pytest.fixture
def dashboard(session_factory: sessionmaker[Session]) -> Iterator[str]:
    url = session_factory.kw["bind"].url.render_as_string(hide_password=False)
    settings = Settings(database_url=url, auth_token=TOKEN, auth_read=True)
    with serve_app(create_app(settings, session_factory=session_factory)) as base:
        yield base


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and abs(float(a) - float(b)) < 1e-9  # type: ignore[arg-type]
    return a == b


def test_the_client_reads_prompts_and_a_history_as_dataframes(
    session_factory: sessionmaker[Session], dashboard: str
) -> None:
    pd = pytest.importorskip("pandas")
    run_id = schedule_run(session_factory, steps=6)
    want = oracle(session_factory, run_id)
    with Client(dashboard, token=TOKEN) as lens:
        frame = lens.prompts(run_id)
        stuck = lens.prompts(run_id, look="stuck")
        first = lens.prompts(run_id, sort="flips", order="desc", max_rows=1)
        some = next(iter(want))
        history = lens.prompt_history(run_id, some)
    assert isinstance(frame, pd.DataFrame) and len(frame) == len(SCHEDULES)
    for row in frame.to_dict("records"):
        for name in FIGURES:
            got, expected = row[name], want[row["prompt_id"]][name]
            if expected is None:
                assert got is None or pd.isna(got), (name, row)
            else:
                assert _same(got, expected), (name, row)
    assert set(stuck["prompt_id"]) == {i for i, p in want.items() if "stuck" in looks(p)}
    assert len(first) == 1 and first["flips"].iloc[0] == max(p["flips"] for p in want.values())
    assert list(zip(history["step"], history["group"], strict=True)) == [
        (g["step"], g["group"]) for g in want[some]["history"]
    ]
    assert list(history["rollout_ids"]) == [g["rollout_ids"] for g in want[some]["history"]]


def test_the_client_without_pandas_gives_records(
    session_factory: sessionmaker[Session], dashboard: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_id = schedule_run(session_factory, steps=2)
    monkeypatch.setitem(sys.modules, "pandas", None)  # `import pandas` now fails
    with Client(dashboard, token=TOKEN) as lens:
        rows = lens.prompts(run_id)
        steps = lens.prompt_history(run_id, rows[0]["prompt_id"])
    assert isinstance(rows, list) and len(rows) == len(SCHEDULES)
    assert isinstance(steps, list) and {s["step"] for s in steps} <= {1, 2}


def test_the_prompts_command_here_and_by_url(
    session_factory: sessionmaker[Session],
    dashboard: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run_id = schedule_run(session_factory, steps=6)
    want = oracle(session_factory, run_id)
    never = {i for i, p in want.items() if "never_solved" in looks(p)}
    use_database(monkeypatch, session_factory, tmp_path)
    remote = ["--url", dashboard, "--token", TOKEN]
    answers = []
    for where in ([], remote):
        assert main(["prompts", str(run_id), "--format", "json", "--limit", "3", *where]) == 0
        rows = json.loads(capsys.readouterr().out)
        assert [r["prompt_id"] for r in rows] == sorted(
            want, key=lambda i: (want[i]["first_step"], i)
        )[:3]
        assert main(["prompts", str(run_id), "--look", "never_solved", "--jsonl", *where]) == 0
        lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert {r["prompt_id"] for r in lines} == never
        assert all(r["prompt"][-1]["role"] == "user" for r in lines)
        answers.append((rows, lines))
    assert answers[0] == answers[1]  # the local database and the API say the same
    assert main(["prompts", str(run_id), "--sort", "flips", "--order", "desc"]) == 0
    table = capsys.readouterr().out
    assert table.startswith(f"{len(want)} of {len(want)} prompts")
    assert "what does alternating need?" in table.splitlines()[2]  # the most flips first
    for where in ([], remote):
        assert main(["prompts", "999", *where]) != 0
        assert "run 999 does not exist" in capsys.readouterr().err
