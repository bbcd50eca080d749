"""Every endpoint that changes something: launch, cancel, resume, delete (JSON API and forms).

Who may call them, and from where, is decided before they run, for every request, by the Guard
middleware (server/webapp/http/security.py): the Host check, the same-origin rule, the access token and the
CSRF token.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Annotated, Any

from fastapi import APIRouter, Body, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, RedirectResponse, Response
from rollout_lens.server.core.errors import BrokerUnavailable, InvalidState, QueueFull
from rollout_lens.server.webapp import control, queries
from rollout_lens.server.webapp.http import api_models, flash
from rollout_lens.server.webapp.http.deps import (
    CeleryDep,
    SessionDep,
    SettingsDep,
    model_builds,
    render,
)
from rollout_lens.server.webapp.http.params import RunId
from rollout_lens.server.webapp.http.responses import DataResponse
from rollout_lens.server.webapp.http.security import caller_name
from rollout_lens.server.webapp.pages import launch_fields
from starlette.concurrency import run_in_threadpool

router = APIRouter()

LAUNCH_EXAMPLES = {
    "config": {
        "summary": "One run: any RunConfig fields (the rest take their defaults)",
        "value": {"variant": "patched", "k": 4, "steps": 150, "seed": 0},
    },
    "preset": {
        "summary": "A preset, with overrides applied to each of its runs",
        "value": {"preset": "leaky_vs_patched", "steps": 100, "seed": 3},
    },
}


# --- launching ----------------------------------------------------------------------------------


def _opened(request: Request, ids: Sequence[int]) -> str:
    """The page a launch opens: the run, or the comparison of its runs."""
    if len(ids) == 1:
        return str(request.app.url_path_for("run_page", run_id=ids[0]))
    return f"{request.app.url_path_for('compare_page')}?runs={','.join(map(str, ids))}"


def _invalid(errors: dict[str, str]) -> RequestValidationError:
    """A 422 in FastAPI's own shape, one entry per field."""
    return RequestValidationError(
        [
            {
                "type": "value_error",
                "loc": ("body",) if name == launch_fields.FORM_ERROR else ("body", name),
                "msg": message,
                "input": None,
            }
            for name, message in errors.items()
        ]
    )


@router.post(
    "/api/runs",
    status_code=201,
    tags=["actions"],
    summary="Launch runs",
    responses={
        201: {
            "description": "The created runs and the page that shows them",
            "model": api_models.Launched,
        },
        409: {
            "description": "The queue is full (ROLLOUT_LENS_MAX_QUEUED_RUNS); nothing was created"
        },
        413: {"description": "The body is larger than 1 MB; nothing was created"},
        422: {"description": "A field failed validation; nothing was created"},
        503: {"description": "The task queue cannot be reached; nothing was created"},
    },
)
def launch_api(
    request: Request,
    session: SessionDep,
    celery: CeleryDep,
    settings: SettingsDep,
    body: Annotated[
        dict[str, Any],
        Body(
            description="RunConfig fields, or `preset` (see GET /api/presets) plus fields that "
            "override the preset in each of its runs.",
            openapi_examples=LAUNCH_EXAMPLES,
        ),
    ],
) -> Response:
    """Launch one run, or every run of a preset; returns them with 201."""
    try:
        configs = launch_fields.configs_from_request(body)
    except launch_fields.LaunchInvalid as exc:
        raise _invalid(exc.errors) from None
    ids = control.launch_runs(session, celery, configs, max_queued=settings.max_queued_runs)
    content = {"runs": queries.matching_runs(session, ids=ids, descending=False)}
    return DataResponse(content | {"url": _opened(request, ids)}, status_code=201)


@router.post("/runs/new", include_in_schema=False)
async def launch_form(
    request: Request, session: SessionDep, celery: CeleryDep, settings: SettingsDep
) -> Response:
    """The launch form's submit: redirect to the new run(s), or the form again with messages."""
    form = await request.form()  # async only for this; the database and broker work is sync
    submitted = {k: str(v) for k, v in form.items()}
    typed, raw = launch_fields.parse_form(submitted)
    preset = launch_fields.submitted_preset(submitted)
    try:
        configs = launch_fields.build_configs(preset, raw)
        ids = await run_in_threadpool(
            partial(control.launch_runs, max_queued=settings.max_queued_runs),
            session,
            celery,
            configs,
        )
    except launch_fields.LaunchInvalid as exc:
        builds = model_builds(request)
        context = launch_fields.form_context(typed, preset=preset, errors=exc.errors, builds=builds)
        return render(request, "new_run.html", context, status_code=422)
    except (BrokerUnavailable, QueueFull) as exc:
        context = launch_fields.form_context(typed, preset=preset, broker_error=str(exc))
        status = 409 if isinstance(exc, QueueFull) else 503
        return render(request, "new_run.html", context, status_code=status)
    return RedirectResponse(_opened(request, ids), status_code=303)


# --- cancel and resume --------------------------------------------------------------------------


@router.post(
    "/api/runs/{run_id}/cancel",
    tags=["actions"],
    summary="Cancel a run",
    responses={200: {"model": api_models.Progress}},
)
def cancel_api(request: Request, session: SessionDep, run_id: RunId) -> JSONResponse:
    """Cancel a queued run at once, and a running run a user's script records (its recorder
    stops training on its next request); ask a launched running one to stop. 409 for a finished
    run."""
    control.cancel(session, run_id, who=caller_name(request))
    return JSONResponse(queries.run_live(session, run_id=run_id))


@router.post(
    "/api/runs/{run_id}/resume",
    tags=["actions"],
    summary="Resume a run",
    responses={200: {"model": api_models.Progress}},
)
def resume_api(
    session: SessionDep, celery: CeleryDep, settings: SettingsDep, run_id: RunId
) -> JSONResponse:
    """Queue a lost, failed or cancelled run again to continue from its last checkpoint."""
    control.resume(session, celery, run_id, max_queued=settings.max_queued_runs)
    return JSONResponse(queries.run_live(session, run_id=run_id))


def _back_to_run(request: Request, run_id: int, notice: str = "") -> RedirectResponse:
    """Back to the run page, with what went wrong as a notice there (a signed flash cookie:
    only the server words notices)."""
    url = str(request.app.url_path_for("run_page", run_id=run_id))
    response = RedirectResponse(url, 303)
    if notice:
        flash.leave(request, response, notice, path=url)
    return response


@router.post("/runs/{run_id}/cancel", include_in_schema=False)
def cancel_form(request: Request, session: SessionDep, run_id: RunId) -> RedirectResponse:
    try:
        control.cancel(session, run_id, who=caller_name(request))
    except InvalidState as exc:  # e.g. it finished while the page was open
        return _back_to_run(request, run_id, str(exc))
    return _back_to_run(request, run_id)


@router.post("/runs/{run_id}/resume", include_in_schema=False)
def resume_form(
    request: Request, session: SessionDep, celery: CeleryDep, settings: SettingsDep, run_id: RunId
) -> RedirectResponse:
    try:
        control.resume(session, celery, run_id, max_queued=settings.max_queued_runs)
    except (InvalidState, BrokerUnavailable) as exc:
        return _back_to_run(request, run_id, f"Not resumed: {exc}")
    return _back_to_run(request, run_id)


# --- delete -------------------------------------------------------------------------------------


@router.delete(
    "/api/runs/{run_id}",
    tags=["actions"],
    summary="Delete a run",
    responses={
        200: {"model": api_models.Deleted},
        409: {"description": "A launched run is training: cancel it first"},
    },
)
def delete_api(
    session: SessionDep, celery: CeleryDep, settings: SettingsDep, run_id: RunId
) -> JSONResponse:
    """Delete a run and everything recorded for it (steps, rollouts, metrics, checkpoints); a
    queued run's message is revoked. A launched running run is refused with 409: cancel it
    first; a running run a user's script records is deleted (the script stops recording)."""
    control.delete(session, celery, settings, run_id)
    return JSONResponse({"deleted": run_id})


@router.post("/runs/{run_id}/delete", include_in_schema=False)
def delete_form(
    request: Request, session: SessionDep, celery: CeleryDep, settings: SettingsDep, run_id: RunId
) -> RedirectResponse:
    try:
        control.delete(session, celery, settings, run_id)
    except InvalidState as exc:
        return _back_to_run(request, run_id, f"Not deleted: {exc}")
    return RedirectResponse(str(request.app.url_path_for("runs_page")), 303)
