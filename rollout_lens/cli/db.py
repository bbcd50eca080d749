"""The `db` command: migrate the database to the latest schema, or print its revision."""

from __future__ import annotations

import argparse
from typing import Any

from rollout_lens.cli.base import migrated_factory
from rollout_lens.server.core.config import Settings
from rollout_lens.server.store.db import make_engine


def add_commands(sub: Any) -> None:
    """Register `db upgrade` and `db current` on the CLI's subparsers."""
    db = sub.add_parser("db", help="database schema")
    db_sub = db.add_subparsers(dest="db_command", required=True, metavar="ACTION")
    db_sub.add_parser("upgrade", help="migrate the database to the latest schema").set_defaults(
        handler=_db_upgrade
    )
    db_sub.add_parser("current", help="print the database's schema revision").set_defaults(
        handler=_db_current
    )


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
