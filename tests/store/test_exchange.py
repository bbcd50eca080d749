"""Export and import of whole runs: lossless round trips on SQLite and PostgreSQL, the CLI, and
damaged files that create nothing."""

from __future__ import annotations

import io
import json
import math
import os
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from rollout_lens.server import store
from rollout_lens.server.core.errors import InvalidInput, InvalidState
from rollout_lens.server.core.records import RolloutRecord, StepRecord
from rollout_lens.server.exchange import export, importer
from rollout_lens.server.store.db import make_engine, make_session_factory, session_scope
from rollout_lens.server.store.migrate import upgrade
from rollout_lens.server.store.models import RunRow, RunSource, RunStatus, by_dashboard
from rollout_lens.server.store.serialize import completion_ids, completion_text
from rollout_lens.server.webapp import queries
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from rollout_lens.cli import main
from tests.factories import CONTROL_TOKENS, make_run
from tests.web_support import client_for, parse

NAN, INF = float("nan"), float("inf")


def _odd_run(factory: sessionmaker[Session], *, status: RunStatus = RunStatus.completed) -> int:
    """A run with NaN, ±inf and None values, an empty completion, a step reusing rollouts and an
    unusual source: what a lossless round trip must carry."""
    run_id = make_run(
        factory,
        steps=3,
        group_size=4,
        source=RunSource.callback,
        notes=["no control-token probabilities under vLLM"],
        config={"lr": 3e-4, "nested": {"list": [1, None, "é"]}},
    )
    empty = RolloutRecord(
        group=0,
        index=0,
        prompt="<user>anything</user>",
        completion="",
        completion_ids=[],
        token_logprobs=[],
        control_probs={t: [] for t in CONTROL_TOKENS},
        vote=None,
        target=None,
        verifier_reward=-INF,
        true_score=None,
        advantage=INF,
        format_valid=False,
        format_state=None,
        meta={},
    )
    odd = RolloutRecord(
        group=0,
        index=1,
        prompt="<user>anything</user>",
        completion="<script>alert(1)</script> é",
        completion_ids=[7, 8, 9],
        token_logprobs=[-INF, -0.25, -1e-8],
        generator_logprobs=[NAN, -0.5, -1e-8],  # NaN: a token the generator gave none for
        control_probs=dict(
            zip(CONTROL_TOKENS, [[NAN, 0.5, INF], [0, 0, 0], [1e-30, 1, 0.1]], strict=True)
        ),
        vote="tool_01",
        target="tool_02",
        verifier_reward=0.1,
        true_score=NAN,  # stored as NULL
        advantage=-0.3333333333333333,
        format_valid=True,
        format_state="healthy_call",
        meta={"nested": {"x": [1, None, "<b>"]}, "big": 2**53, "none": None},
    )
    with session_scope(factory) as session:
        store.record_step(
            session,
            run_id=run_id,
            record=StepRecord(
                step=4,
                rollout_step=4,
                values={"reward_mean": NAN, "true_accuracy": None, "loss": INF, "kl": 1e-300},
                rollouts=[empty, odd],
                metrics={"custom/nan": NAN, "custom/x": 0.5},
            ),
            control_tokens=CONTROL_TOKENS,
        )
        store.record_step(  # GRPO reusing step 4's generation
            session,
            run_id=run_id,
            record=StepRecord(step=5, rollout_step=4, values={"loss": 0.2}),
            control_tokens=CONTROL_TOKENS,
        )
        store.mark_running(
            session,
            run_id=run_id,
            worker_host="laptop",
            device="cpu",
            control_tokens=CONTROL_TOKENS,
        )
        store.add_device_time(session, run_id=run_id, seconds=12.5, price_per_hour=2.0)
        if status != RunStatus.running:
            store.mark_finished(session, run_id=run_id, status=status)
    return run_id


def _export(
    factory: sessionmaker[Session], run_id: int, fmt: str = "jsonl", what: str = "rollouts"
) -> bytes:
    with session_scope(factory) as session:
        return b"".join(export.export_chunks(session, run_id=run_id, fmt=fmt, what=what))


def _records(data: bytes) -> list[dict[str, Any]]:
    """Export records without the ids (run id, and rollouts' run_id)."""
    records = [json.loads(line) for line in data.decode().splitlines()]
    for record in records:
        record.pop("id" if record["kind"] == "run" else "run_id", None)
    return records


def _text(records: list[dict[str, Any]]) -> list[str]:
    """Records as text: NaN compares equal to NaN."""
    return [json.dumps(r) for r in records]


def _import(factory: sessionmaker[Session], tmp_path: Path, data: bytes, fmt: str) -> int:
    path = tmp_path / f"export-{len(list(tmp_path.iterdir()))}.{fmt}"
    path.write_bytes(data)
    return importer.import_export(factory, path).run_id


@pytest.fixture
def small_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages of 2 steps and batches of 3 rollouts: every paging path runs on a small run."""
    monkeypatch.setattr(export, "STEP_PAGE", 2)
    monkeypatch.setattr(export, "ROW_GROUP", 3)
    monkeypatch.setattr(importer, "BATCH", 3)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_export_import_export_is_identical_apart_from_ids(
    session_factory: sessionmaker[Session], tmp_path: Path, fmt: str, small_batches: None
) -> None:
    source = _odd_run(session_factory)
    first = _export(session_factory, source)
    copy = _import(session_factory, tmp_path, _export(session_factory, source, fmt), fmt)
    second = _export(session_factory, copy)

    one, two = _records(first), _records(second)
    # The first import says where the copy came from; nothing else changes.
    assert two[0]["source"] == "import" and one[0]["source"] == "callback"
    assert two[0]["notes"] == [
        *one[0]["notes"],
        f"imported from a rollout-lens export of run {source} (source callback)",
    ]
    two[0] |= {"source": "callback", "notes": one[0]["notes"]}
    assert _text(two) == _text(one)

    # A copy of the copy, in a laptop's SQLite file, is identical apart from ids.
    laptop = make_engine(f"sqlite:///{tmp_path / 'laptop.db'}")
    upgrade(laptop)
    laptop_factory = make_session_factory(laptop)
    try:
        again = _import(laptop_factory, tmp_path, _export(session_factory, copy, fmt), fmt)
        assert _text(_records(_export(laptop_factory, again))) == _text(_records(second))
    finally:
        laptop.dispose()

    # What the round trip had to carry.
    kinds = [r["kind"] for r in one]
    assert (
        kinds[0] == "run"
        and kinds[-1] == "end"
        and one[-1]
        == {
            "kind": "end",
            "steps": 5,
            "rollouts": 14,
        }
    )
    assert kinds.count("step") == 5 and kinds.count("rollout") == 14
    step4 = next(r for r in one if r["kind"] == "step" and r["step"] == 4)
    assert step4["reward_mean"] is None and step4["loss"] is None and step4["kl"] == 1e-300
    assert step4["metrics"] == {"custom/nan": None, "custom/x": 0.5}
    empty, odd = [r for r in one if r["kind"] == "rollout" and r["step"] == 4]
    assert empty["completion"] == "" and empty["completion_ids"] == []
    assert empty["control_token_probs"] == {t: [] for t in CONTROL_TOKENS}
    assert empty["verifier_reward"] == -INF and empty["advantage"] == INF
    assert odd["token_logprobs"][0] == -INF and math.isnan(odd["control_token_probs"]["<tool>"][0])
    assert odd["meta"]["big"] == 2**53 and odd["true_score"] is None
    # the generator's side beside the trainer's: null where none was given, NaN kept
    assert empty["generator_logprobs"] is None
    assert math.isnan(odd["generator_logprobs"][0]) and odd["generator_logprobs"][1:] == [-0.5, 0.0]
    assert all(
        r["generator_logprobs"] is None for r in one if r["kind"] == "rollout" and r is not odd
    )


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_file_from_before_generator_logprobs_imports_without_them(
    session_factory: sessionmaker[Session], tmp_path: Path, fmt: str
) -> None:
    """An export written before the generator's logprobs existed (no such key, no such column)
    imports as it did: every rollout without them (null), nothing else changed."""
    source = _odd_run(session_factory)
    data = _export(session_factory, source, fmt)
    if fmt == "jsonl":
        lines = [json.loads(line) for line in data.decode().splitlines()]
        for record in lines:
            record.pop("generator_logprobs", None)
        data = "".join(json.dumps(r) + "\n" for r in lines).encode()
    else:
        table = pq.read_table(io.BytesIO(data))
        table = table.drop_columns(["generator_logprobs"])
        buffer = io.BytesIO()
        pq.write_table(table, buffer)
        data = buffer.getvalue()
    copy = _import(session_factory, tmp_path, data, fmt)
    records = _records(_export(session_factory, copy))
    rollouts = [r for r in records if r["kind"] == "rollout"]
    assert rollouts and all(r["generator_logprobs"] is None for r in rollouts)
    before = [r for r in _records(_export(session_factory, source)) if r["kind"] == "rollout"]
    for r in before:
        r["generator_logprobs"] = None
    assert _text(rollouts) == _text(before)


def test_the_imported_run_is_a_run_like_any_other(
    session_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    source = _odd_run(session_factory)
    copy = _import(session_factory, tmp_path, _export(session_factory, source), "jsonl")
    with session_scope(session_factory) as session:
        original, imported = (store.get_run(session, run_id=i) for i in (source, copy))
        assert imported.status == RunStatus.completed and imported.source == RunSource.import_
        assert (imported.current_step, imported.recent_reward) == (
            original.current_step,
            original.recent_reward,
        )
        # Charts read the rollups that writing each step kept.
        assert store.rollup_series(
            session, run_id=copy, names=["custom/x"], width=10
        ) == store.rollup_series(session, run_id=source, names=["custom/x"], width=10)
        texts = store.token_texts(session, run_id=copy)
        pairs = store.step_rollouts(session, run_id=copy, step=5)
        assert [completion_text(r, completion_ids(r), texts) for r, _ in pairs] == [
            "",
            "<script>alert(1)</script> é",
        ]
    with client_for(session_factory) as client:
        assert client.get(f"/runs/{copy}").status_code == 200
        step = client.get(f"/runs/{copy}/steps/4")
    assert step.status_code == 200
    assert "<script>alert(1)" not in step.text and "&lt;script&gt;alert(1)" in step.text


def test_a_run_exported_while_running_is_imported_as_lost(
    session_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    source = _odd_run(session_factory, status=RunStatus.running)
    copy = _import(session_factory, tmp_path, _export(session_factory, source), "jsonl")
    with session_scope(session_factory) as session:
        run = store.get_run(session, run_id=copy)
        assert run.status == RunStatus.lost
        assert run.error == "exported while running at step 5; this copy ends there"
        # Lost, but not resumable: its checkpoints are where it was trained.
        assert queries.run_live(session, run_id=copy)["can_resume"] is False
        with pytest.raises(InvalidState, match="not launched here"):
            store.requeue_for_resume(session, run_id=copy)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_the_export_carries_who_ended_the_run(
    session_factory: sessionmaker[Session], tmp_path: Path, fmt: str
) -> None:
    """runs.ended_by goes out with the run and comes back with the import (the run page says
    who stopped it); a file written before it was carried imports with none."""
    who = by_dashboard("token 1a2b3c4d")
    source = _odd_run(session_factory, status=RunStatus.running)
    with session_scope(session_factory) as session:
        store.mark_finished(session, run_id=source, status=RunStatus.cancelled, ended_by=who)
    data = _export(session_factory, source, fmt)
    copy = _import(session_factory, tmp_path, data, fmt)
    with session_scope(session_factory) as session:
        run = store.get_run(session, run_id=copy)
        assert (run.status, run.ended_by) == (RunStatus.cancelled, who)
    assert _records(_export(session_factory, copy))[0]["ended_by"] == who
    with client_for(session_factory) as client:
        page = parse(client.get(f"/runs/{copy}").text)
    assert page.find("dd", data_field="ended_by").text == who

    header, *rest = _export(session_factory, source).splitlines(keepends=True)
    older = json.loads(header)  # as an export written before ended_by was carried
    del older["ended_by"]
    copy = _import(
        session_factory, tmp_path, b"".join([json.dumps(older).encode(), b"\n", *rest]), "jsonl"
    )
    with session_scope(session_factory) as session:
        run = store.get_run(session, run_id=copy)
        assert (run.status, run.ended_by) == (RunStatus.cancelled, None)


def test_the_steps_export_has_a_row_per_step_and_a_column_per_series(
    session_factory: sessionmaker[Session], small_batches: None
) -> None:
    run_id = _odd_run(session_factory)
    frame = pq.read_table(io.BytesIO(_export(session_factory, run_id, "parquet", "steps")))
    rows = frame.to_pylist()
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert {"reward_mean", "loss", "custom/x", "ctrl/</assistant>/max"} <= set(frame.column_names)
    assert rows[3]["custom/x"] == 0.5 and rows[3]["loss"] is None and rows[0]["custom/x"] is None
    assert str(frame.schema.field("recorded_at").type) == "timestamp[us, tz=UTC]"

    csv_lines = _export(session_factory, run_id, "csv", "steps").decode().splitlines()
    assert csv_lines[0].startswith("step,rollout_step,recorded_at,reward_mean")
    assert len(csv_lines) == 6 and csv_lines[5].startswith("5,4,")
    jsonl = [json.loads(x) for x in _export(session_factory, run_id, "jsonl", "steps").splitlines()]
    assert [r["rollout_step"] for r in jsonl] == [1, 2, 3, 4, 4]


def _count_runs(factory: sessionmaker[Session]) -> int:
    with session_scope(factory) as session:
        return int(session.scalar(select(func.count()).select_from(RunRow)) or 0)


def _damaged(good: bytes) -> dict[str, bytes]:
    lines = good.decode().splitlines(keepends=True)
    rollout = next(i for i, line in enumerate(lines) if '"kind":"rollout"' in line)
    bad_value = json.loads(lines[rollout]) | {"advantage": "high"}
    return {
        "empty": b"",
        "not JSON": ("".join(lines[:rollout]) + "{not json\n" + "".join(lines[rollout:])).encode(),
        "cut short": "".join(lines[:-3]).encode(),
        "a bad value": (
            "".join(lines[:rollout]) + json.dumps(bad_value) + "\n" + "".join(lines[rollout + 1 :])
        ).encode(),
        "a repeated rollout": ("".join(lines[: rollout + 1]) + "".join(lines[rollout:])).encode(),
        "an unknown status": good.replace(b'"status":"queued"', b'"status":"paused"', 1),
        "a steps export": b'{"step":1,"rollout_step":1}\n',
        "a corrupt parquet": b"PAR1" + b"\x00" * 64,
    }


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("empty", "empty file"),
        ("not JSON", "not valid JSON"),
        ("cut short", "ends before its end record"),
        ("a bad value", "advantage: Input should be a valid number"),
        ("a repeated rollout", "repeated or out of order"),
        ("an unknown status", "line 1: invalid run record: status: Input should be 'queued'"),
        ("a steps export", "not a record"),
        ("a corrupt parquet", "not a readable Parquet file"),
    ],
)
def test_a_damaged_file_creates_nothing(
    session_factory: sessionmaker[Session], tmp_path: Path, case: str, message: str
) -> None:
    run_id = make_run(session_factory, steps=3, group_size=2)
    path = tmp_path / "damaged.jsonl"
    path.write_bytes(_damaged(_export(session_factory, run_id))[case])
    with pytest.raises(InvalidInput, match=message) as raised:
        importer.import_export(session_factory, path)
    assert str(path) in str(raised.value)
    assert _count_runs(session_factory) == 1


# --- the command line ---------------------------------------------------------------------------


@pytest.fixture
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """ROLLOUT_LENS_DATA_DIR for in-process CLI calls, with a migrated SQLite database."""
    folder = tmp_path / "data"
    for name in list(os.environ):
        if name.startswith("ROLLOUT_LENS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("ROLLOUT_LENS_DATA_DIR", str(folder))
    assert main(["db", "upgrade"]) == 0
    return folder


def _factory(data_dir: Path) -> sessionmaker[Session]:
    return make_session_factory(make_engine(f"sqlite:///{data_dir / 'rollout-lens.db'}"))


def test_cli_exports_and_imports(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    factory = _factory(data_dir)
    source = _odd_run(factory)
    for fmt in ("jsonl", "parquet"):
        out = tmp_path / f"run.{fmt}"
        assert main(["export", str(source), "--format", fmt, "-o", str(out)]) == 0
        assert main(["import", str(out), "--name", f"copy {fmt}"]) == 0
        printed = capsys.readouterr().out
        assert "5 steps, 14 rollouts" in printed
        copy = int(printed.split("run_id=")[1])
        with session_scope(factory) as session:
            assert store.get_run(session, run_id=copy).name == f"copy {fmt}"
    assert (
        main(
            [
                "export",
                str(source),
                "--what",
                "steps",
                "--format",
                "csv",
                "-o",
                str(tmp_path / "s.csv"),
            ]
        )
        == 0
    )
    assert (tmp_path / "s.csv").read_text().count("\n") == 6
    capsys.readouterr()
    assert main(["export", str(source)]) == 0  # to stdout
    assert capsys.readouterr().out.startswith('{"kind":"run"')


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["import", "/no/such/file.jsonl"], "no such file"),
        (["export", "99"], "run 99 does not exist"),
        (["export", "1", "--format", "csv"], "rollouts export as jsonl or parquet"),
        (["export", "1", "--format", "xml"], "invalid choice"),
        (["import-trl", "/no/such/dir"], "no such directory"),
    ],
)
def test_cli_bad_input_fails_clearly(
    data_dir: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    make_run(_factory(data_dir), steps=1)
    try:
        status = main(args)
    except SystemExit as exc:  # argparse's own refusals
        status = int(exc.code or 0)
    assert status == 2
    assert message in capsys.readouterr().err
    assert _count_runs(_factory(data_dir)) == 1


def test_cli_import_of_a_damaged_file_fails_clearly(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    factory = _factory(data_dir)
    run_id = make_run(factory, steps=2)
    good = tmp_path / "good.jsonl"
    assert main(["export", str(run_id), "-o", str(good)]) == 0
    lines = good.read_text().splitlines(keepends=True)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(lines[:3]) + lines[3][:40] + "\n" + "".join(lines[4:]))
    assert main(["import", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"rollout-lens: error: {bad}: line 4: not valid JSON" in err
    assert _count_runs(factory) == 1


FORMULAS = [
    '=HYPERLINK("http://evil.example","x")',
    "@SUM(A1:A9)",
    "+1+1",
    "-2+3",
    "\tcmd",
    "\rcmd",
]


def test_the_steps_csv_neutralises_formulas(session_factory: sessionmaker[Session]) -> None:
    """Metric names a spreadsheet would run as formulas are text in the download (OWASP: a
    leading `'`); negative numbers stay numbers."""
    import csv

    from tests.factories import record_step

    run_id = make_run(session_factory, steps=0)
    metrics: dict[str, float | None] = {name: -0.5 for name in FORMULAS}
    record_step(session_factory, run_id, 1, values={"loss": -1.25}, metrics=metrics)
    client = client_for(session_factory)
    response = client.get(f"/api/runs/{run_id}/export?format=csv&what=steps")
    assert response.status_code == 200
    header, row = list(csv.reader(io.StringIO(response.text, newline="")))
    by_name = dict(zip(header, row, strict=True))
    for name in FORMULAS:
        assert by_name["'" + name] == "-0.5"
    assert by_name["loss"] == "-1.25"
    assert not [cell for cell in header + row if cell[:1] in ("=", "@", "+", "\t", "\r")]
