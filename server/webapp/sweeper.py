"""The background sweeper: runs whose worker stopped sending heartbeats are marked `lost`."""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

from rollout_lens.server import store
from rollout_lens.server.core.config import Settings
from rollout_lens.server.store.db import session_scope
from sqlalchemy.orm import Session, sessionmaker

SWEEP_SECONDS = 10.0
log = logging.getLogger(__name__)


async def sweep_lost_runs(
    factory: sessionmaker[Session], settings: Settings, *, every: float
) -> None:
    """Forever: mark `lost` the running or starting runs with no heartbeat for
    settings.lost_after_seconds, so a process killed mid-run or while starting leaves no run
    stuck in `running` or "queued · starting"."""
    stale_after = timedelta(seconds=settings.lost_after_seconds)

    def sweep() -> list[int]:
        with session_scope(factory) as session:
            return store.mark_lost_runs(session, stale_after=stale_after)

    while True:
        try:
            lost = await asyncio.to_thread(sweep)
            if lost:
                log.warning("runs %s lost: their process stopped sending heartbeats", lost)
        except Exception:  # a database hiccup must not end the sweeping
            log.exception("could not check for lost runs")
        await asyncio.sleep(every)
