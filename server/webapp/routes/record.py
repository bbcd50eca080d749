"""Recording over HTTP: a trainer (RolloutLensCallback(url=...)) or the CLI (`--url`) creates a
run and sends its steps (server.webapp.ingest; the body's format: server.exchange.wire).

Who may call these is decided first by the Guard (server/webapp/http/security.py): with tokens
set, a full access token or a recording token (ROLLOUT_LENS_RECORD_TOKEN), checked before the
body is read, and the steps body may be up to ROLLOUT_LENS_RECORD_MAX_MB.

A run that has ended (cancelled from the dashboard, finished by its recorder) answers steps,
heartbeats and a finish with another status with 409 `{"detail", "status", "ended_by"}`
(RunEnded, server/store/ending.py): the recorder stops there, and stops training on `cancelled`.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, field_validator
from rollout_lens.server.core import textsafe
from rollout_lens.server.core.errors import InvalidInput, StepOutOfOrder, StepRefused
from rollout_lens.server.exchange.bounds import MAX_INT32, check_depth
from rollout_lens.server.store.models import RunStatus
from rollout_lens.server.webapp.ingest import Busy, Caller, Forbidden, Ingest, Superseded
from sqlalchemy.exc import IntegrityError, OperationalError
from starlette.concurrency import run_in_threadpool

router = APIRouter(prefix="/api/record", tags=["recording"])

# A body is read while its route holds one of the dashboard's write slots (Ingest.slot): one
# that has not arrived whole in this long is a 408 and gives its slot back.
BODY_SECONDS = 120.0
_SLOW_BODY = (
    f"the request body did not arrive within {BODY_SECONDS:.0f} s (bodies are read while one "
    "of the dashboard's few write slots is held): send it again"
)

KEY = re.compile(r"^[A-Za-z0-9_.:-]{8,64}$")
# The run's key on every request about it: a recorder whose run was deleted gets a 404, never
# the run SQLite gave the same id to next.
RECORD_KEY_HEADER = "x-record-key"
# The OpenAPI description of a raw binary request body (a wire body, an export file).
BINARY_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    }
}
RunPath = Annotated[int, Path(ge=1, le=MAX_INT32, description="The run's id")]
Count = Annotated[int | None, Query(ge=0, le=MAX_INT32)]
Epoch = Annotated[
    int | None,
    Query(
        ge=0,
        le=MAX_INT32,
        description="the record epoch the create answered: a recorder a resumed trainer "
        "replaced (an older epoch) is answered 409 with status `superseded`",
    ),
]


class RecordRun(BaseModel):
    """A run a recorder creates (RolloutLensCallback's RunSpec)."""

    key: str = Field(description="The recorder's own key for the run (8-64 of A-Z a-z 0-9 _.:-)")
    name: str = Field(min_length=1, max_length=200)
    model: str = Field("", max_length=500)
    total_steps: int = Field(0, ge=0, le=MAX_INT32)
    group_size: int = Field(1, ge=1, le=MAX_INT32)
    prompts_per_step: int = Field(1, ge=1, le=MAX_INT32)
    seed: int = Field(0, ge=-(2**31), le=MAX_INT32)
    config: dict[str, Any] = Field(default_factory=dict)
    control_tokens: list[Annotated[str, Field(min_length=1, max_length=100)]] = Field(
        default_factory=list, max_length=64
    )
    device: str = Field("", max_length=64)
    worker_host: str = Field("", max_length=255)
    notes: list[Annotated[str, Field(max_length=4000)]] = Field(
        default_factory=list, max_length=100
    )
    keep_tokens_every: int | None = Field(None, ge=1, le=MAX_INT32)
    resume_step: int | None = Field(
        None,
        ge=0,
        le=MAX_INT32,
        description="A trainer resumed from its checkpoint at this step: the key's run continues "
        "(its steps after it are deleted; it is running again under a new epoch)",
    )

    @field_validator("key")
    @classmethod
    def _key(cls, value: str) -> str:
        if not KEY.match(value):
            raise ValueError("8 to 64 characters of A-Z a-z 0-9 _ . : -")
        return value

    @field_validator(
        "name", "model", "device", "worker_host", "control_tokens", "notes", "config", mode="before"
    )
    @classmethod
    def _unicode(cls, value: Any) -> Any:
        # A JSON body's "\\ud800" decodes to a str UTF-8 cannot hold: refused here, naming the
        # field (pydantic's own message for a str field is obscure, and config takes any str).
        where = _lone_surrogate(value)
        if where is not None:
            raise ValueError(
                f"not valid Unicode: {where + ' holds ' if where else ''}a lone surrogate (half "
                "of a UTF-16 pair, which UTF-8 cannot encode)"
            )
        return value

    @field_validator("config")
    @classmethod
    def _config(cls, value: dict[str, Any]) -> dict[str, Any]:
        try:
            check_depth(value, "config")
        except InvalidInput as exc:
            raise ValueError(str(exc)) from None
        return value


def _lone_surrogate(value: Any) -> str | None:
    """Where in a JSON value a string or a key is not valid Unicode: "" for the value itself,
    `[2]`, `["key"]`…; None when all are. Walked without recursion (a config nests deep)."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str) and not textsafe.encodable(item):
            return where
        if isinstance(item, dict):
            for key, child in item.items():
                inner = textsafe.clip(f"{where}[{json.dumps(key)}]", 200)
                if isinstance(key, str) and not textsafe.encodable(key):
                    return inner
                stack.append((child, inner))
        elif isinstance(item, list):
            stack.extend((child, f"{where}[{i}]") for i, child in enumerate(item))
    return None


class Alive(BaseModel):
    dropped_steps: int | None = Field(None, ge=0, le=MAX_INT32)
    dropped_rollouts: int | None = Field(None, ge=0, le=MAX_INT32)


class Finish(Alive):
    status: RunStatus = RunStatus.completed
    error: str | None = Field(None, max_length=20_000)

    @field_validator("status")
    @classmethod
    def _ended(cls, value: RunStatus) -> RunStatus:
        if value in (RunStatus.queued, RunStatus.running):
            raise ValueError("a run ends completed, failed, cancelled or lost")
        return value


class WireRefusal(BaseModel):
    detail: str
    field: str | None = Field(None, description="what is at fault: `steps[2].rollouts[17].ids`")
    errors: list[dict[str, Any]] | dict[str, Any] | None = None  # a query parameter's


class RecordedRun(BaseModel):
    id: int
    name: str
    url: str = Field(description="the run's page")
    created: bool = Field(description="false: the run this key created before")
    epoch: int = Field(description="the run's record epoch: send it with its steps")


class Written(BaseModel):
    run_id: int
    written: list[int] = Field(description="the steps written by this request")
    already: list[int] = Field(description="steps the run had already (not written again)")
    rollouts: int


class Acknowledged(BaseModel):
    run_id: int
    status: str | None = None


class Ended(BaseModel):
    """A 409: the run has ended and records nothing more (the recorder stops)."""

    detail: str
    status: str = Field(description="the run's status: `cancelled` tells the trainer to stop")
    ended_by: str | None = Field(
        None, description="who ended it: `dashboard (token 1a2b3c4d)`, `recorder`, …"
    )


ENDED: dict[int | str, dict[str, Any]] = {
    409: {"description": "The run has ended: it records nothing more", "model": Ended}
}


def _ingest(request: Request) -> Ingest:
    ingest: Ingest = request.app.state.ingest
    return ingest


def _caller(request: Request) -> Caller:
    state = request.scope.get("state", {})
    key = request.headers.get(RECORD_KEY_HEADER)
    return Caller(
        scope=state.get("token_scope"),
        token_fp=state.get("token_fp"),
        key=key if key and KEY.match(key) else None,
    )


def _refused(code: int, message: str, /, **extra: Any) -> JSONResponse:
    return JSONResponse({"detail": message} | extra, status_code=code)


async def _read_body(request: Request) -> bytes | None:
    """The body, read while the route holds a write slot; None when it takes longer than
    BODY_SECONDS (a sender that trickles it must not hold the slot)."""
    try:
        return await asyncio.wait_for(request.body(), BODY_SECONDS)
    except TimeoutError:
        return None


def _dropped(steps: int | None, rollouts: int | None) -> tuple[int, int] | None:
    if steps is None and rollouts is None:
        return None
    return steps or 0, rollouts or 0


@router.post(
    "/runs",
    summary="Create (or find) a recorded run",
    responses={
        200: {"description": "The run this key created before", "model": RecordedRun},
        201: {"description": "The run, created running", "model": RecordedRun},
        403: {"description": "The key's run belongs to another token"},
        409: {"description": "`resume_step` given and the key's run completed or cancelled"},
    },
)
def create_run(request: Request, body: RecordRun) -> Response:
    try:
        run, created = _ingest(request).create_run(_caller(request), body.model_dump())
    except Forbidden as exc:
        return _refused(403, str(exc))
    url = str(request.app.url_path_for("run_page", run_id=run.id))
    return JSONResponse(
        {
            "id": run.id,
            "name": run.name,
            "url": url,
            "created": created,
            "epoch": run.record_epoch,
        },
        status_code=201 if created else 200,
    )


@router.post(
    "/runs/{run_id}/steps",
    summary="Record steps (the binary body of server.exchange.wire)",
    openapi_extra=BINARY_BODY,
    responses={
        200: {"description": "Steps written and those the run had already", "model": Written},
        403: {"description": "A run this token did not create"},
        404: {"description": "No such run (deleted): the recorder stops recording"},
        409: {
            "description": "The run has ended (`status`, `ended_by`: it records nothing more), "
            "the sender's epoch is superseded (`status`), a step the run does not have comes "
            "before its last (`step`, `last`: a resumed trainer says so when it starts), or a "
            "step's rollouts were generated at a step whose rollouts the run has already "
            "(`step`); the run's notes say so",
            "model": Ended,
        },
        408: {"description": "The body took longer than BODY_SECONDS to arrive: retry"},
        413: {"description": "The body is larger than ROLLOUT_LENS_RECORD_MAX_MB"},
        422: {"description": "A field of the body is invalid", "model": WireRefusal},
        503: {
            "description": "The dashboard is writing other bodies (with Retry-After, answered "
            "before this body is read), or the database is busy or away: retry"
        },
    },
)
async def record_steps(
    request: Request,
    run_id: RunPath,
    dropped_steps: Count = None,
    dropped_rollouts: Count = None,
    epoch: Epoch = None,
    steps: Annotated[
        str | None,
        Query(
            max_length=4000,
            pattern=r"^[0-9]{1,10}(,[0-9]{1,10}){0,255}$",
            description="the steps the body holds (a retry of steps the run has is answered "
            "from them, undecoded)",
        ),
    ] = None,
) -> Response:
    from rollout_lens.server.exchange import wire  # pyarrow: loaded on the first recording

    ingest, caller = _ingest(request), _caller(request)
    dropped = _dropped(dropped_steps, dropped_rollouts)
    claimed = [int(s) for s in steps.split(",") if int(s) <= MAX_INT32] if steps else []
    try:
        checked = await run_in_threadpool(
            ingest.check, caller, run_id, claimed=claimed, epoch=epoch
        )
        if checked.answer is not None:  # a retry of steps the run has: no body, no slot
            return JSONResponse(checked.answer)
        with ingest.slot("these"):  # a busy dashboard answers before it reads the body
            data = await _read_body(request)  # bounded by the Guard
            if data is None:
                return _refused(408, _SLOW_BODY)
            answer = await run_in_threadpool(
                ingest.write, checked, data, dropped=dropped, claimed=claimed, epoch=epoch
            )
    except Forbidden as exc:
        return _refused(403, str(exc))
    except Superseded as exc:
        return _refused(409, str(exc), status="superseded")
    except StepOutOfOrder as exc:
        return _refused(409, str(exc), step=exc.step, last=exc.last)
    except StepRefused as exc:  # rollouts the run has already (RolloutsTaken)
        return _refused(409, str(exc), step=exc.step)
    except Busy as exc:
        return JSONResponse({"detail": str(exc)}, status_code=503, headers={"retry-after": "1"})
    except wire.WireInvalid as exc:
        return _refused(422, str(exc), field=exc.field)
    except (IntegrityError, OperationalError):
        return JSONResponse(
            {
                "detail": "the steps could not be written now (the database is busy or another "
                "write of them raced this one): send them again"
            },
            status_code=503,  # no Retry-After: the recorder backs off as from a database away
        )
    return JSONResponse(answer)


class ImportedRun(BaseModel):
    id: int
    name: str
    steps: int
    rollouts: int
    url: str = Field(description="the run's page")


@router.post(
    "/import",
    status_code=201,
    summary="Import an export file (JSONL or Parquet)",
    openapi_extra=BINARY_BODY,
    responses={
        201: {"description": "The run it created", "model": ImportedRun},
        400: {
            "description": "The file is damaged (the line is named) or would decode to more "
            "than the dashboard holds at once; nothing was created"
        },
        408: {"description": "The file took longer than BODY_SECONDS to arrive: retry"},
        413: {"description": "The file is larger than ROLLOUT_LENS_RECORD_MAX_MB"},
        503: {
            "description": "The dashboard is writing other recordings (answered before the file "
            "is read): send it again"
        },
    },
)
async def import_file(
    request: Request,
    name: Annotated[str | None, Query(min_length=1, max_length=200)] = None,
    moved: Annotated[bool, Query(description="a TRL or verl import made elsewhere")] = False,
) -> Response:
    ingest = _ingest(request)
    try:
        with ingest.slot("the file"):  # a busy dashboard answers before it reads the file
            data = await _read_body(request)  # bounded by the Guard
            if data is None:
                return _refused(408, _SLOW_BODY)
            done = await run_in_threadpool(ingest.import_file, data, name=name, moved=moved)
    except Busy as exc:
        return JSONResponse({"detail": str(exc)}, status_code=503, headers={"retry-after": "1"})
    url = str(request.app.url_path_for("run_page", run_id=done["id"]))
    return JSONResponse(done | {"url": url}, status_code=201)


@router.post(
    "/runs/{run_id}/heartbeat",
    summary="Say a recorder is alive (and what it dropped)",
    responses={200: {"model": Acknowledged}, **ENDED},
)
def heartbeat(
    request: Request, run_id: RunPath, body: Alive | None = None, epoch: Epoch = None
) -> Response:
    body = body or Alive(dropped_steps=None, dropped_rollouts=None)
    try:
        _ingest(request).heartbeat(
            _caller(request),
            run_id,
            dropped=_dropped(body.dropped_steps, body.dropped_rollouts),
            epoch=epoch,
        )
    except Forbidden as exc:
        return _refused(403, str(exc))
    except Superseded as exc:
        return _refused(409, str(exc), status="superseded")
    return JSONResponse({"run_id": run_id})


@router.post(
    "/runs/{run_id}/finish",
    summary="End a recorded run",
    responses={
        200: {"description": "Ended (or it had ended with this status)", "model": Acknowledged},
        **ENDED,
    },
)
def finish(request: Request, run_id: RunPath, body: Finish, epoch: Epoch = None) -> Response:
    ingest, caller = _ingest(request), _caller(request)
    try:
        ingest.finish(
            caller,
            run_id,
            status=body.status,
            error=body.error,
            dropped=_dropped(body.dropped_steps, body.dropped_rollouts),
            epoch=epoch,
        )
    except Forbidden as exc:
        return _refused(403, str(exc))
    except Superseded as exc:
        return _refused(409, str(exc), status="superseded")
    return JSONResponse({"run_id": run_id, "status": body.status})
