"""The dashboard's FastAPI app: create_app(settings) wires database, templates, routes and errors."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import jinja2
from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from markupsafe import Markup, escape
from rollout_lens.server import store
from rollout_lens.server.config import Settings
from rollout_lens.server.db import make_engine, make_session_factory, session_scope
from rollout_lens.server.deps import render
from rollout_lens.server.errors import (
    BrokerUnavailable,
    DatabaseBehind,
    InvalidInput,
    InvalidState,
    NotFound,
    RolloutLensError,
    StepNotFound,
)
from rollout_lens.server.routes import actions, api, exchange, pages
from rollout_lens.server.routes.cache import ResponseCache
from rollout_lens.server.viewer import prob_text
from sqlalchemy.orm import Session, sessionmaker
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import NoMatchFound
from starlette.types import ASGIApp, Message, Receive, Scope, Send

WEB_DIR = Path(__file__).resolve().parent.parent / "web"
TEMPLATES_DIR = WEB_DIR / "templates"
STATIC_DIR = WEB_DIR / "static"
SWAGGER_JS = "vendor/swagger-ui-bundle-5.35.0.js"
SWAGGER_CSS = "vendor/swagger-ui-5.35.0.css"


SWEEP_SECONDS = 10.0
ALERT_CACHE_SIZE = 4096
log = logging.getLogger(__name__)


async def sweep_lost_runs(
    factory: sessionmaker[Session], settings: Settings, *, every: float
) -> None:
    """Forever: mark `lost` the running runs with no heartbeat for settings.lost_after_seconds,
    so a worker killed mid-run leaves no run stuck in `running`."""
    stale_after = timedelta(seconds=settings.lost_after_seconds)

    def sweep() -> list[int]:
        with session_scope(factory) as session:
            return store.mark_lost_runs(session, stale_after=stale_after)

    while True:
        try:
            lost = await asyncio.to_thread(sweep)
            if lost:
                log.warning("runs %s lost: their worker stopped sending heartbeats", lost)
        except Exception:  # a database hiccup must not end the sweeping
            log.exception("could not check for lost runs")
        await asyncio.sleep(every)


def prepare_database(settings: Settings) -> None:
    """Before serving: migrate an SQLite database (the embedded default), else refuse one behind."""
    from rollout_lens.server.migrate import ensure_current, upgrade
    from sqlalchemy.engine import make_url

    engine = make_engine(settings.database_url, busy_timeout_ms=settings.sqlite_busy_timeout_ms)
    try:
        if make_url(settings.database_url).get_backend_name() == "sqlite":
            upgrade(engine)
        else:
            ensure_current(engine)
    finally:
        engine.dispose()


def create_app(
    settings: Settings,
    *,
    session_factory: sessionmaker[Session] | None = None,
    cache_size: int = 64,
    sweep_seconds: float = SWEEP_SECONDS,
) -> FastAPI:
    """The dashboard on the settings' database (or on `session_factory`, which tests pass).

    `cache_size` bounds the series responses kept in memory (0: none, alerts included); every
    `sweep_seconds` the app marks runs whose worker stopped sending heartbeats `lost`.
    """
    engine = None
    if session_factory is None:
        engine = make_engine(settings.database_url, busy_timeout_ms=settings.sqlite_busy_timeout_ms)
        session_factory = make_session_factory(engine)

    factory = session_factory

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        sweeper = asyncio.create_task(sweep_lost_runs(factory, settings, every=sweep_seconds))
        try:
            yield
        finally:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
            if engine is not None:
                engine.dispose()

    app = FastAPI(
        title="Rollout Lens",
        summary="Experiment tracking for GRPO runs: every page's data as JSON.",
        version="0.1.0",
        lifespan=lifespan,
        docs_url=None,  # served below from vendored assets: the dashboard works offline
        redoc_url=None,
    )
    app.add_middleware(ServerTiming)
    app.state.settings = settings
    app.state.session_factory = session_factory
    app.state.response_cache = ResponseCache(cache_size)
    # Alerts per run version: a few hundred bytes each, asked for by every runs page for every
    # run it lists, so many more are kept than whole series responses.
    app.state.alert_cache = ResponseCache(ALERT_CACHE_SIZE if cache_size else 0)
    app.state.templates = _templates()
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    app.include_router(pages.router)
    app.include_router(api.router)
    app.include_router(actions.router)
    app.include_router(exchange.router)
    for exc_type in (RolloutLensError, StarletteHTTPException, RequestValidationError):
        app.add_exception_handler(exc_type, handle_error)

    @app.get("/docs", include_in_schema=False)
    def docs(request: Request) -> HTMLResponse:
        static = request.app.state.templates.env.globals["static"]
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title="Rollout Lens API",
            swagger_js_url=static(SWAGGER_JS),
            swagger_css_url=static(SWAGGER_CSS),
            swagger_favicon_url=static("favicon.svg"),
        )

    return app


class ServerTiming:
    """Adds `Server-Timing: app;dur=<ms>` to every response: the server's own time, for benches
    and the browser's network panel (pure ASGI, so it costs microseconds)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()

        async def timed_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                elapsed = (time.perf_counter() - started) * 1000
                headers = list(message.get("headers", []))
                headers.append((b"server-timing", f"app;dur={elapsed:.2f}".encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, timed_send)


# --- templates ----------------------------------------------------------------------------------


def _static_versions() -> dict[str, str]:
    """Content hashes of the static files, so a changed file gets a new URL (cache busting)."""
    return {
        path.relative_to(STATIC_DIR).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()[:10]
        for path in STATIC_DIR.rglob("*")
        if path.is_file()
    }


def _templates() -> Jinja2Templates:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES_DIR),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    versions = _static_versions()

    @jinja2.pass_context
    def url_for(
        context: Any, name: str, /, _query: dict[str, Any] | None = None, **params: Any
    ) -> str:
        """A root-relative URL of a named route, with an optional query string."""
        request: Request = context["request"]
        path = request.scope.get("root_path", "") + str(request.app.url_path_for(name, **params))
        query = {k: v for k, v in (_query or {}).items() if v not in (None, "")}
        return f"{path}?{urlencode(query, doseq=True)}" if query else path

    def static(path: str) -> str:
        version = versions.get(path)
        return f"/static/{path}" + (f"?v={version}" if version else "")

    @jinja2.pass_context
    def has_route(context: Any, name: str) -> bool:
        """Whether the app serves a route of this name (links to optional pages)."""
        try:
            context["request"].app.url_path_for(name)
        except NoMatchFound:
            return False
        return True

    env.globals.update(url_for=url_for, static=static, has_route=has_route)
    env.filters.update(
        num=fmt_num,
        prob=prob_text,
        pct=fmt_pct,
        money=fmt_money,
        minutes=fmt_minutes,
        when=fmt_when,
        visible=visible_text,
        token=token_text,
    )
    return Jinja2Templates(env=env)


def fmt_num(value: float | int | None, digits: int = 3) -> str:
    """A number for a table cell: fixed decimals for floats, '—' for missing."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    if isinstance(value, bool | int):
        return str(int(value))
    if value != 0 and abs(value) < 10 ** (-digits):
        return f"{value:.{digits - 1}e}"
    return f"{value:.{digits}f}"


def fmt_pct(value: float | None) -> str:
    """0.875 → '87.5%'."""
    return "—" if value is None else f"{value * 100:.1f}%"


def fmt_money(value: float | None) -> str:
    """Dollars with cents."""
    return "—" if value is None else f"${value:,.2f}"


def fmt_minutes(value: float | None) -> str:
    """Device-minutes with one decimal."""
    return "—" if value is None else f"{value:,.1f}"


def fmt_when(value: str | datetime | None) -> str:
    """An ISO timestamp as 'YYYY-MM-DD HH:MM' UTC."""
    if value is None:
        return "—"
    moment = datetime.fromisoformat(value) if isinstance(value, str) else value
    return moment.strftime("%Y-%m-%d %H:%M UTC")


_CONTROL_CHARS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def _picture(match: re.Match[str]) -> str:
    code = ord(match.group())
    symbol = "\u2421" if code == 0x7F else chr(0x2400 + code)  # Unicode control pictures
    return f'<span class="cc" title="control character U+{code:04X}">{symbol}</span>'


def visible_text(text: str | None) -> Markup:
    """Escaped text whose control characters show as their Unicode pictures (␇) instead of vanishing."""
    escaped = str(escape(text or ""))
    return Markup(_CONTROL_CHARS.sub(_picture, escaped))


def token_text(text: str) -> Markup:
    """A token for the token-by-token view: whitespace and control characters made visible."""
    if text == "":
        return Markup('<span class="cc">∅</span>')
    escaped = str(escape(text.replace("\n", "↵").replace("\t", "⇥")))
    spaced = escaped.replace(" ", '<span class="sp">·</span>')  # before any markup is added
    return Markup(_CONTROL_CHARS.sub(_picture, spaced))


# --- errors -------------------------------------------------------------------------------------


def _describe(exc: Exception) -> tuple[int, str, dict[str, Any]]:
    """Status code, message and extra JSON fields for any error the app turns into a response."""
    if isinstance(exc, StepNotFound):
        return 404, str(exc), {"run_id": exc.run_id, "nearest_step": exc.nearest}
    if isinstance(exc, NotFound):
        return 404, str(exc), {}
    if isinstance(exc, InvalidInput):
        return 400, str(exc), {}
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
        return JSONResponse({"detail": message} | extra, status_code=status)
    nearest = extra.get("nearest_step")
    context = {
        "status": status,
        "message": message,
        "run_id": extra.get("run_id"),
        "nearest": nearest,
    }
    return render(request, "error.html", context, status_code=status)
