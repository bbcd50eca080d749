"""The `worker` command: a Celery worker that trains queued runs, one at a time."""

from __future__ import annotations

import argparse
from typing import Any

from rollout_lens.cli.base import migrated_factory
from rollout_lens.server import store
from rollout_lens.server.core.config import Settings
from rollout_lens.server.store.db import session_scope


def add_commands(sub: Any) -> None:
    """Register `worker` on the CLI's subparsers."""
    worker = sub.add_parser("worker", help="train queued runs (a Celery worker, one run at a time)")
    worker.add_argument("--loglevel", default="INFO")
    worker.add_argument("--name", help="worker node name (default: rollout-lens-<host>-<pid>)")
    worker.set_defaults(handler=_worker)


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
