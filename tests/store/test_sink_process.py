"""A script's and a launched run's database writes from a process of their own
(trainer/recorder/sink_process.py): the same run as before, the answers and log lines as they
were, a light child that a Ctrl-C does not end, and a child that dies stops a script's recording,
not its training (a launched run fails)."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import pytest
from rollout_lens.server import store
from rollout_lens.server.core.records import StepRecord
from rollout_lens.server.store.db import make_engine, make_session_factory, session_scope
from rollout_lens.trainer.recorder import sink_process
from rollout_lens.trainer.recorder.sink_process import ProcessSink
from rollout_lens.trainer.recorder.sinks import SqlSink
from rollout_lens.trainer.recorder.writer import StepWriter

from tests.factories import CONTROL_TOKENS, load_run, recorder_spec, script_writer, seeded_step
from tests.waiting import until


def _step(step: int) -> StepRecord:
    return seeded_step(step, group_size=8)


def _writer(url: str, **kw: object) -> StepWriter:
    writer: StepWriter = script_writer(url, "child", total_steps=5, process=True, **kw)
    return writer


def _started(writer: StepWriter) -> int | None:
    """The pid of the writer's child, None until it has started."""
    sink = writer.sink
    assert isinstance(sink, ProcessSink)
    child = sink._child  # noqa: SLF001
    return None if child is None else child.pid


def _child(writer: StepWriter) -> int:
    pid = _started(writer)
    assert pid is not None
    return pid


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat").read_text().split()[2]
    return status != "Z"  # a zombie has exited


def test_a_scripts_steps_are_written_by_a_child_that_ends_with_the_run(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="rollout_lens")
    writer = _writer(sqlite_url)
    writer.put(_step(1))
    until(lambda: writer.written_steps == 1, "step 1")
    pid = _child(writer)
    assert pid != os.getpid() and _alive(pid)
    maps = Path(f"/proc/{pid}/maps").read_text()
    assert "libtorch" not in maps and "sqlite" in maps  # the store's stack, not the trainer's
    assert os.getsid(pid) != os.getsid(0)  # a terminal's Ctrl-C reaches the script alone
    os.kill(pid, signal.SIGINT)  # ... and one sent to it anyway is ignored
    for step in (2, 3):
        writer.put(_step(step))
    assert writer.close() is True
    assert not _alive(pid)
    run, rows, steps, _ = load_run(sqlite_url, writer.run_id)
    assert [s.step for s in steps] == [1, 2, 3] and len(rows) == 24
    assert run.status == "completed"
    # the child's log lines are the script's
    assert f"Rollout Lens: recording run {writer.run_id} (child)" in caplog.text


def test_a_scripts_child_starts_with_its_writer_and_makes_the_run_at_its_first_step(
    sqlite_url: str,
) -> None:
    """The child starts as the writer does, before the first step is put (its imports under
    way); the run is created at the first step, not before training writes one."""
    writer = _writer(sqlite_url)
    pid = until(lambda: _started(writer), "the writer's child")
    until(lambda: _imported(pid), "the child's imports")
    assert writer.run_id is None and _runs(sqlite_url) == 0
    writer.put(_step(1))
    until(lambda: writer.written_steps == 1, "step 1")
    assert _child(writer) == pid and _runs(sqlite_url) == 1
    assert writer.close() is True
    assert not _alive(pid)


def test_a_sink_closed_before_it_opened_leaves_no_child_and_no_run(sqlite_url: str) -> None:
    """A started child that never made its sink (the writer stopped before its first write)
    ends when the sink closes; nothing was created."""
    sink = sink_process.script_sink(
        sqlite_url, recorder_spec("unopened", total_steps=2), process=True, price=0.0,
        wait_ms=1000, resume=None,
    )  # fmt: skip
    assert isinstance(sink, ProcessSink)
    sink.start()
    child = sink._child  # noqa: SLF001
    assert child is not None
    until(lambda: _imported(child.pid), "the child's imports")
    sink.close()
    assert child.poll() == 0 and sink.run_id is None and _runs(sqlite_url) == 0


def _imported(pid: int) -> bool:
    """The child has loaded the store's compiled parts (zstandard's), its imports well along."""
    return "zstandard" in Path(f"/proc/{pid}/maps").read_text()


def _runs(url: str) -> int:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            tables = conn.exec_driver_sql("SELECT name FROM sqlite_master WHERE name = 'runs'")
            if tables.first() is None:
                return 0
            return int(conn.exec_driver_sql("SELECT count(*) FROM runs").scalar_one())
    finally:
        engine.dispose()


def test_a_child_that_dies_stops_the_recording_not_the_training(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="rollout_lens")
    writer = _writer(sqlite_url)
    writer.put(_step(1))
    until(lambda: writer.written_steps == 1, "step 1")
    os.kill(_child(writer), signal.SIGKILL)
    for step in (2, 3):
        writer.put(_step(step))  # never raises
    writer.close(timeout=10)
    assert "the recorder's writer process exited with -9" in caplog.text
    assert "recording stopped, training goes on" in caplog.text
    _, _, steps, _ = load_run(sqlite_url, writer.run_id)
    assert [s.step for s in steps] == [1]  # what was written stays


def test_a_database_the_child_cannot_open_answers_as_before(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The store's errors come back with their types: a database under a file, not a folder,
    is a database away (retried until close's timeout, then its steps are lost), not a dead
    child."""
    caplog.set_level(logging.WARNING, logger="rollout_lens")
    (tmp_path / "a-file").write_text("")
    writer = _writer(f"sqlite:///{tmp_path / 'a-file' / 'db.sqlite'}")
    writer.put(_step(1))
    assert writer.close(timeout=2) is False
    assert "writer process" not in caplog.text
    assert "could not be written" in caplog.text


def test_an_in_memory_database_stays_in_the_scripts_process() -> None:
    assert sink_process.in_process("sqlite://")
    assert sink_process.in_process("sqlite:///:memory:")
    assert not sink_process.in_process("sqlite:////tmp/x.db")
    assert not sink_process.in_process("postgresql+psycopg://u@h/db")
    writer = _writer("sqlite://")
    assert isinstance(writer.sink, SqlSink)
    writer.put(_step(1))
    assert writer.close() is True


@pytest.mark.parametrize("interpreter", ["/nonexistent/python3", "/bin/false"])
def test_where_no_child_can_start_the_writes_stay_in_this_process(
    sqlite_url: str,
    interpreter: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An interpreter that cannot be started, or a child that exits at once: said, and the
    run recorded from a thread as before."""
    caplog.set_level(logging.WARNING, logger="rollout_lens")
    monkeypatch.setattr(sink_process.sys, "executable", interpreter)
    writer = _writer(sqlite_url)
    for step in (1, 2):
        writer.put(_step(step))
    assert writer.close() is True
    assert "writing from this process (the writer process could not start" in caplog.text
    run, _, steps, _ = load_run(sqlite_url, writer.run_id)
    assert [s.step for s in steps] == [1, 2] and run.status == "completed"


def _launched(url: str, written: list[int] | None = None) -> StepWriter:
    """The worker's writer of a run made for it in the database at `url` (migrated), each step
    it says written kept in `written` (the launched run's progress bar)."""
    factory = make_session_factory(make_engine(url))
    with session_scope(factory) as session:
        run_id = store.create_run(session, name="child", model="m", total_steps=5, group_size=8).id
    on_written = None if written is None else (lambda record: written.append(record.step))
    return StepWriter.for_launched(
        factory,
        run_id=run_id,
        control_tokens=list(CONTROL_TOKENS),
        price_per_device_hour=0.0,
        on_written=on_written,
    )


def test_a_launched_runs_steps_are_written_by_a_child(
    migrated_sqlite: object, tmp_path: Path
) -> None:
    url = migrated_sqlite(tmp_path / "launched.db")  # type: ignore[operator]
    written: list[int] = []
    writer = _launched(url, written)
    assert isinstance(writer.sink, ProcessSink)
    until(lambda: _started(writer), "the writer process")  # started before the first step
    for step in (1, 2, 3):
        writer.put(_step(step))
    writer.flush()
    pid = _child(writer)
    assert pid != os.getpid() and _alive(pid)
    assert "libtorch" not in Path(f"/proc/{pid}/maps").read_text()
    assert written == [1, 2, 3]  # its progress, told in this process
    writer.put(_step(4))
    assert writer.close() is True
    assert not _alive(pid)
    run, rows, steps, _ = load_run(url, writer.run_id)  # type: ignore[arg-type]
    assert [s.step for s in steps] == [1, 2, 3, 4] and len(rows) == 32
    assert written == [1, 2, 3, 4]
    assert run.status == "queued"  # a launched run's end is the worker's to mark


def test_a_launched_run_whose_child_dies_fails(migrated_sqlite: object, tmp_path: Path) -> None:
    url = migrated_sqlite(tmp_path / "launched.db")  # type: ignore[operator]
    writer = _launched(url)
    writer.put(_step(1))
    writer.flush()
    os.kill(_child(writer), signal.SIGKILL)
    with pytest.raises(RuntimeError, match="the recorder's writer process exited with -9"):
        for step in (2, 3, 4):  # the step after the writer failed raises
            writer.put(_step(step))
            writer.flush()
    _, _, steps, _ = load_run(url, writer.run_id)  # type: ignore[arg-type]
    assert [s.step for s in steps] == [1]
    with pytest.raises(RuntimeError):
        writer.close()


def test_where_no_child_can_start_a_launched_run_is_written_from_this_process(
    migrated_sqlite: object,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="rollout_lens")
    monkeypatch.setattr(sink_process.sys, "executable", "/nonexistent/python3")
    url = migrated_sqlite(tmp_path / "launched.db")  # type: ignore[operator]
    written: list[int] = []
    writer = _launched(url, written)
    for step in (1, 2):
        writer.put(_step(step))
    assert writer.close() is True
    assert "writing from this process (the writer process could not start" in caplog.text
    _, _, steps, _ = load_run(url, writer.run_id)  # type: ignore[arg-type]
    assert [s.step for s in steps] == [1, 2] and written == [1, 2]
