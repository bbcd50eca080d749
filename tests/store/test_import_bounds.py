"""Imports refuse what they cannot hold, naming the file and line, before anything is written, on
both databases: deep nesting, numbers past the columns' range, negative steps, arrays of unequal
lengths, NaN rewards, too many series names, over-long lines and completions, links out of a
dump folder, a locked SQLite file; the callback's writer keeps a step whose names pass the cap.
A hypothesis pass mutates an export's lines: every outcome is an import or an InvalidInput."""

from __future__ import annotations

import json
import logging
import os
import re
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rollout_lens.server import store
from rollout_lens.server.core.errors import InvalidInput
from rollout_lens.server.core.records import StepRecord
from rollout_lens.server.core.vocab import MAX_SERIES_PER_RUN
from rollout_lens.server.exchange import bounds, export, importer
from rollout_lens.server.exchange.dump_import import import_dumps
from rollout_lens.server.exchange.verl_import import VerlDump
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.store.models import RunRow
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from rollout_lens.cli import main
from tests.factories import make_run

DEEP = 100_000


def _runs(factory: sessionmaker[Session]) -> int:
    with factory() as session:
        return int(session.scalar(select(func.count()).select_from(RunRow)) or 0)


@pytest.fixture
def lines(session_factory: sessionmaker[Session]) -> list[dict[str, Any]]:
    """A small run's export (2 steps × 2 rollouts) as records, the run left in the database."""
    run_id = make_run(session_factory, steps=2, group_size=2)
    with session_scope(session_factory) as session:
        data = b"".join(export.export_chunks(session, run_id=run_id, fmt="jsonl", what="rollouts"))
    return [json.loads(line) for line in data.decode().splitlines()]


def _file(tmp_path: Path, records: list[Any], *, raw: dict[int, str] | None = None) -> Path:
    """Records written as a JSONL export; `raw` replaces lines (by index) with text as given."""
    texts = [json.dumps(r, allow_nan=True) for r in records]
    for index, text in (raw or {}).items():
        texts[index] = text
    path = tmp_path / f"export-{len(list(tmp_path.glob('export-*')))}.jsonl"
    path.write_text("\n".join(texts) + "\n")
    return path


def _refused(factory: sessionmaker[Session], path: Path, says: str) -> str:
    """Import `path`: refused with InvalidInput naming the file and `says`, nothing created."""
    before = _runs(factory)
    with pytest.raises(InvalidInput) as refused:
        importer.import_export(factory, path)
    message = str(refused.value)
    assert str(path) in message and says in message, message
    assert _runs(factory) == before
    return message


def _first(records: list[dict[str, Any]], kind: str) -> int:
    return next(i for i, r in enumerate(records) if r["kind"] == kind)


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("where", ["line", "meta", "config"])
def test_deep_nesting_is_refused_naming_the_line(
    session_factory: sessionmaker[Session], tmp_path: Path, lines: list[dict[str, Any]], where: str
) -> None:
    rollout = _first(lines, "rollout")
    if where == "line":
        raw = {rollout: _nested(DEEP)}
        at = rollout
    elif where == "meta":
        text = json.dumps(lines[rollout] | {"meta": {"x": "HOLE"}}).replace('"HOLE"', _nested(DEEP))
        raw, at = {rollout: text}, rollout
    else:
        text = json.dumps(lines[0] | {"config": {"x": "HOLE"}}).replace('"HOLE"', _nested(DEEP))
        raw, at = {0: text}, 0
    path = _file(tmp_path, lines, raw=raw)
    _refused(session_factory, path, f"line {at + 1}: JSON nested more than 64 levels deep")
    shallow = json.dumps(lines[rollout] | {"meta": {"x": json.loads(_nested(60))}})
    assert importer.import_export(session_factory, _file(tmp_path, lines, raw={rollout: shallow}))


@pytest.mark.parametrize(
    ("kind", "field", "value", "says"),
    [
        ("step", "step", 10**20, "step: Input should be less than or equal to 2147483647"),
        ("step", "step", -1, "step: Input should be greater than or equal to 0"),
        ("rollout", "step", -3, "step: Input should be greater than or equal to 0"),
        ("rollout", "group", 2**40, "group: Input should be less than or equal to 2147483647"),
        ("rollout", "completion_ids", [5, 10**20], "completion_ids.1: Input should be less"),
        (
            "rollout",
            "verifier_reward",
            float("nan"),
            "verifier_reward: Value error, NaN is not a number",
        ),
        ("rollout", "advantage", float("nan"), "advantage: Value error, NaN is not a number"),
        ("rollout", "format_state", "x" * 33, "format_state: String should have at most 32"),
        ("run", "seed", 10**20, "seed: Input should be less than or equal to 2147483647"),
        ("run", "name", "n" * 201, "name: String should have at most 200 characters"),
    ],
)
def test_values_the_databases_would_refuse_are_refused_naming_the_line(
    session_factory: sessionmaker[Session],
    tmp_path: Path,
    lines: list[dict[str, Any]],
    kind: str,
    field: str,
    value: Any,
    says: str,
) -> None:
    at = _first(lines, kind)
    lines[at][field] = value
    _refused(session_factory, _file(tmp_path, lines), f"line {at + 1}: invalid {kind} record")
    _refused(session_factory, _file(tmp_path, lines), says)


def test_per_token_arrays_must_match_the_completion(
    session_factory: sessionmaker[Session], tmp_path: Path, lines: list[dict[str, Any]]
) -> None:
    at = _first(lines, "rollout")
    n = len(lines[at]["completion_ids"])
    assert n > 1
    lines[at]["completion_ids"] = lines[at]["completion_ids"] + [1, 2]
    _refused(
        session_factory,
        _file(tmp_path, lines),
        f"token_logprobs has {n} entries for {n + 2} completion_ids (one per token)",
    )
    lines[at]["completion_ids"] = lines[at]["completion_ids"][:n]
    token = next(iter(lines[at]["control_token_probs"]))
    lines[at]["control_token_probs"][token] = lines[at]["control_token_probs"][token][:-1]
    _refused(session_factory, _file(tmp_path, lines), f"control_token_probs[{token!r}] has")


def test_a_completion_past_the_token_bound_is_refused(
    session_factory: sessionmaker[Session], tmp_path: Path, lines: list[dict[str, Any]]
) -> None:
    at = _first(lines, "rollout")
    lines[at] |= {"completion_ids": [1] * (bounds.MAX_TOKENS + 1), "token_logprobs": []}
    lines[at] |= {"control_token_probs": {t: [] for t in lines[at]["control_token_probs"]}}
    lines[at]["tokens"] = None
    _refused(session_factory, _file(tmp_path, lines), "completion_ids: List should have at most")


def test_a_line_past_the_line_bound_is_refused_unread(
    session_factory: sessionmaker[Session],
    tmp_path: Path,
    lines: list[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    at = _first(lines, "rollout")
    lines[at]["completion"] = "x" * 5000
    monkeypatch.setattr(bounds, "MAX_LINE_BYTES", 4096)
    _refused(session_factory, _file(tmp_path, lines), f"line {at + 1}: longer than")


def test_series_names_past_the_cap_are_refused_at_import(
    session_factory: sessionmaker[Session], tmp_path: Path, lines: list[dict[str, Any]]
) -> None:
    steps = [i for i, r in enumerate(lines) if r["kind"] == "step"]
    lines[steps[0]]["metrics"] = {f"m/{i}": 0.5 for i in range(MAX_SERIES_PER_RUN - 10)}
    lines[steps[1]]["metrics"] = {f"n/{i}": 0.5 for i in range(11)}
    message = _refused(session_factory, _file(tmp_path, lines), f"line {steps[1] + 1}: ")
    assert f"brings the run to {MAX_SERIES_PER_RUN + 1:,} series names" in message
    lines[steps[1]]["metrics"] = {f"n/{i}": 0.5 for i in range(10)}  # exactly at the cap
    done = importer.import_export(session_factory, _file(tmp_path, lines))
    with session_scope(session_factory) as session:
        assert len(store.series_names(session, run_id=done.run_id)) == MAX_SERIES_PER_RUN


def test_the_store_keeps_a_step_whose_names_pass_the_cap(
    session_factory: sessionmaker[Session], caplog: pytest.LogCaptureFixture
) -> None:
    """What the callback's writer hands the store: names past the cap are not recorded, with one
    warning, and the rest of the step (its values, the first names) is."""
    run_id = make_run(session_factory, steps=1)
    metrics = {f"x/{i:05d}": float(i) for i in range(MAX_SERIES_PER_RUN + 500)}
    with (
        caplog.at_level(logging.WARNING, logger="rollout_lens"),
        session_scope(session_factory) as session,
    ):
        record = StepRecord(step=2, rollout_step=2, values={"reward_mean": 0.25}, metrics=metrics)
        store.record_step(session, run_id=run_id, record=record, control_tokens=())
    with session_scope(session_factory) as session:
        names = store.series_names(session, run_id=run_id)
        series = store.metric_series(session, run_id=run_id, names=["x/00000", "x/01499"])
        steps = store.steps(session, run_id=run_id)
    assert len(names) == MAX_SERIES_PER_RUN  # the factory's one name and 999 of these
    assert series == {"x/00000": [(2, 0.0)]}
    assert steps[-1].step == 2 and steps[-1].reward_mean == 0.25
    warned = [
        r.getMessage() for r in caplog.records if "series names not recorded" in r.getMessage()
    ]
    assert len(warned) == 1 and f"a run holds at most {MAX_SERIES_PER_RUN}" in warned[0]


# --- verl's folder ----------------------------------------------------------------------------


def _verl_line(step: int, i: int, **extra: Any) -> str:
    row = {"input": f"prompt {i // 2}", "output": f"answer {i}", "score": float(i % 2)}
    return json.dumps(row | {"step": step, "gts": "a"} | extra)


def _verl_folder(folder: Path, steps: int = 2) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for step in range(1, steps + 1):
        (folder / f"{step}.jsonl").write_text(
            "\n".join(_verl_line(step, i) for i in range(4)) + "\n"
        )
    return folder


def test_a_link_out_of_the_verl_folder_is_never_followed(
    session_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text(_verl_line(3, 0, secret="the worker's private key") + "\n")
    folder = _verl_folder(tmp_path / "rollouts")
    (folder / "3.jsonl").symlink_to(secret)
    with pytest.raises(InvalidInput, match="outside") as refused:
        import_dumps(session_factory, VerlDump(folder), settle=0)
    assert "3.jsonl: a link to" in str(refused.value) and _runs(session_factory) == 0
    (folder / "3.jsonl").unlink()
    (folder / "3.jsonl").symlink_to(folder / "2.jsonl")  # a link inside the folder is fine
    (folder / "3.jsonl").unlink()
    assert import_dumps(session_factory, VerlDump(folder), settle=0).steps == 2


def test_verl_lines_are_bounded_too(session_factory: sessionmaker[Session], tmp_path: Path) -> None:
    folder = _verl_folder(tmp_path / "deep")
    (folder / "2.jsonl").write_text(_verl_line(2, 0)[:-1] + ', "x": ' + _nested(DEEP) + "}\n")
    with pytest.raises(InvalidInput, match="2.jsonl line 1: JSON nested more than 64"):
        import_dumps(session_factory, VerlDump(folder), settle=0)
    folder = _verl_folder(tmp_path / "huge-step")
    (folder / f"{10**20}.jsonl").write_text(_verl_line(1, 0) + "\n")
    with pytest.raises(InvalidInput, match="step 100000000000000000000 is out of range"):
        import_dumps(session_factory, VerlDump(folder), settle=0)
    folder = _verl_folder(tmp_path / "many-keys")
    many = {f"k{i}": 1.0 for i in range(MAX_SERIES_PER_RUN + 1)}
    (folder / "2.jsonl").write_text("\n".join(_verl_line(2, i, **many) for i in range(4)) + "\n")
    with pytest.raises(InvalidInput, match="step 2: this step brings the run to"):
        import_dumps(session_factory, VerlDump(folder), settle=0)
    assert _runs(session_factory) == 0


def _trl_file(path: Path, step: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = {
        "step": [step] * 4,
        "prompt": ["p0", "p0", "p1", "p1"],
        "completion": ["a", "b", "c", "d"],
        "advantage": [0.5, -0.5, 0.5, -0.5],
        "reward": [1.0, 0.0, 1.0, 0.0],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(rows), path)


def test_links_out_of_a_trl_output_dir_are_never_followed(
    session_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    from rollout_lens.server.exchange.trl_import import TrlDump

    elsewhere = tmp_path / "elsewhere" / "completions"
    _trl_file(elsewhere / "completions_00001.parquet", 1)
    output = tmp_path / "output"
    output.mkdir()
    (output / "completions").symlink_to(elsewhere)  # the whole folder links out
    with pytest.raises(InvalidInput, match="outside"):
        import_dumps(session_factory, TrlDump(output), settle=0)
    (output / "completions").unlink()
    _trl_file(output / "completions" / "completions_00001.parquet", 1)
    (output / "completions" / "completions_00002.parquet").symlink_to(
        elsewhere / "completions_00001.parquet"
    )
    with pytest.raises(InvalidInput, match="completions_00002.parquet: a link to"):
        import_dumps(session_factory, TrlDump(output), settle=0)
    assert _runs(session_factory) == 0
    (output / "completions" / "completions_00002.parquet").unlink()
    assert import_dumps(session_factory, TrlDump(output), settle=0).steps == 1


# --- the command line: a locked SQLite file -----------------------------------------------------


def test_an_import_into_a_locked_sqlite_file_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in list(os.environ):
        if name.startswith("ROLLOUT_LENS_"):
            monkeypatch.delenv(name)
    data = tmp_path / "data"
    monkeypatch.setenv("ROLLOUT_LENS_DATA_DIR", str(data))
    monkeypatch.setenv("ROLLOUT_LENS_SQLITE_BUSY_TIMEOUT_MS", "300")
    assert main(["db", "upgrade"]) == 0
    export_file = tmp_path / "run.jsonl"
    url = f"sqlite:///{data / 'rollout-lens.db'}"
    from rollout_lens.server.store.db import make_engine, make_session_factory

    engine = make_engine(url)
    make_run(make_session_factory(engine), steps=2, group_size=2)
    engine.dispose()
    assert main(["export", "1", "-o", str(export_file)]) == 0
    capsys.readouterr()
    holder = sqlite3.connect(data / "rollout-lens.db", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another writer holds the lock
    try:
        status = main(["import", str(export_file)])
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    err = capsys.readouterr().err
    assert status == 1, err
    db = data / "rollout-lens.db"
    assert f"the database {db} is locked by another writer" in err  # said at once
    assert f"the database {db} stayed locked by another writer" in err  # and when it gave up
    assert "Traceback" not in err and "nothing was written" in err
    assert main(["import", str(export_file)]) == 0  # once the lock is free


@pytest.mark.parametrize(
    "args",
    [
        ["export", "99999999999999999999"],
        ["rollouts", "1", "--group", str(2**31)],
        ["rollouts", "1", "--steps", "1:99999999999999999999"],
        ["rollouts", "0"],
        ["import-verl", "/tmp", "--n", "-2"],
        ["import-trl", "/tmp", "--total-steps", "1" * 30],
    ],
)
def test_cli_numbers_out_of_range_are_refused_naming_the_option(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
) -> None:
    monkeypatch.setenv("ROLLOUT_LENS_DATA_DIR", str(tmp_path))
    try:
        status = main(args)
    except SystemExit as exc:  # argparse's own refusal
        status = int(exc.code or 0)
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err
    assert "from 0 to 2,147,483,647" in err or "from 1 to 2,147,483,647" in err, err


# --- a hypothesis pass over the import's lines --------------------------------------------------

_INT_EDGES = [0, -1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 10**20, -(2**63) - 1]
_FLOAT_EDGES = [float("nan"), float("inf"), float("-inf"), 1e308, -0.0, 5e-324]
_INTS = st.one_of(st.sampled_from(_INT_EDGES), st.integers(min_value=-3, max_value=50))
_FLOATS = st.one_of(st.sampled_from(_FLOAT_EDGES), st.floats(), _INTS)
_TEXTS = st.one_of(st.sampled_from(["\ud800", "\x00", "x" * 300, ""]), st.text(max_size=6))
_ANY = st.one_of(st.none(), st.booleans(), _INTS, _FLOATS, _TEXTS)


def _like(data: st.DataObject, value: Any) -> Any:
    """An odd value of the kind a field holds (so that the record still parses but for it),
    one time in four anything at all."""
    if data.draw(st.integers(min_value=0, max_value=3)) == 0:
        return data.draw(_ANY)
    if isinstance(value, bool):
        return data.draw(st.sampled_from([True, False, None]))
    if isinstance(value, int):
        return data.draw(st.one_of(st.sampled_from(_INT_EDGES), _INTS))
    if isinstance(value, float):
        return data.draw(st.one_of(st.sampled_from(_FLOAT_EDGES), _FLOATS))
    if isinstance(value, str):
        return data.draw(_TEXTS)
    if isinstance(value, list) and value:
        items = list(value)
        at = data.draw(st.integers(min_value=0, max_value=len(items)))
        odd = _like(data, items[0])
        return items[:at] + [odd] + items[at + 1 :]
    if isinstance(value, dict):
        return value | {data.draw(_TEXTS): data.draw(_ANY)}
    return data.draw(_ANY)


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_fuzzed_import_lines_are_imported_or_refused(
    session_factory: sessionmaker[Session],
    tmp_path_factory: pytest.TempPathFactory,
    lines: list[dict[str, Any]],
    data: st.DataObject,
) -> None:
    """Fields of an export's step and rollout records (and now and then its header) replaced by
    odd values of their kind: the import succeeds, or refuses with InvalidInput naming the file
    and creating nothing; never another exception."""
    records = json.loads(json.dumps(lines))  # a deep copy
    for _ in range(data.draw(st.integers(min_value=1, max_value=2))):
        record = data.draw(st.sampled_from([r for r in records if r["kind"] != "end"]))
        field = data.draw(st.sampled_from(sorted(k for k in record if k != "kind")))
        record[field] = _like(data, record[field])
    path = _file(tmp_path_factory.mktemp("fuzz"), records)
    before = _runs(session_factory)
    try:
        importer.import_export(session_factory, path)
    except InvalidInput as exc:
        message = str(exc)
        assert str(path) in message and _runs(session_factory) == before
        # where in the file, never the database's own words (it was not asked)
        assert re.search(r"line \d+: |the end record|cut short", message), message
        assert "the database refused" not in message, message
    else:
        assert _runs(session_factory) == before + 1
