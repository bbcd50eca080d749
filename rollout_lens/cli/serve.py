"""The `serve` command: the dashboard, and on the embedded queue a local worker beside it."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sqlalchemy.engine import make_url

from rollout_lens.cli.base import fail
from rollout_lens.server.core.config import Settings


def add_commands(sub: Any) -> None:
    """Register `serve` on the CLI's subparsers."""
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


def serve_dashboard(
    args: argparse.Namespace, settings: Settings, *, announce: Sequence[str] = ()
) -> int:
    """Serve the dashboard (and a local worker on the embedded queue); `announce` is printed
    once the port answers, so a URL in it is the last line and opens at once."""
    import signal

    from rollout_lens.server.webapp.app import prepare_database

    settings = _served_settings(settings, args.host, args.port)
    proxy_headers = bool(getattr(args, "proxy_headers", False))
    allow_ips = getattr(args, "forwarded_allow_ips", None)
    # before the database, the worker or anything else is started
    problem = _exposure_problem(args, settings, proxy_headers=proxy_headers, allow_ips=allow_ips)
    problem = problem or port_problem(args.host, args.port)
    if problem:
        return fail(problem)
    prepare_database(settings)
    database = make_url(settings.database_url).render_as_string(hide_password=True)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    worker: subprocess.Popen[bytes] | None = None
    try:
        worker, queue = _start_local_worker(settings)
        print(f"Rollout Lens on http://{args.host}:{args.port}/ (database {database}; {queue})")
        sys.stdout.flush()
        if announce:
            _announce_when_listening(args.host, args.port, announce)
        _run_uvicorn(
            settings, args.host, args.port, proxy_headers=proxy_headers, allow_ips=allow_ips
        )
    finally:
        _stop_local_worker(worker)
    return 0


def _exposure_problem(
    args: argparse.Namespace, settings: Settings, *, proxy_headers: bool, allow_ips: str | None
) -> str | None:
    """Why serving as asked would open the dashboard to others or trust forged headers (None:
    it would not); serving beyond loopback with no token under --insecure is warned of."""
    from rollout_lens.server.webapp.http.security import is_loopback_host

    if allow_ips and not proxy_headers:
        return "--forwarded-allow-ips needs --proxy-headers (forwarded headers are ignored)"
    if is_loopback_host(args.host) or settings.auth_token_list:
        return None
    if not getattr(args, "insecure", False):
        return (
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
    return None


def _exit_on_signal(signum: int, _frame: object) -> None:
    # uvicorn re-raises the SIGTERM it caught once it has shut down: make that an exception, so
    # serve_dashboard's `finally` still stops the worker instead of the process dying on the spot.
    raise SystemExit(128 + signum)


def _start_local_worker(settings: Settings) -> tuple[subprocess.Popen[bytes] | None, str]:
    """On the embedded queue, a worker process beside the dashboard; and the queue, as said."""
    if settings.broker_url:
        return None, "broker from ROLLOUT_LENS_BROKER_URL; start workers with `rollout-lens worker`"
    # The embedded default: one machine, nothing to install. The worker is a child process
    # (same environment: the same database and broker folder) that trains queued runs;
    # its banner and warnings go to a log file, not between the dashboard's lines.
    log_path = _worker_log_path(settings)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log_file:
        worker = subprocess.Popen(
            [sys.executable, "-m", "rollout_lens", "worker"],
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    queue = (
        f"embedded queue; started a local worker, pid {worker.pid}, logging to {log_path.resolve()}"
    )
    return worker, queue


def _stop_local_worker(worker: subprocess.Popen[bytes] | None) -> None:
    """Terminate, then kill if it has not stopped within 10 s (a run it was training is then
    marked lost by the heartbeat check, and can be resumed)."""
    if worker is not None and worker.poll() is None:
        worker.terminate()
        try:
            worker.wait(timeout=10)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()


def _run_uvicorn(
    settings: Settings, host: str, port: int, *, proxy_headers: bool, allow_ips: str | None
) -> None:
    import uvicorn

    from rollout_lens.server.webapp.app import create_app

    # Keep-alive 30 s, not uvicorn's 5: a server busy enough to run its timer late closes a
    # connection its client has just sent a request on (a script's client does not retry).
    uvicorn.run(
        create_app(settings, model_builds=_launch_notes(settings)),
        host=host,
        port=port,
        log_level="warning",
        timeout_keep_alive=30,
        # uvicorn trusts X-Forwarded-For from 127.0.0.1 by default: anyone on this machine
        # could then pose as any address (and dodge, or aim, the wrong-token limit).
        proxy_headers=proxy_headers,
        forwarded_allow_ips=allow_ips or "127.0.0.1",
    )


def _launch_notes(settings: Settings):  # type: ignore[no-untyped-def]
    """The launch form's warnings of a model build (trainer.builders.prebuilt; no torch import)."""
    from rollout_lens.trainer.builders import prebuilt

    return lambda: prebuilt.launch_notes(settings.models_dir)


def _worker_log_path(settings: Settings) -> Path:
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
