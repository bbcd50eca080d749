"""Alerts that reach people: each new alert POSTed to ROLLOUT_LENS_ALERT_WEBHOOK's URLs.

A background task of the web app (beside the sweeper) looks for alerts not yet delivered every
POLL_SECONDS, off the recording path (the recorder only writes the alert row: a slow or dead
receiver never slows recording). Each alert is claimed first (`notify_state` NULL → `sending`,
one UPDATE that only one dashboard process wins), so it is sent at most once however many web
processes run; then it is POSTed to every URL as a Slack-compatible JSON body (`text` in Slack's
mrkdwn, with the run, kind, step, message and links beside it as fields of their own), retried
with backoff (ATTEMPTS) on a connection error, a 429 or a 5xx, and marked `sent` or
`failed` with the reason (`notify_error`), which the run page shows.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from rollout_lens.server.core.retry import Backoff, retry
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.store.models import AlertRow, RunRow
from rollout_lens.server.webapp.pages.page_context import alert_mismatch, alert_rollouts
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, sessionmaker

if TYPE_CHECKING:
    import httpx

POLL_SECONDS = 2.0
ATTEMPTS = 6  # at one URL, a Backoff's 0.5, 1, 2, 4 and 8 s apart
BATCH = 50
log = logging.getLogger(__name__)


def slack_escape(text: str) -> str:
    """Text for Slack's mrkdwn: its three control characters escaped (a run name or message
    cannot make a link or a mention)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def payload(alert: AlertRow, run: RunRow, base_url: str) -> dict[str, Any]:
    """The JSON body of one alert."""
    base = base_url.rstrip("/")
    run_url = f"{base}/runs/{run.id}"
    filters = alert_rollouts({"step": alert.step, "kind": alert.kind})
    rollouts_url = f"{run_url}/rollouts?{urlencode(filters)}"
    drill = alert_mismatch({"step": alert.step, "kind": alert.kind})
    mismatch_url = None if drill is None else f"{run_url}/mismatch?{urlencode(drill)}"
    text = (
        f":warning: *{slack_escape(alert.kind)}* at step {alert.step} of run "
        f"<{run_url}|{slack_escape(run.name)}>: {slack_escape(alert.message)} "
        f"(<{rollouts_url}|the rollouts>"
        + ("" if mismatch_url is None else f", <{mismatch_url}|the tokens>")
        + ")"
    )
    extra = {} if mismatch_url is None else {"mismatch_url": mismatch_url}
    return {
        "text": text,
        "run_id": run.id,
        "run": run.name,
        "kind": alert.kind,
        "series": alert.series,
        "step": alert.step,
        "message": alert.message,
        "run_url": run_url,
        "rollouts_url": rollouts_url,
        **extra,
    }


def _claim(factory: sessionmaker[Session]) -> list[tuple[AlertRow, RunRow]]:
    """Alerts waiting for delivery, each claimed by this process (`sending`)."""
    with session_scope(factory) as session:
        waiting = session.scalars(
            select(AlertRow.id).where(AlertRow.notify_state.is_(None)).order_by(AlertRow.id)
        ).all()[:BATCH]
        claimed = []
        for alert_id in waiting:
            result = session.execute(
                update(AlertRow)
                .where(AlertRow.id == alert_id, AlertRow.notify_state.is_(None))
                .values(notify_state="sending")
            )
            if getattr(result, "rowcount", 0) == 1:
                claimed.append(alert_id)
        rows = session.execute(
            select(AlertRow, RunRow)
            .join(RunRow, RunRow.id == AlertRow.run_id)
            .where(AlertRow.id.in_(claimed))
            .order_by(AlertRow.id)
        ).all()
        # Every object at once: two alerts of one run share its RunRow, and expunging it a second
        # time raised, rolling back the claim, so alerts that waited together were never sent.
        session.expunge_all()
        return [(alert, run) for alert, run in rows]


class _Undelivered(Exception):
    """An attempt at one URL that may succeed if tried again (a connection error, 429, 5xx)."""


def _send(
    client: httpx.Client, url: str, body: dict[str, Any], sleep: Any = time.sleep
) -> str | None:
    """POST `body` to `url`, retried with backoff (ATTEMPTS); None when delivered, else
    why not."""

    def attempt() -> str | None:
        try:
            response = client.post(url, json=body)
        except Exception as exc:  # noqa: BLE001 - httpx.HTTPError and kin: said, and retried
            raise _Undelivered(f"{type(exc).__name__}: {exc}") from exc
        if response.status_code < 300:
            return None
        why = f"HTTP {response.status_code} {response.reason_phrase}"
        if response.status_code != 429 and response.status_code < 500:
            return why  # the receiver refuses it: asking again changes nothing
        raise _Undelivered(why)

    backoff = Backoff(tries=ATTEMPTS)
    try:
        return retry(
            attempt, backoff=backoff, retryable=lambda e: isinstance(e, _Undelivered), sleep=sleep
        )
    except _Undelivered as exc:
        return f"{exc} (after {backoff.attempts} attempts)"


def deliver_waiting(factory: sessionmaker[Session], urls: list[str], base_url: str) -> int:
    """Deliver the alerts waiting now; how many were handled."""
    claimed = _claim(factory)
    if not claimed:
        return 0
    import httpx  # here: the web app starts without it

    with httpx.Client(timeout=httpx.Timeout(10.0, connect=5.0)) as client:
        for alert, run in claimed:
            body = payload(alert, run, base_url)
            failures = [f"{url}: {why}" for url in urls if (why := _send(client, url, body))]
            with session_scope(factory) as session:
                session.execute(
                    update(AlertRow)
                    .where(AlertRow.id == alert.id)
                    .values(
                        notify_state="failed" if failures else "sent",
                        notify_error="; ".join(failures)[:2000] if failures else None,
                    )
                )
            if failures:
                log.warning("alert %d of run %d not delivered: %s", alert.id, run.id, failures)
    return len(claimed)


def failed_deliveries(session: Session, *, run_id: int) -> str:
    """What the run page says about alerts that did not reach their webhook ("" if none)."""
    count, last = session.execute(
        select(func.count(AlertRow.id), func.max(AlertRow.id)).where(
            AlertRow.run_id == run_id, AlertRow.notify_state == "failed"
        )
    ).one()
    if not count:
        return ""
    error = session.scalar(select(AlertRow.notify_error).where(AlertRow.id == last)) or ""
    plural = "s" if count != 1 else ""
    return (
        f"{count} alert{plural} of this run could not be delivered to the alert webhook "
        f"(ROLLOUT_LENS_ALERT_WEBHOOK); the last: {error}"
    )


async def deliver_alerts(
    factory: sessionmaker[Session], urls: list[str], base_url: str, *, every: float
) -> None:
    """Forever: deliver new alerts (see the module docstring)."""
    while True:
        try:
            handled = await asyncio.to_thread(deliver_waiting, factory, urls, base_url)
        except Exception:  # a database hiccup must not end the deliveries
            log.exception("could not deliver alerts")
            handled = 0
        if not handled:
            await asyncio.sleep(every)
