"""JSON bodies the API and pages send: compact encoding, and responses cached by run version."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlencode

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from rollout_lens.server import store
from rollout_lens.server.core import textsafe
from rollout_lens.server.store import serialize
from rollout_lens.server.webapp import queries
from rollout_lens.server.webapp.http.cache import ResponseCache
from rollout_lens.server.webapp.pages import page_context
from sqlalchemy.orm import Session

JSON_LINES = "application/x-ndjson"  # a streamed answer of one JSON object a line


def json_lines(each: str) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI `responses` of a route answering JSON Lines, one line `each`."""
    schema = {"type": "string", "description": "a JSON object a line"}
    return {
        200: {
            "description": f"JSON Lines: a line {each}",
            "content": {JSON_LINES: {"schema": schema}},
        }
    }


def encode(content: Any) -> bytes:
    """Compact JSON; NaN and infinities (which JSON lacks) become null, a lone surrogate stored
    before writes were cleaned U+FFFD (textsafe.utf8)."""
    return textsafe.utf8(textsafe.finite_json(content, ensure_ascii=False, separators=(",", ":")))


class DataResponse(JSONResponse):
    """JSON without a validation pass (the shapes are built by queries)."""

    def render(self, content: Any) -> bytes:
        return encode(content)


def memo(cache: ResponseCache) -> queries.Memo:
    """queries.Memo over `cache`: a part computed once per key (its run's version), kept as JSON."""

    def remember(key: str, compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        body = cache.get(key)
        if body is not None:
            kept: dict[str, Any] = json.loads(body)
            return kept
        value = compute()
        cache.put(key, encode(value))
        return value

    return remember


def run_alerts(
    request: Request,
    session: Session,
    cache: ResponseCache,
    run_id: int,
    version: str | None = None,
) -> list[dict[str, Any]]:
    """A run's alerts, computed once per version of the run (they read every step), each with
    the URL of its step."""
    version = version or queries.run_version(session, run_id=run_id)
    key = f"alerts@{version}"
    body = cache.get(key)
    if body is None:
        body = encode(queries.alerts(session, run_id=run_id))
        cache.put(key, body)
    return with_step_urls(request, session, run_id, json.loads(body))


def alerts_of_runs(
    request: Request, session: Session, cache: ResponseCache, run_ids: Sequence[int]
) -> dict[str, list[dict[str, Any]]]:
    """Run id → its alerts, for several runs (missing runs are left out)."""
    return {
        str(run_id): run_alerts(request, session, cache, run_id, version)
        for run_id, version in queries.run_versions(session, run_ids=run_ids).items()
    }


def with_step_urls(
    request: Request, session: Session, run_id: int, alerts: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Alerts as every page and script renders them: FiredAlert.as_dict plus the step's page and the
    explorer showing the rollouts that tripped it (page_context.alert_rollouts; what it may filter on
    depends on what the run judged), and a mismatch alert's drill-down (`mismatch_url`)."""
    if not alerts:
        return alerts
    explorer = str(request.app.url_path_for("explorer_page", run_id=run_id))
    format_judged = serialize.judged(store.get_run(session, run_id=run_id))["format_valid"]
    for alert in alerts:
        url = request.app.url_path_for("step_page", run_id=run_id, step=alert["step"])
        alert["url"] = str(url)
        filters = page_context.alert_rollouts(alert, format_judged=format_judged)
        alert["rollouts_url"] = f"{explorer}?{urlencode(filters)}"
        drill = page_context.alert_mismatch(alert)
        if drill is not None:
            drill_path = request.app.url_path_for("mismatch_page", run_id=run_id)
            alert["mismatch_url"] = f"{drill_path}?{urlencode(drill)}"
    return alerts


def versioned(
    request: Request,
    session: Session,
    cache: ResponseCache,
    run_id: int,
    compute: Callable[[], Any],
    *,
    keep: bool,
) -> Response:
    """A response keyed by the run's version: ETag + 304 for the browser, bytes from memory for
    a repeat of a full-history request (`keep`) while the run has not changed."""
    version = queries.run_version(session, run_id=run_id)
    key = f"{request.url.path}?{sorted(request.query_params.multi_items())}@{version}"
    etag = f'"{hashlib.sha256(key.encode()).hexdigest()[:20]}"'
    headers = {"ETag": etag, "Cache-Control": "no-cache"}  # no-cache: revalidate, get a 304
    if request.headers.get("if-none-match") == etag:
        return Response(status_code=304, headers=headers)
    body = cache.get(key)
    if body is None:
        body = encode(compute())
        if keep:
            cache.put(key, body)
    return Response(body, media_type="application/json", headers=headers)
