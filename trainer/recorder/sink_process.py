"""A user's script's or a launched run's database sink in a process of its own (`ProcessSink`).

In the training process the writer's thread shares one GIL with the training step: every
millisecond the database write spends in Python (the store's rows, rollups, prompt texts,
alert rules) is a millisecond the training thread may wait for, however idle the other cores
are. ProcessSink runs the SqlSink (trainer/recorder/sinks.py) in a child process, started as
`python -m rollout_lens.trainer.recorder.sink_process` (the same interpreter and sys.path;
never a fork of a process that holds torch's threads, and never a re-run of the user's script,
as multiprocessing's spawn would do with a script without a main guard). The writer's thread
pickles each call's arguments (the prepared steps: arrays and texts, in C) onto a socket pair
and waits for the answer with the GIL released. Everything the StepWriter owns (the queue, the
byte budget, the drops, the retries) stays where it was; the sink's answers come back as they
were (a Wrote, SinkAway, RunEnded, a refused step), its log lines through the parent's
"rollout_lens" logger.

The child ignores Ctrl-C and has a session of its own (a Ctrl-C meant for training must not
take the run's last steps with it); it ends when the parent closes the sink or goes away. A
child that dies stops a script's recording (logged), never its training; a launched run fails,
as it does when its database does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from rollout_lens.server.core.records import StepRecord
from rollout_lens.server.store.models import RunStatus
from rollout_lens.trainer.recorder.writer import RunSpec, Wrote, lighten_record

if TYPE_CHECKING:
    from rollout_lens.trainer.recorder.reading import StepReader
    from rollout_lens.trainer.recorder.sinks import SqlSink
    from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger("rollout_lens")

Drops = tuple[int, int]
CLOSE_SECONDS = 30.0  # the child's last answer (its connections let go), at most


class SinkProcessGone(RuntimeError):
    """The child process is gone: recording stops (training goes on)."""


def in_process(database_url: str) -> bool:
    """Whether a sink for `database_url` must stay in this process: an in-memory SQLite
    database is this process's own, and only POSIX passes a socket to a child."""
    memory = database_url.startswith("sqlite") and (
        ":memory:" in database_url or database_url.rstrip("/") in ("sqlite:", "sqlite+pysqlite:")
    )
    return memory or os.name != "posix"


def script_sink(
    database_url: str,
    spec: RunSpec,
    *,
    process: bool,
    price: float,
    wait_ms: int,
    resume: tuple[str, int] | None,
    reader: StepReader | None = None,
) -> ProcessSink | SqlSink:
    """A script's database sink (`price` a device-hour, SQLite's busy timeout `wait_ms`): in a
    child process (`process`), else, or for an in-memory database, in this one; the judged
    steps it is handed read by `reader` where it writes them."""
    fields = dict(
        database_url=database_url,
        spec=spec,
        price_per_hour=price,
        busy_timeout_ms=wait_ms,
        resume=resume,
    )
    return _placed(fields, process=process, reader=reader)


def launched_sink(
    factory: sessionmaker[Session],
    run_id: int,
    control_tokens: list[str],
    price: float,
    *,
    process: bool,
    wait_ms: int,
) -> ProcessSink | SqlSink:
    """A launched run's database sink (the worker's run `run_id`, its session `factory`; `price`
    a device-hour): in a child process (`process`; its writes' Python off the training
    process's GIL; SQLite's busy timeout there `wait_ms`), else, or for an in-memory database,
    in this one."""
    engine = factory.kw["bind"]
    database_url = engine.url.render_as_string(hide_password=False)
    fields = dict(
        database_url=database_url,
        run_id=run_id,
        control_tokens=list(control_tokens),
        price_per_hour=price,
        busy_timeout_ms=wait_ms,
    )
    return _placed(fields, process=process, factory=factory)


def _placed(
    fields: dict[str, Any],
    *,
    process: bool,
    reader: StepReader | None = None,
    factory: sessionmaker[Session] | None = None,
) -> ProcessSink | SqlSink:
    """The sink of these fields in a child process (`process`), else, or for an in-memory
    database, in this one."""
    if not process or in_process(fields["database_url"]):
        return sink_here(fields, reader=reader, factory=factory)
    return ProcessSink(fields, reader=reader, factory=factory)


def sink_here(
    fields: dict[str, Any],
    *,
    reader: StepReader | None = None,
    factory: sessionmaker[Session] | None = None,
) -> SqlSink:
    """The SqlSink of these fields in this process: a script's (SqlSink.of_url, `reader`
    reading its judged steps), or with `factory` (the worker's) a launched run's (its run id,
    control tokens and price; the worker's engine, not the URL)."""
    from rollout_lens.trainer.recorder.sinks import SqlSink

    if factory is None:
        return SqlSink.of_url(**fields, reader=reader)
    return SqlSink.of_launched(
        factory,
        run_id=fields["run_id"],
        control_tokens=fields["control_tokens"],
        price_per_hour=fields["price_per_hour"],
    )


class ProcessSink:
    """The Sink protocol, answered by a SqlSink in a child process, started by the writer's
    thread as it starts (training does not wait for its imports; the SqlSink is made at
    `open`): a script's (SqlSink.of_url) or a launched run's (launched_sink: the worker's run,
    reached by its database URL). The judged steps it is handed are read there by `reader`
    (sent once, pickled: its tokenizer), or here, on the writer's thread, where the reader
    does not pickle. Where the child cannot be started, the SqlSink runs in this process as it
    did before (logged)."""

    away = "the database"
    final_seconds = 0.0

    def __init__(
        self,
        fields: dict[str, Any],
        *,
        reader: StepReader | None = None,
        factory: sessionmaker[Session] | None = None,
    ) -> None:
        """`fields`: SqlSink.of_url's (a script's), or with `factory` (the worker's session
        factory) a launched run's SqlSink's: its database URL, run id, control tokens and
        price."""
        self.deadline: float | None = None
        self.run_id: int | None = fields.get("run_id")
        self._fields = fields
        self._factory = factory
        self._reader = reader
        self._read_here: StepReader | None = None  # the child could not take the reader
        self._child: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._local: SqlSink | None = None  # the child could not be started
        self._made = False  # the child has made its sink (at the first `open`)
        self._opened = False  # the child's sink has opened (its run made or found)
        self._new_reader: StepReader | None = None  # given after the start (take_reader)
        self._closed = False
        self._reported_drops: Drops = (0, 0)

    def start(self) -> None:
        """The child started, its imports under way, as the writer starts (a launched run's
        as the worker hands its built trainer the writer, a script's as training begins); its
        sink is made at `open`."""
        if self._conn is None and self._local is None:
            try:
                self._spawn()
            except OSError as exc:
                self._write_here(exc)

    def _spawn(self) -> None:
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        try:
            self._child = subprocess.Popen(
                [sys.executable, "-m", __name__, str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                env=env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        self._conn = Connection(ours.detach())

    def _make(self) -> None:
        sent = _pickled(self._reader)
        if not self._call(
            "make", self._fields, self._factory is not None, log.getEffectiveLevel(), sent
        ):
            self._read_here = self._reader
        self._made = True

    def _write_here(self, exc: BaseException) -> None:
        log.warning(
            "Rollout Lens: writing from this process (the writer process could not start: %s)",
            exc,
        )
        self._stop_child()
        self._local = sink_here(self._fields, reader=self._reader, factory=self._factory)

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        if self._local is not None:
            try:
                return getattr(self._local, name)(*args, **kwargs)
            finally:
                self.run_id = self._local.run_id
        if self._closed or self._conn is None:
            raise SinkProcessGone("the recorder's writer process was closed")
        try:
            self._conn.send((name, args, kwargs))
            while True:
                kind, *rest = self._conn.recv()
                if kind == "log":
                    levelno, message = rest
                    log.log(levelno, "%s", message)
                    continue
                answer, refused, self.run_id = rest
                if kind == "raise":
                    raise _rebuilt(answer)
                if refused is not None:
                    answer.refused = _rebuilt(refused)
                return answer
        except (EOFError, OSError) as exc:
            self._closed = True
            code = None
            if self._child is not None:  # its end of the socket closed: it is ending, or has
                with contextlib.suppress(subprocess.TimeoutExpired):
                    code = self._child.wait(timeout=5)
            said = "is not answering" if code is None else f"exited with {code}"
            raise SinkProcessGone(f"the recorder's writer process {said}") from exc

    def open(self) -> None:
        self.start()
        if not self._made and self._local is None:
            try:
                self._make()
            except SinkProcessGone as exc:
                self._write_here(exc)
        if not self._opened or self._local is not None:  # the child's sink, once open, is
            self._call("open")
            self._opened = True

    def take_reader(self, reader: StepReader) -> None:
        """The judged steps' reader, given after the sink was made (a launched run's, by its
        callback as training begins): handed to the child before its next write, from the
        writer's thread (the only one that talks to it); read here where it does not pickle."""
        self._new_reader = reader

    def _hand_reader(self) -> None:
        reader, self._new_reader = self._new_reader, None
        if reader is None:
            return
        if self._local is not None:
            self._local.reader = reader
            return
        sent = _pickled(reader)
        taken = sent is not None and self._call("reader", sent)
        self._read_here = None if taken else reader

    def write(self, records: Sequence[StepRecord], drops: Drops) -> Wrote:
        from rollout_lens.trainer.recorder.sinks import read_steps

        self._hand_reader()
        read, unread = read_steps(self._read_here, records)  # as the child does, where it cannot
        if unread is not None and not read:
            return Wrote(taken=0, written=0, refused=unread)
        wrote: Wrote = self._call("write", read, drops)
        return wrote

    def report_drops(self, drops: Drops) -> None:
        if self.run_id is not None and drops != self._reported_drops:  # no call to say nothing
            self._call("report_drops", drops)
            self._reported_drops = drops

    def heartbeat(self) -> None:
        if self.run_id is not None:
            self._call("heartbeat")

    def finish(self, status: RunStatus, error: str | None, drops: Drops, *, late: bool) -> None:
        if self.run_id is None:
            return
        try:
            self._call("finish", status, error, drops, late=late)
        except SinkProcessGone as exc:  # never raises: say so
            log.warning("Rollout Lens: could not mark run %s finished: %s", self.run_id, exc)

    def forget(self) -> None:
        pass  # nothing is made of the steps before they are written

    def close(self) -> None:
        if self._local is not None:
            self._local.close()
            return
        if self._conn is not None and not self._closed and self._made:
            with contextlib.suppress(SinkProcessGone):  # gone already: nothing to let go
                self._call("close")
        self._stop_child()

    def _stop_child(self) -> None:
        self._closed = True
        if self._conn is not None:
            self._conn.close()
        if self._child is None:
            return
        try:
            self._child.wait(timeout=CLOSE_SECONDS)
        except subprocess.TimeoutExpired:
            self._child.kill()
            self._child.wait()


def _pickled(reader: StepReader | None) -> bytes | None:
    """The reader for the child (None: there is none, or it does not pickle: said)."""
    if reader is None:
        return None
    try:
        return pickle.dumps(reader, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - e.g. a tokenizer that holds a lock: read here
        log.info("Rollout Lens: steps are read in the training process (%s)", short_reason(exc))
        return None


def _unpickled(sent: bytes | None) -> StepReader | None:
    """The child's reader (None: none sent, or it cannot be loaded here: said)."""
    if sent is None:
        return None
    try:
        reader: StepReader = pickle.loads(sent)
    except Exception as exc:  # noqa: BLE001 - e.g. a tokenizer class of the user's __main__
        log.info("Rollout Lens: steps are read in the training process (%s)", short_reason(exc))
        return None
    return reader


def short_reason(exc: BaseException) -> str:
    return f"the step reader does not reach the writer's process: {type(exc).__name__}: {exc}"


# -- exceptions across the socket --------------------------------------------------------------


def _portable(exc: BaseException) -> Any:
    """An exception as (its class, args, attributes): the store's errors take keyword
    arguments that pickle's default would not pass back."""
    state = (type(exc), exc.args, dict(vars(exc)))
    try:
        pickle.loads(pickle.dumps(state))  # it must come back, not only leave
    except Exception:  # noqa: BLE001 - something in it does not pickle: its words do
        return (RuntimeError, (f"{type(exc).__name__}: {exc}",), {})
    return state


def _rebuilt(state: Any) -> BaseException:
    cls, args, attributes = state
    exc: BaseException = cls.__new__(cls)
    exc.args = args
    vars(exc).update(attributes)
    return exc


def _answer(value: Any) -> tuple[Any, Any]:
    """A call's answer, and the exception a Wrote names apart (made portable); of a Wrote's
    records, read here, what a launched run's `on_written` reads (each step without its
    rollouts: its progress bar)."""
    if isinstance(value, Wrote):
        refused = None if value.refused is None else _portable(value.refused)
        records = None
        if value.records is not None:
            records = [lighten_record(r)[0] for r in value.records]
        return Wrote(value.taken, value.written, records=records), refused
    return value, None


# -- the child ---------------------------------------------------------------------------------


class _ToParent(logging.Handler):
    def __init__(self, conn: Connection) -> None:
        super().__init__()
        self.conn = conn

    def emit(self, record: logging.LogRecord) -> None:
        # the parent gone: the next recv ends the child
        with contextlib.suppress(Exception):
            self.conn.send(("log", record.levelno, self.format(record)))


def serve(conn: Connection) -> None:
    """Answer the parent's calls on `conn` until it closes the sink or goes away."""
    from rollout_lens.trainer.recorder.sinks import SqlSink

    sink: SqlSink | None = None
    while True:
        try:
            name, args, kwargs = conn.recv()
        except (EOFError, OSError):
            break
        try:
            if name == "make":
                fields, launched, level, sent = args
                handler = _ToParent(conn)
                log.addHandler(handler)
                log.setLevel(level)
                log.propagate = False
                reader = _unpickled(sent)
                sink = (
                    SqlSink(factory=None, **fields)  # the worker's run, by its URL
                    if launched
                    else SqlSink.of_url(**fields, reader=reader)
                )
                answer = reader is not None
            elif name == "reader":  # a launched run's, once its training begins
                assert sink is not None, "the sink is made first"
                sink.reader = _unpickled(args[0])
                answer = sink.reader is not None
            else:
                assert sink is not None, "the sink is made first"
                answer = getattr(sink, name)(*args, **kwargs)
            conn.send(("ok", *_answer(answer), sink.run_id if sink else None))
        except BaseException as exc:  # noqa: BLE001 - every error is the parent's to judge
            conn.send(("raise", _portable(exc), None, sink.run_id if sink else None))
        if name == "close":
            break
    if sink is not None:
        sink.close()


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C for training is the parent's
    conn = Connection(int(argv[0]))
    try:
        serve(conn)
    finally:
        conn.close()


if __name__ == "__main__":
    main(sys.argv[1:])
