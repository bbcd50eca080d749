"""The Celery app: enqueue runs by task name (the web process never imports the trainer).

With no broker configured the embedded default is kombu's `filesystem://` transport in the data
directory: it needs no server, survives restarts (messages are files), and unlike `sqla+sqlite://`
supports the remote control used for `inspect ping`.
"""

from __future__ import annotations

from pathlib import Path

from celery import Celery
from kombu.exceptions import OperationalError
from rollout_lens.server.core.config import Settings
from rollout_lens.server.core.errors import BrokerUnavailable

TRAIN_TASK = "rollout_lens.train_run"
QUEUE = "rollout-lens"


def _embedded_broker_dirs(settings: Settings) -> dict[str, Path]:
    """Folders of the embedded filesystem broker (in and out must be the same folder)."""
    root = settings.data_dir / "broker"
    return {"data": root / "queue", "control": root / "control"}


def make_celery(settings: Settings, *, include: list[str] | None = None) -> Celery:
    """The Celery app for `settings`; `rollout-lens worker` includes the trainer's task module."""
    app = Celery("rollout_lens", include=include or [])
    if settings.broker_url:
        app.conf.broker_url = settings.broker_url
        # A training run is acked when it starts (acks_late off), so the broker's visibility
        # timeout can never redeliver a long run; a worker that dies leaves a `lost` run instead.
        app.conf.broker_transport_options = {"visibility_timeout": 24 * 3600}
    else:
        dirs = _embedded_broker_dirs(settings)
        for path in dirs.values():
            path.mkdir(parents=True, exist_ok=True)
        app.conf.broker_url = "filesystem://"
        app.conf.broker_transport_options = {
            "data_folder_in": str(dirs["data"]),
            "data_folder_out": str(dirs["data"]),
            "control_folder": str(dirs["control"]),
            "store_processed": False,
        }
    app.conf.update(
        task_default_queue=QUEUE,
        task_acks_late=False,
        worker_prefetch_multiplier=1,
        worker_concurrency=1,
        task_ignore_result=True,
        task_serializer="json",
        accept_content=["json"],
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )
    return app


def enqueue_run(app: Celery, *, run_id: int, timeout: float = 3.0) -> str:
    """Send the training task for `run_id`; BrokerUnavailable if the broker cannot be reached."""
    try:
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=timeout)
            result = app.send_task(TRAIN_TASK, args=[run_id], connection=conn, retry=False)
    except (OperationalError, OSError, ConnectionError) as exc:
        raise BrokerUnavailable(
            f"the task queue at {_safe_url(app)} cannot be reached: {exc}"
        ) from exc
    return str(result.id)


def revoke_task(app: Celery, task_id: str, *, timeout: float = 3.0) -> None:
    """Ask workers to drop a queued task's message; BrokerUnavailable if the broker is away."""
    try:
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=timeout)
            app.control.revoke(task_id, connection=conn)
    except (OperationalError, OSError, ConnectionError) as exc:
        raise BrokerUnavailable(
            f"the task queue at {_safe_url(app)} cannot be reached: {exc}"
        ) from exc


def check_broker(app: Celery, *, timeout: float = 3.0) -> None:
    """Raise BrokerUnavailable unless the broker accepts a connection."""
    try:
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=timeout)
    except (OperationalError, OSError, ConnectionError) as exc:
        raise BrokerUnavailable(
            f"the task queue at {_safe_url(app)} cannot be reached: {exc}"
        ) from exc


def _safe_url(app: Celery) -> str:
    with app.connection_for_write() as conn:
        return str(conn.as_uri())  # kombu masks the password
