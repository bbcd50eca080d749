"""`rollout-lens serve`: light imports, migrate-on-start for SQLite, refusal of a database behind."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from rollout_lens.server.store.db import make_engine
from rollout_lens.server.store.migrate import current_revision, head_revision
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from rollout_lens.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_LENS_")}
    return env | {"PYTHONPATH": str(ROOT)} | extra


def test_the_web_process_never_imports_ml_libraries() -> None:
    code = (
        "import sys\n"
        "from rollout_lens.server.webapp.app import create_app\n"
        "from rollout_lens.server.core.config import Settings\n"
        "import rollout_lens\n"
        "import rollout_lens.cli\n"
        "create_app(Settings(database_url='sqlite://'))\n"
        # numpy is a dependency of the web app (rollouts' arrays are stored compressed); the ML
        # stack is the trainer's alone
        "print(','.join(m for m in ('torch', 'transformers', 'trl') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=ROOT,
        check=True,
    )
    assert out.stdout.strip() == ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Served:
    """What one `serve` on the embedded default did, from start to stop."""

    data_dir: Path
    body: str  # the runs page it answered
    first: str  # its first line on the terminal
    output: str  # everything it wrote to the terminal, the first line included
    log: str  # its local worker's log file once the worker said it was ready


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Served:
    """`serve` with no database and no broker configured, asked for its runs page, left running
    until its local worker is ready, then stopped: one server (and one Celery worker) for the
    tests below, each of which checks its own part of what it did."""
    data_dir = tmp_path_factory.mktemp("served")
    port = _free_port()
    log = data_dir / "worker.log"
    with subprocess.Popen(
        [sys.executable, "-m", "rollout_lens", "serve", "--port", str(port)],
        env=_env(ROLLOUT_LENS_DATA_DIR=str(data_dir)),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as proc:
        assert proc.stdout is not None
        try:
            first = proc.stdout.readline()
            # It must answer, not answer fast: about a second on a quiet machine, so 120 s is a
            # hang, not a loaded machine; the same for the worker's readiness.
            deadline = time.monotonic() + 120
            body = None
            while body is None and time.monotonic() < deadline:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1) as response:
                        body = response.read().decode()
                except OSError:
                    assert proc.poll() is None, f"serve exited: {first}{proc.communicate()[0]}"
                    time.sleep(0.05)
            assert body is not None, first
            while (
                "ready" not in (log.read_text() if log.exists() else "")
                and time.monotonic() < deadline
            ):
                assert proc.poll() is None, first
                time.sleep(0.1)
        finally:
            proc.terminate()
            rest = proc.communicate(timeout=30)[0]
    return Served(data_dir, body, first, first + rest, log.read_text() if log.exists() else "")


def test_serve_migrates_the_embedded_database_and_answers(served: Served) -> None:
    assert "No runs yet" in served.body
    engine = make_engine(f"sqlite:///{served.data_dir / 'rollout-lens.db'}")
    assert current_revision(engine) == head_revision()
    engine.dispose()
    # No broker configured: serve started a local worker, and stopped it on the way out.
    match = re.search(r"embedded queue; started a local worker, pid (\d+)", served.output)
    assert match, served.output
    with pytest.raises(ProcessLookupError):
        os.kill(int(match.group(1)), 0)


def test_the_local_workers_output_goes_to_a_log_file(served: Served) -> None:
    assert f"logging to {served.data_dir / 'worker.log'}" in served.first, served.first
    assert "ready" in served.log, served.log[-2000:]
    # Celery's banner and warnings stay in the log: the terminal has the dashboard's line only.
    assert "celery" not in served.output.lower() and "Warning" not in served.output, served.output


@pytest.mark.postgres
def test_serve_refuses_a_postgres_database_that_is_behind(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.conftest import PG_URL

    admin = create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    name = f"rollout_lens_behind_{uuid.uuid4().hex[:8]}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        url = make_url(PG_URL).set(database=name).render_as_string(hide_password=False)
        monkeypatch.setenv("ROLLOUT_LENS_DATABASE_URL", url)
        assert main(["serve", "--port", str(_free_port())]) == 2
        err = capsys.readouterr().err
        assert "rollout-lens db upgrade" in err and "none (empty)" in err
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def test_serve_refuses_every_interface_without_a_token(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setenv("ROLLOUT_LENS_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("ROLLOUT_LENS_AUTH_TOKEN", raising=False)
    assert main(["serve", "--host", "0.0.0.0", "--port", str(_free_port())]) == 2
    err = capsys.readouterr().err
    assert "without an access token" in err and "ROLLOUT_LENS_AUTH_TOKEN" in err
    assert "--insecure" in err
    assert not (tmp_path / "rollout-lens.db").exists()  # refused before touching anything


def test_serve_on_every_interface_with_insecure_or_a_token(tmp_path: Path) -> None:
    """Both serves here have a broker configured: they start no local worker, and say how to
    start one."""
    from rollout_lens.client import Client, ClientError

    port = _free_port()
    for extra_args, env_extra in (
        (["--insecure"], {}),
        ([], {"ROLLOUT_LENS_AUTH_TOKEN": "tok-123-0123456789", "ROLLOUT_LENS_AUTH_READ": "true"}),
    ):
        env = _env(
            ROLLOUT_LENS_DATA_DIR=str(tmp_path), ROLLOUT_LENS_BROKER_URL="redis://127.0.0.1:1/0"
        )
        base = f"http://127.0.0.1:{port}"
        with subprocess.Popen(
            [sys.executable, "-m", "rollout_lens", "serve", "--host", "0.0.0.0"]
            + ["--port", str(port), *extra_args],
            env=env | env_extra,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        ) as proc:
            lens = Client(base, token="tok-123-0123456789" if env_extra else None, timeout=1)
            try:
                runs, started = None, time.perf_counter()
                while runs is None and time.perf_counter() - started < 20:
                    try:
                        runs = lens.runs()
                    except ClientError as exc:
                        assert exc.status is None, exc  # not up yet
                        assert proc.poll() is None, f"serve exited: {proc.communicate()[0]}"
                        time.sleep(0.05)
                assert runs == []
                if env_extra:
                    with Client(base) as anonymous, Client(base, token="wrong") as wrong:
                        with pytest.raises(ClientError, match="needs a token") as refused:
                            anonymous.runs()
                        assert refused.value.status == 401
                        with pytest.raises(ClientError, match="not valid"):
                            wrong.runs()
            finally:
                lens.close()
                proc.terminate()
                output = proc.communicate(timeout=30)[0]
        said = [line for line in output.splitlines() if line.startswith("Rollout Lens on")]
        assert len(said) == 1 and "start workers with `rollout-lens worker`" in said[0], output
        assert "local worker" not in output, output
        if extra_args:
            assert "warning: serving on 0.0.0.0 with no access token" in output
        else:
            assert "warning" not in output and "tok-123-0123456789" not in output


@pytest.mark.parametrize(
    "command",
    # The demo trains: without the train extra it says so before it looks at the port.
    [["serve"], ["demo", "--steps", "1"]],
)
def test_a_busy_port_fails_before_anything_starts(tmp_path: Path, command: list[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "rollout_lens", *command, "--port", str(port)],
            env=_env(ROLLOUT_LENS_DATA_DIR=str(tmp_path / "data")),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"port {port} on 127.0.0.1 is already in use" in done.stderr
    assert "--port" in done.stderr and "Traceback" not in done.stderr
    # Nothing was started, built or created: no worker, no database, no model.
    assert "Rollout Lens on" not in done.stdout and "worker" not in done.stdout
    assert not (tmp_path / "data").exists()


def _wrong_tokens_with_forged_addresses(port: int, n: int) -> list[int]:
    """The same wrong token `n` times, each with another X-Forwarded-For: the statuses."""
    import httpx

    statuses = []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
        for i in range(n):
            headers = {
                "Authorization": "Bearer wrong-token-00000000",
                "X-Forwarded-For": f"192.0.2.{i}",
            }
            statuses.append(client.get("/api/runs", headers=headers).status_code)
    return statuses


def _serving(tmp_path: Path, port: int, *options: str) -> subprocess.Popen[str]:
    env = _env(
        ROLLOUT_LENS_DATA_DIR=str(tmp_path),
        ROLLOUT_LENS_BROKER_URL="redis://127.0.0.1:1/0",  # no local worker
        ROLLOUT_LENS_AUTH_TOKEN="the-right-token-0123456789",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollout_lens", "serve", "--port", str(port), *options],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 60  # a readiness wait, not a speed bound
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return proc
        except OSError:
            assert proc.poll() is None, f"serve exited: {proc.communicate()[0]}"
            time.sleep(0.05)
    proc.kill()
    raise AssertionError("serve did not listen")


def test_forwarded_addresses_are_trusted_only_with_proxy_headers(tmp_path: Path) -> None:
    """By default `serve` ignores X-Forwarded-For (uvicorn's own default trusts it from
    127.0.0.1): a guesser on this machine cannot pose as another address to dodge the limit, nor
    aim it at someone else's. With --proxy-headers it is the proxy's word for the client."""
    from rollout_lens.server.webapp.http.ratelimit import FREE_FAILURES

    port = _free_port()
    proc = _serving(tmp_path / "plain", port)
    try:
        statuses = _wrong_tokens_with_forged_addresses(port, FREE_FAILURES + 3)
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    assert statuses == [401] * (FREE_FAILURES + 1) + [429] * 2

    port = _free_port()
    proc = _serving(
        tmp_path / "proxied", port, "--proxy-headers", "--forwarded-allow-ips", "127.0.0.1"
    )
    try:
        statuses = _wrong_tokens_with_forged_addresses(port, FREE_FAILURES + 3)
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    assert statuses == [401] * (FREE_FAILURES + 3)  # each forwarded address counted alone


def test_forwarded_allow_ips_needs_proxy_headers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ROLLOUT_LENS_DATA_DIR", str(tmp_path))
    assert main(["serve", "--port", str(_free_port()), "--forwarded-allow-ips", "*"]) == 2
    assert "--forwarded-allow-ips needs --proxy-headers" in capsys.readouterr().err
