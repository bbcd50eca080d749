"""Downloads: a run's export file (JSONL or Parquet; its per-step series as CSV too), streamed."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from rollout_lens.server import store
from rollout_lens.server.exchange import export
from rollout_lens.server.webapp.http.deps import SessionDep
from rollout_lens.server.webapp.http.params import RunId
from sqlalchemy.orm import Session, sessionmaker

router = APIRouter(prefix="/api", tags=["export"])


@router.get(
    "/runs/{run_id}/export",
    name="export_run",
    response_class=StreamingResponse,
    summary="Export a run",
)
def export_run(
    request: Request,
    session: SessionDep,
    run_id: RunId,
    format: Annotated[
        Literal["jsonl", "parquet", "csv"], Query(description="csv: with what=steps only")
    ] = "jsonl",
    what: Annotated[
        Literal["rollouts", "steps"],
        Query(description="rollouts: the whole run, importable; steps: the per-step series"),
    ] = "rollouts",
) -> StreamingResponse:
    """The run as a file to download (what `rollout-lens export` writes), streamed in chunks."""
    export.check(format, what)
    store.get_run(session, run_id=run_id)  # a 404 now, not a broken download later
    name = export.filename(run_id, format, what)
    return StreamingResponse(
        _chunks(request.app.state.session_factory, run_id, format, what),
        media_type=export.MEDIA_TYPES[format],
        headers={"Content-Disposition": f'attachment; filename="{name}"'},
    )


def _chunks(factory: sessionmaker[Session], run_id: int, fmt: str, what: str) -> Iterator[bytes]:
    """The file's chunks, read in a session of their own (the request's closes first)."""
    with factory() as session:
        yield from export.export_chunks(session, run_id=run_id, fmt=fmt, what=what)
