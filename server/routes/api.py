"""The JSON API: every page's data, plus chart series with a cursor for live updates."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from rollout_lens.server import charts, queries
from rollout_lens.server.deps import AlertCacheDep, CacheDep, SessionDep
from rollout_lens.server.routes import launch
from rollout_lens.server.routes.cache import ResponseCache
from rollout_lens.server.routes.params import run_ids, split_list
from sqlalchemy.orm import Session

router = APIRouter(prefix="/api", tags=["runs"])

Order = Literal["asc", "desc"]


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def encode(content: Any) -> bytes:
    """Compact JSON; NaN and infinities (which JSON lacks) become null."""
    try:
        text = json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except ValueError:  # a non-finite float somewhere: rare, so only then walk the data
        text = json.dumps(_finite(content), ensure_ascii=False, separators=(",", ":"))
    return text.encode("utf-8")


class DataResponse(JSONResponse):
    """JSON without a validation pass (the shapes are built by queries)."""

    def render(self, content: Any) -> bytes:
        return encode(content)


@router.get("/runs", response_class=DataResponse)
def list_runs(
    session: SessionDep,
    q: Annotated[
        str, Query(description="words that must all appear in name, model, variant or status")
    ] = "",
    sort: Annotated[str, Query(description=f"one of {', '.join(queries.RUN_SORTS)}")] = "created",
    order: Order = "desc",
    ids: Annotated[
        list[str] | None, Query(description="only these run ids (comma-separated)")
    ] = None,
    after: Annotated[
        int | None, Query(description="only runs newer than this id (or in ids)")
    ] = None,
) -> DataResponse:
    """Runs with status, progress and last-25-step figures (the runs page)."""
    wanted = run_ids(ids) if ids else None
    return DataResponse(
        queries.list_runs(
            session, q=q, sort=sort, descending=order == "desc", ids=wanted, after=after
        )
    )


@router.get("/runs/{run_id}", response_class=DataResponse)
def get_run(session: SessionDep, cache: AlertCacheDep, run_id: int) -> DataResponse:
    """A run's card, its first and last recorded steps, the names of its series, its live state
    (place in the queue, speed, ETA) and its alerts (the run page)."""
    overview = queries.run_overview(session, run_id=run_id)
    return DataResponse(overview | {"alerts": run_alerts(session, cache, run_id)})


def run_alerts(
    session: Session, cache: ResponseCache, run_id: int, version: str | None = None
) -> list[dict[str, Any]]:
    """A run's alerts, computed once per version of the run (they read every step)."""
    version = version or queries.run_version(session, run_id=run_id)
    key = f"alerts@{version}"
    body = cache.get(key)
    if body is None:
        body = encode(queries.alerts(session, run_id=run_id))
        cache.put(key, body)
    found: list[dict[str, Any]] = json.loads(body)
    return found


@router.get("/runs/{run_id}/progress", response_class=DataResponse)
def get_progress(session: SessionDep, run_id: int) -> DataResponse:
    """A run's live state: status, step, place in the queue, steps per second, ETA, and whether
    it can be cancelled or resumed. Cheap (a few index seeks): what live pages poll."""
    return DataResponse(queries.run_live(session, run_id=run_id))


@router.get("/runs/{run_id}/series", response_class=DataResponse)
def get_series(
    request: Request,
    session: SessionDep,
    cache: CacheDep,
    run_id: int,
    names: Annotated[
        list[str] | None, Query(description="series names, comma-separated (default: all)")
    ] = None,
    since: Annotated[int, Query(ge=0, description="only steps after this one (the cursor)")] = 0,
    until: Annotated[int | None, Query(ge=0, description="only steps up to this one")] = None,
    full: Annotated[bool, Query(description="every step, never downsampled")] = False,
    max_points: Annotated[
        int, Query(ge=10, le=100_000, description="points per series before downsampling")
    ] = charts.MAX_POINTS,
) -> Response:
    """Chart series for steps in (since, until] with their 25-step buckets.

    Pass the response's `cursor` as the next `since` to receive only new steps. Long ranges are
    downsampled: see `method` in the response. Responses carry an ETag that changes with every
    recorded step; a full history (since=0) of an unchanged run is served from memory.
    """
    wanted = split_list(names) if names else None
    return _versioned(
        request,
        session,
        cache,
        run_id,
        lambda: queries.series(
            session,
            run_id=run_id,
            names=wanted,
            since=since,
            until=until,
            max_points=None if full else max_points,
        ),
        keep=since == 0,  # live polls (since > 0) are small, and each is asked for once
    )


@router.get("/runs/{run_id}/alerts", response_class=DataResponse)
def get_alerts(
    request: Request,
    session: SessionDep,
    cache: CacheDep,
    run_id: int,
    since: Annotated[int, Query(ge=0, description="only alerts after this step (the cursor)")] = 0,
) -> Response:
    """Alerts (control-token spike, collapse, reward hacking, signal loss) with their steps."""
    return _versioned(
        request,
        session,
        cache,
        run_id,
        lambda: queries.alerts(session, run_id=run_id, since=since),
        keep=since == 0,
    )


@router.get("/alerts", response_class=DataResponse)
def list_alerts(
    request: Request,
    session: SessionDep,
    cache: AlertCacheDep,
    runs: Annotated[list[str], Query(description="run ids, comma-separated")],
) -> DataResponse:
    """Alerts of several runs at once (the runs page's badges): run id → alerts, oldest first,
    each with the URL of the step where it fired."""
    out: dict[str, Any] = {}
    for run_id, version in queries.run_versions(session, run_ids=run_ids(runs)).items():
        found = run_alerts(session, cache, run_id, version)
        for alert in found:
            alert["url"] = str(
                request.app.url_path_for("step_page", run_id=run_id, step=alert["step"])
            )
        out[str(run_id)] = found
    return DataResponse(out)


@router.get("/presets", response_class=DataResponse)
def list_presets() -> DataResponse:
    """The launch form as data: its presets and every RunConfig field with default, help and
    bounds (launch with POST /api/runs)."""
    fields = [
        {k: v for k, v in spec.items() if k not in ("value", "error")}
        for group in launch.field_specs({}, {})
        for spec in group["fields"]
    ]
    return DataResponse(
        {"presets": [p.as_dict() for p in launch.PRESETS.values()], "fields": fields}
    )


def _versioned(
    request: Request,
    session: SessionDep,
    cache: CacheDep,
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


@router.get("/runs/{run_id}/steps/{step}", response_class=DataResponse)
def get_step(session: SessionDep, run_id: int, step: int) -> DataResponse:
    """One step: its metrics, groups, vote histograms and rollouts with per-token arrays."""
    return DataResponse(queries.step_detail(session, run_id=run_id, step=step))


@router.get("/compare", response_class=DataResponse)
def get_compare(
    session: SessionDep,
    runs: Annotated[list[str], Query(description="two or more run ids, comma-separated")],
    step: Annotated[int | None, Query(ge=0, description="the step shown side by side")] = None,
) -> DataResponse:
    """Runs side by side: series, summary (convergence, stability, cost), config diff, one step."""
    return DataResponse(queries.compare(session, run_ids=run_ids(runs), step=step))
