"""Errors into responses, in one place: JSON for the API, error.html for pages."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from rollout_lens.server.core.errors import (
    BrokerUnavailable,
    DatabaseBehind,
    InvalidInput,
    InvalidState,
    NotFound,
    RolloutLensError,
    RunEnded,
    StepNotFound,
)
from rollout_lens.server.webapp.http.deps import render
from rollout_lens.server.webapp.http.responses import DataResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

HANDLED = (RolloutLensError, StarletteHTTPException, RequestValidationError)

# What every 422 really carries (handle_error): a message, and FastAPI's own list of errors.
# FastAPI documents its default shape (`detail` a list); the published schema says this instead.
VALIDATION_ERROR_SCHEMA: dict[str, Any] = {
    "title": "HTTPValidationError",
    "type": "object",
    "properties": {
        "detail": {"type": "string", "title": "Detail", "description": "what was wrong"},
        "errors": {
            "type": "array",
            "items": {"$ref": "#/components/schemas/ValidationError"},
            "title": "Errors",
            "description": "one entry per invalid field",
        },
    },
    "required": ["detail", "errors"],
}


def publish_error_shapes(app: FastAPI) -> None:
    """Make the app's OpenAPI schema describe the 422 bodies handle_error sends."""
    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = default_openapi()
            components = schema.get("components", {}).get("schemas", {})
            if "HTTPValidationError" in components:
                components["HTTPValidationError"] = VALIDATION_ERROR_SCHEMA
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _describe(exc: Exception) -> tuple[int, str, dict[str, Any]]:
    """Status code, message and extra JSON fields for any error the app turns into a response."""
    if isinstance(exc, StepNotFound):
        return 404, str(exc), {"run_id": exc.run_id, "nearest_step": exc.nearest}
    if isinstance(exc, NotFound):
        return 404, str(exc), {}
    if isinstance(exc, InvalidInput):
        return 400, str(exc), {}
    if isinstance(exc, RunEnded):  # what a recorder reads to stop (server/store/ending.py)
        return 409, str(exc), {"status": exc.status, "ended_by": exc.ended_by}
    if isinstance(exc, InvalidState):
        return 409, str(exc), {}
    if isinstance(exc, DatabaseBehind | BrokerUnavailable):
        return 503, str(exc), {}
    if isinstance(exc, RequestValidationError):
        errors = jsonable_encoder(exc.errors())
        text = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'][1:]) or 'request'}: {e['msg']}" for e in errors
        )
        return 422, f"invalid request: {text}", {"errors": errors}
    if isinstance(exc, StarletteHTTPException):
        return exc.status_code, str(exc.detail), {}
    return 500, str(exc), {}


def _wants_json(request: Request) -> bool:
    if request.url.path.startswith("/api/"):
        return True
    accept = request.headers.get("accept", "")
    return "application/json" in accept and "text/html" not in accept


async def handle_error(request: Request, exc: Exception) -> Response:
    """The one error handler: JSON for the API, error.html for pages."""
    status, message, extra = _describe(exc)
    if _wants_json(request):
        # DataResponse: a 422's echo of its input may hold what UTF-8 cannot (a lone surrogate
        # in a JSON body's "\\ud800"): the answer is sent with it replaced, never a 500.
        return DataResponse({"detail": message} | extra, status_code=status)
    nearest = extra.get("nearest_step")
    context = {
        "status": status,
        "message": message,
        "run_id": extra.get("run_id"),
        "nearest": nearest,
    }
    return render(request, "error.html", context, status_code=status)
