"""Shared fixtures: real databases (an SQLite file and the PostgreSQL server), migrated by Alembic."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from rollout_lens.server.config import Settings
from rollout_lens.server.db import make_engine, make_session_factory
from rollout_lens.server.migrate import upgrade
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

PG_URL = os.environ.get(
    "ROLLOUT_LENS_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


@pytest.fixture(scope="session")
def pg_database_url() -> Iterator[str]:
    """A fresh PostgreSQL database for this test session, dropped at the end."""
    admin = create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    name = f"rollout_lens_test_{uuid.uuid4().hex[:10]}"
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:  # noqa: BLE001 - say what is missing, not a stack of driver errors
        pytest.fail(f"PostgreSQL at {PG_URL} is needed for the store tests: {exc}")
    url = make_url(PG_URL).set(database=name).render_as_string(hide_password=False)
    yield url
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture(scope="session")
def pg_engine(pg_database_url: str) -> Iterator[Engine]:
    engine = make_engine(pg_database_url)
    upgrade(engine)
    yield engine
    engine.dispose()


def _truncate_pg(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(
            text(
                "TRUNCATE runs, steps, rollouts, prompts, facts, run_tokens, rollups, alerts, sessions RESTART IDENTITY CASCADE"
            )
        )


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    """A migrated, empty database: an SQLite file, then the PostgreSQL server."""
    if request.param == "sqlite":
        eng = make_engine(f"sqlite:///{tmp_path / 'test.db'}")
        upgrade(eng)
        yield eng
        eng.dispose()
    else:
        pg = request.getfixturevalue("pg_engine")
        _truncate_pg(pg)
        yield pg


@pytest.fixture
def session_factory(engine: Engine) -> sessionmaker[Session]:
    return make_session_factory(engine)


@pytest.fixture
def client(session_factory: sessionmaker[Session], tmp_path: Path) -> TestClient:
    """The dashboard in-process on the test's database; launches queue into tmp_path's
    embedded broker (tmp_path/broker)."""
    from tests.web_support import client_for

    return client_for(session_factory, data_dir=tmp_path)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """An SQLite file URL, not yet created."""
    return f"sqlite:///{tmp_path / 'rollout-lens.db'}"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built tiny model: cached under ROLLOUT_LENS_MODEL_CACHE_DIR if set, else per session."""
    from rollout_lens.trainer.prebuilt import ensure_tiny

    cache = os.environ.get("ROLLOUT_LENS_MODEL_CACHE_DIR")
    return ensure_tiny(Path(cache) if cache else tmp_path_factory.mktemp("models"))


def _migrated_settings(data_dir: Path, model_dir: Path) -> Settings:
    """Settings for training into a fresh, migrated SQLite file with a cached model."""
    settings = Settings(data_dir=data_dir, model_cache_dir=model_dir.parent)
    engine = make_engine(settings.database_url)
    upgrade(engine)
    engine.dispose()
    return settings


@pytest.fixture
def train_settings(tmp_path: Path, tiny_model_dir: Path) -> Settings:
    """Settings for training into a fresh, migrated SQLite file with the cached tiny model."""
    return _migrated_settings(tmp_path, tiny_model_dir)


@pytest.fixture
def multiturn_settings(tmp_path: Path, multiturn_model_dir: Path) -> Settings:
    """The same with the cached multi-turn tiny model."""
    return _migrated_settings(tmp_path, multiturn_model_dir)


@pytest.fixture(scope="session")
def user_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A TRL user's own tiny model and tokenizer (tests/user_script.py), built once per session."""
    from tests.user_script import build_model

    return build_model(tmp_path_factory.mktemp("user-model") / "model")


@pytest.fixture(scope="session")
def multiturn_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built multi-turn tiny model, cached like `tiny_model_dir` (its own folder there)."""
    from rollout_lens.trainer.prebuilt import ensure_multiturn

    cache = os.environ.get("ROLLOUT_LENS_MODEL_CACHE_DIR")
    return ensure_multiturn(Path(cache) if cache else tmp_path_factory.mktemp("models"))
