"""Downloads: a run's export file (JSONL or Parquet; its per-step series as CSV too), and a
step's rollouts with every array (JSON Lines), streamed."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from rollout_lens.server import store
from rollout_lens.server.exchange import export
from rollout_lens.server.store.serialize import rollout_dict
from rollout_lens.server.webapp import queries
from rollout_lens.server.webapp.http.deps import SessionDep
from rollout_lens.server.webapp.http.params import RunId, StepNo
from rollout_lens.server.webapp.http.responses import JSON_LINES, encode, json_lines
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


@router.get(
    "/runs/{run_id}/steps/{step}/rollouts.jsonl",
    name="step_rollouts",
    response_class=StreamingResponse,
    summary="Get every rollout of a step, with every array",
    responses=json_lines("a rollout, in group and index order"),
)
def step_rollouts(
    request: Request, session: SessionDep, run_id: RunId, step: StepNo
) -> StreamingResponse:
    """The rollouts the update at `step` trained on, whole, in one streamed answer: a line a
    rollout (the group JSON's rollout keys, every token position and the whole text), in group
    and index order, read a batch at a time. `/api/runs/{run_id}/steps/{step}/groups/{group}`
    pages one group with its summary; this reads a step of any size in one request."""
    queries.step_head(session, run_id=run_id, step=step)  # a 404 (the nearest step) now
    return StreamingResponse(
        _step_lines(request.app.state.session_factory, run_id, step),
        media_type=JSON_LINES,
    )


def _step_lines(factory: sessionmaker[Session], run_id: int, step: int) -> Iterator[bytes]:
    """A step's rollouts as JSON Lines, in the export's chunks."""
    with factory() as session:
        tokens = list(store.get_run(session, run_id=run_id).control_tokens)
        texts = store.token_texts(session, run_id=run_id)
        rows = store.iter_rollouts(session, run_id=run_id, step=step)
        yield from export.byte_chunks(
            encode(rollout_dict(row, prompt, tokens, texts)) + b"\n" for row, prompt in rows
        )
