"""Helpers of the tests that follow a dump folder while it is written (verl's and TRL's)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from rollout_lens.server import store
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.store.models import RunRow
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker


def use_database(
    monkeypatch: pytest.MonkeyPatch, factory: sessionmaker[Session], tmp_path: Path
) -> None:
    """The CLI's settings: this test's database, a quick heartbeat."""
    url = factory.kw["bind"].url.render_as_string(hide_password=False)
    monkeypatch.setenv("ROLLOUT_LENS_DATABASE_URL", url)
    monkeypatch.setenv("ROLLOUT_LENS_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("ROLLOUT_LENS_HEARTBEAT_SECONDS", "0.2")


def newest_run(factory: sessionmaker[Session]) -> RunRow | None:
    with session_scope(factory) as session:
        run = session.scalars(select(RunRow).order_by(RunRow.id.desc())).first()
        if run is not None:
            session.expunge(run)
        return run


def recorded(factory: sessionmaker[Session]) -> list[int]:
    """The steps recorded in the newest run."""
    run = newest_run(factory)
    if run is None:
        return []
    with session_scope(factory) as session:
        return [s.step for s in store.steps(session, run_id=run.id)]


def half(text: bytes) -> bytes:
    """The first part of a file as a writer leaves it mid-way: cut inside a line."""
    cut = len(text) // 2
    while text[cut - 1 : cut] == b"\n":
        cut += 1
    return text[:cut]


def follow_while(writes: Callable[[], None], follow: Callable[[], int]) -> int:
    """`follow()` (the CLI following a folder) on this thread while `writes()` writes the
    trainer's files on another; follow's exit status. A failure of `writes` fails the test."""
    failed: list[BaseException] = []

    def trainer() -> None:
        try:
            writes()
        except BaseException as exc:  # noqa: BLE001 - reported below
            failed.append(exc)

    thread = threading.Thread(target=trainer)
    thread.start()
    try:
        status = follow()
    finally:
        thread.join(timeout=60)
    assert not failed, failed
    return status
