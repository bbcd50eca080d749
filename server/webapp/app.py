"""The dashboard's FastAPI app: create_app(settings) wires database, templates, routes and errors."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from rollout_lens.server import store
from rollout_lens.server.core.config import Settings
from rollout_lens.server.store.db import WEB_POOL, make_engine, make_session_factory
from rollout_lens.server.webapp.alert_hooks import POLL_SECONDS as ALERT_POLL_SECONDS
from rollout_lens.server.webapp.alert_hooks import deliver_alerts
from rollout_lens.server.webapp.http.cache import ResponseCache
from rollout_lens.server.webapp.http.deps import render
from rollout_lens.server.webapp.http.error_pages import HANDLED, handle_error, publish_error_shapes
from rollout_lens.server.webapp.http.flash import make_signer
from rollout_lens.server.webapp.http.ratelimit import FailureLimiter
from rollout_lens.server.webapp.http.security import Guard
from rollout_lens.server.webapp.http.templating import STATIC_DIR, make_templates
from rollout_lens.server.webapp.http.timing import ServerTiming
from rollout_lens.server.webapp.ingest import Ingest
from rollout_lens.server.webapp.routes import (
    actions,
    api,
    downloads,
    html,
    prompt_pages,
    prompts,
    record,
    signin,
)
from rollout_lens.server.webapp.sweeper import SWEEP_SECONDS, sweep_lost_runs
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

SWAGGER_JS = "vendor/swagger-ui-bundle-5.35.0.js"
SWAGGER_CSS = "vendor/swagger-ui-5.35.0.css"
ALERT_CACHE_SIZE = 4096
COMPARE_CACHE_SIZE = 256
TOKEN_TEXTS_KEPT = 500_000  # runs' token texts kept (about 120 bytes each: 60 MB)


def prepare_database(settings: Settings) -> None:
    """Before serving: migrate an SQLite database (the embedded default), else refuse one behind."""
    from rollout_lens.server.store.migrate import ensure_current, upgrade
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
    alert_poll_seconds: float = ALERT_POLL_SECONDS,
    model_builds: Callable[[], Mapping[str, str]] | None = None,
) -> FastAPI:
    """The dashboard on the settings' database (or on `session_factory`, which tests pass).

    `cache_size` bounds the series responses kept in memory (0: none, alerts included); every
    `sweep_seconds` the app marks runs whose worker stopped sending heartbeats `lost`.
    `model_builds` says which tiny models a launch would first have to build (turns → warning
    for the launch form; `serve` passes trainer.builders.prebuilt's, the web app imports no trainer).
    """
    engine = None
    if session_factory is None:
        engine = make_engine(
            settings.database_url, busy_timeout_ms=settings.sqlite_busy_timeout_ms, **WEB_POOL
        )
        session_factory = make_session_factory(engine)
    app = FastAPI(
        title="Rollout Lens",
        summary="Experiment tracking for GRPO runs: every page's data as JSON.",
        version="0.1.0",
        lifespan=_lifespan(
            session_factory,
            settings,
            engine,
            sweep_seconds=sweep_seconds,
            alert_poll_seconds=alert_poll_seconds,
        ),
        docs_url=None,  # served below from vendored assets: the dashboard works offline
        redoc_url=None,
    )
    if settings.server_timing:  # off by default: it tells anyone how long each answer took
        app.add_middleware(ServerTiming)
    # Wrong tokens per client address, shared by the Guard (Bearer) and the sign-in form.
    app.state.token_limiter = limiter = FailureLimiter()
    # outermost: host, origin, token, body size, CSRF, headers
    app.add_middleware(Guard, settings=settings, session_factory=session_factory, limiter=limiter)
    _keep_state(app, settings, session_factory, cache_size=cache_size, model_builds=model_builds)
    _add_routes(app)
    return app


def _lifespan(
    factory: sessionmaker[Session],
    settings: Settings,
    engine: Engine | None,
    *,
    sweep_seconds: float,
    alert_poll_seconds: float,
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """While the app serves: the lost-runs sweep and, where webhooks are set, the alerts'
    delivery; at shutdown both are cancelled and the app's own engine disposed."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(sweep_lost_runs(factory, settings, every=sweep_seconds))]
        if settings.alert_webhook_list:
            deliveries = deliver_alerts(
                factory,
                settings.alert_webhook_list,
                settings.public_url or "http://127.0.0.1:8000",
                every=alert_poll_seconds,
            )
            tasks.append(asyncio.create_task(deliveries))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if engine is not None:
                engine.dispose()

    return lifespan


def _keep_state(
    app: FastAPI,
    settings: Settings,
    session_factory: sessionmaker[Session],
    *,
    cache_size: int,
    model_builds: Callable[[], Mapping[str, str]] | None,
) -> None:
    """What the handlers find on app.state: settings, sessions, caches, ingest, templates."""
    app.state.settings = settings
    app.state.session_factory = session_factory
    app.state.model_builds = model_builds or dict
    app.state.response_cache = ResponseCache(cache_size)
    # Alerts per run version: a few hundred bytes each, asked for by every runs page for every
    # run it lists, so many more are kept than whole series responses.
    app.state.alert_cache = ResponseCache(ALERT_CACHE_SIZE if cache_size else 0)
    # Each run's part of a compare page (its rounded charts and summary, ~15 KB), per version.
    app.state.compare_cache = ResponseCache(COMPARE_CACHE_SIZE if cache_size else 0)
    # Runs' token texts, which never change (the group page's and the step viewer's ~3,000 a page)
    app.state.token_texts = store.TokenTextCache(TOKEN_TEXTS_KEPT if cache_size else 0)
    app.state.ingest = Ingest(
        session_factory,
        price_per_hour=settings.price_per_device_hour,
        max_bytes=settings.record_max_bytes,
    )
    app.state.templates = make_templates()
    app.state.flash_signer = make_signer()


def _add_routes(app: FastAPI) -> None:
    """Static files, the routers, the error handlers and the vendored API docs page."""
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    app.include_router(html.router)
    app.include_router(prompt_pages.router)
    app.include_router(api.router)
    app.include_router(prompts.router)
    app.include_router(actions.router)
    app.include_router(downloads.router)
    app.include_router(signin.router)
    app.include_router(record.router)
    for exc_type in HANDLED:
        app.add_exception_handler(exc_type, handle_error)
    publish_error_shapes(app)

    @app.get("/docs", include_in_schema=False)
    def docs(request: Request) -> HTMLResponse:
        """Swagger UI from vendored files, started by static/docs.js (no inline script: CSP)."""
        context = {"openapi_url": app.openapi_url or "/openapi.json"}
        return render(request, "docs.html", context | {"js": SWAGGER_JS, "css": SWAGGER_CSS})
