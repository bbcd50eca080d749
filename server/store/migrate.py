"""Schema management through Alembic: upgrade, and refuse a database that is behind."""

from __future__ import annotations

import threading
from collections.abc import Callable

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from rollout_lens.server import ROOT
from rollout_lens.server.core.errors import DatabaseBehind
from sqlalchemy import Engine

MIGRATIONS_DIR = ROOT / "migrations"


def is_modelled(name: str | None, type_: str, _parents: object = None) -> bool:
    """Alembic's include_name: the search engines' own tables and indexes (server.store.search:
    FTS5 tables and their shadow tables, rollout_search, prompt_search and search_words, and
    PostgreSQL's index of a run's prompts) are made by migrations and the store, not by the
    models, so comparisons leave them out."""
    if name is None:
        return True
    if type_ == "table":
        return not (
            name.startswith(("rollout_fts_", "prompt_fts"))
            or name in ("rollout_search", "prompt_search", "search_words")
        )
    return not (type_ == "index" and name in ("ix_prompts_search", "ix_rollouts_search_prompts"))


def _alembic_config() -> Config:
    """An Alembic config pointing at the project's migrations, no ini file needed."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    return cfg


# Alembic runs env.py through one process-wide proxy (`alembic.context`) and module namespace:
# two migrations at once in one process (two RolloutLensCallbacks, each upgrading from its
# writer's thread) run each other's migrations on the wrong connection. One at a time.
_MIGRATING = threading.Lock()


def _migrate(engine: Engine, move: Callable[[Config, str], None], revision: str) -> None:
    """Run Alembic's `move` (command.upgrade or command.downgrade) to `revision` on one
    transaction of `engine`, one migration at a time per process."""
    cfg = _alembic_config()
    with _MIGRATING, engine.begin() as connection:
        if connection.dialect.name == "postgresql":
            # a migration waits for the locks it needs as long as they are held (an operator
            # runs it and sees it wait), not the store's bound on a write's wait (db.py)
            connection.exec_driver_sql("SET LOCAL lock_timeout = 0")
        cfg.attributes["connection"] = connection
        move(cfg, revision)


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Migrate the database behind `engine` to `revision` (one upgrade at a time per process)."""
    _migrate(engine, command.upgrade, revision)


def downgrade(engine: Engine, revision: str) -> None:
    """Migrate the database behind `engine` back to `revision` (one migration at a time per
    process); a migration that cannot be undone raises and leaves the database as it was."""
    _migrate(engine, command.downgrade, revision)


def head_revision() -> str | None:
    """The newest migration's revision id."""
    return ScriptDirectory.from_config(_alembic_config()).get_current_head()


def current_revision(engine: Engine) -> str | None:
    """The revision the database is at (None for an empty database)."""
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def ensure_current(engine: Engine) -> None:
    """Raise DatabaseBehind unless the database is at the latest migration."""
    current, head = current_revision(engine), head_revision()
    if current != head:
        raise DatabaseBehind(
            f"the database is at revision {current or 'none (empty)'} but this version of "
            f"Rollout Lens needs {head}; run `rollout-lens db upgrade`"
        )
