"""The Celery task that trains a run (imported by the worker only; torch loads inside the task)."""

from __future__ import annotations

import logging

from celery import shared_task
from pydantic import ValidationError
from rollout_lens.server import store
from rollout_lens.server.core.config import get_settings
from rollout_lens.server.core.queue import TRAIN_TASK
from rollout_lens.server.core.runconfig import RunConfig
from rollout_lens.server.store.db import make_engine, make_session_factory, session_scope
from rollout_lens.server.store.models import EndedBy, RunRow, RunStatus
from rollout_lens.trainer.worker.modelref import ModelUnavailable, check_model, unusable

log = logging.getLogger(__name__)


@shared_task(name=TRAIN_TASK, bind=True, acks_late=False, ignore_result=True)
def train_run(self, run_id: int) -> str:  # type: ignore[no-untyped-def]
    """Train run `run_id` if it is still queued; a second delivery finds it taken and does nothing."""
    settings = get_settings()
    engine = make_engine(settings.database_url, busy_timeout_ms=settings.sqlite_busy_timeout_ms)
    factory = make_session_factory(engine)
    try:
        with session_scope(factory) as session:
            if not store.claim_run(session, run_id=run_id, task_id=str(self.request.id)):
                run = session.get(RunRow, run_id)
                status = run.status if run else "missing"
                log.warning("run %s is %s, not queued: skipping this delivery", run_id, status)
                return f"skipped: run {run_id} is {status}"
            run = store.get_run(session, run_id=run_id)
            config_data, checkpoint_step = dict(run.config), run.checkpoint_step

        try:
            config = RunConfig.model_validate(config_data)
            check_model(config.model)  # only this host knows whether a model folder exists
        except (ValidationError, ModelUnavailable) as exc:
            error = f"invalid run config: {exc}"
            if isinstance(exc, ModelUnavailable):
                log.warning("run %s: %s", run_id, exc)  # the detail, for the worker's operator
                error = f"invalid run config: {unusable(str(config_data.get('model', '')))}"
            with session_scope(factory) as session:
                store.mark_finished(
                    session,
                    run_id=run_id,
                    status=RunStatus.failed,
                    error=error,
                    ended_by=EndedBy.worker,
                )
            return f"run {run_id} failed: invalid config"
        # Only now the ML stack: the worker process stays light until a run arrives.
        try:
            from rollout_lens.trainer.worker.run import resume_step, train
        except ImportError as exc:  # a dashboard-only install: the run fails, saying why
            error = (
                f"this worker cannot train: {exc} (a dashboard-only install); install the ML "
                "stack where the worker runs: pip install 'rollout-lens[train]'"
            )
            log.error("run %s: %s", run_id, error)
            with session_scope(factory) as session:
                store.mark_finished(
                    session,
                    run_id=run_id,
                    status=RunStatus.failed,
                    error=error,
                    ended_by=EndedBy.worker,
                )
            return f"run {run_id} failed: no ML stack"

        start = resume_step(settings, run_id, checkpoint_step)
        train(config, settings=settings, run_id=run_id, resume_from=start)
        return f"run {run_id} finished"
    finally:
        engine.dispose()
