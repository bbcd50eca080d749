"""A PostgreSQL link that goes silent: packets dropped without a reset (iptables on a proxy's port,
as a failover that moves the address or a switch that fails does it). Without a bound a query
then waits until the kernel gives up retransmitting, about 15 minutes; the store's engines give
up once sent data goes `link_timeout_s` unacknowledged (libpq's tcp_user_timeout), and the
pool's next connection carries on once the link is back."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator

import pytest
from rollout_lens.server.store.db import PG_LINK_TIMEOUT_S, make_engine
from sqlalchemy import make_url, text
from sqlalchemy.exc import OperationalError

from bench.tcp_proxy import database_proxy
from tests.factories import assert_every_step_written, script_writer, seeded_step
from tests.waiting import returns, until


class Blackhole:
    """iptables rules that drop every packet to and from a local port (taken out at the end)."""

    def __init__(self) -> None:
        self.rules: list[list[str]] = []

    def drop(self, port: int) -> None:
        for side in ("--dport", "--sport"):
            rule = ["INPUT", "-p", "tcp", side, str(port), "-j", "DROP"]
            subprocess.run(["iptables", "-w", "-A", *rule], check=True, capture_output=True)
            self.rules.append(rule)

    def lift(self) -> None:
        while self.rules:
            rule = self.rules.pop()
            subprocess.run(["iptables", "-w", "-D", *rule], check=True, capture_output=True)


@pytest.fixture
def blackhole() -> Iterator[Blackhole]:
    usable = os.geteuid() == 0 and shutil.which("iptables") is not None
    if not usable or subprocess.run(["iptables", "-w", "-L", "-n"], capture_output=True).returncode:
        pytest.skip("dropping packets needs iptables and root (CI has both)")
    holes = Blackhole()
    try:
        yield holes
    finally:
        holes.lift()


@pytest.mark.postgres
def test_a_silent_link_ends_a_query_within_the_bound_and_the_pool_goes_on(
    pg_database_url: str, blackhole: Blackhole
) -> None:
    proxy, url = database_proxy(pg_database_url)
    proxy.start()
    engine = make_engine(url, link_timeout_s=2.0)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SELECT 1")).scalar() == 1
            blackhole.drop(proxy.port)
            try:
                # the hang detector's bound: well past 2 s, far short of the kernel's 15 minutes
                with pytest.raises(OperationalError):
                    returns(lambda: conn.execute(text("SELECT 2")), "a query on a silent link", 30)
            finally:
                blackhole.lift()  # else a connection left hung waits on its close too
        with engine.connect() as conn:  # a new connection (pre-ping drops the dead one)
            assert conn.execute(text("SELECT 3")).scalar() == 3
    finally:
        engine.dispose()
        proxy.close()


def test_the_bound_reaches_libpq_and_a_urls_own_value_wins(pg_database_url: str) -> None:
    engine = make_engine(pg_database_url)
    own = make_engine(pg_database_url + "?tcp_user_timeout=5000")
    try:
        with engine.connect() as conn, own.connect() as mine:
            dsn = conn.connection.dbapi_connection.info.dsn  # type: ignore[union-attr]
            assert f"tcp_user_timeout={round(PG_LINK_TIMEOUT_S * 1000)}" in dsn
            assert "keepalives=1" in dsn
            theirs = mine.connection.dbapi_connection.info.dsn  # type: ignore[union-attr]
            assert "tcp_user_timeout=5000" in theirs
    finally:
        engine.dispose()
        own.dispose()


@pytest.mark.postgres
def test_a_scripts_recorder_outlives_a_silent_link(
    pg_database_url: str,
    _pg_reset: Callable[[], None],
    blackhole: Blackhole,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The recorder's writes on a silent link end at the bound (here the URL's own, 2 s), the
    steps wait in the budget, and all of them are written once the link carries again (by the
    writer's child, the default: its thread uses the same engine)."""
    import logging

    caplog.set_level(logging.WARNING, logger="rollout_lens")
    _pg_reset()
    proxy, through = database_proxy(pg_database_url)
    proxy.start()
    url = make_url(through).update_query_dict({"tcp_user_timeout": "2000"})
    writer = script_writer(
        url.render_as_string(hide_password=False), "silent", total_steps=6, process=True
    )

    try:
        writer.put(seeded_step(1))
        until(lambda: writer.written_steps == 1, "step 1 written")
        blackhole.drop(proxy.port)
        try:
            for n in range(2, 7):
                writer.put(seeded_step(n))
            # the write of step 2 fails at the bound: the writer says the database is away
            until(lambda: "database is unreachable" in caplog.text, "the outage said")
        finally:
            blackhole.lift()
        assert writer.close() is True
    finally:
        proxy.close()
    assert_every_step_written(pg_database_url, writer.run_id, 6)
