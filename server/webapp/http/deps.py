"""Request dependencies: one database session per request, the settings, the task queue, rendering."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from typing import Annotated, Any

from celery import Celery
from fastapi import Depends, Request
from fastapi.responses import HTMLResponse
from rollout_lens.server.core import textsafe
from rollout_lens.server.core.config import Settings
from rollout_lens.server.core.queue import make_celery
from rollout_lens.server.store import TokenTextCache
from rollout_lens.server.webapp.http.cache import ResponseCache
from sqlalchemy.orm import Session

_celery_lock = threading.Lock()


def _get_session(request: Request) -> Iterator[Session]:
    """A session for this request, closed after the response (pages only read: nothing to commit)."""
    with request.app.state.session_factory() as session:
        yield session


def get_settings(request: Request) -> Settings:
    """The settings the app was created with."""
    settings: Settings = request.app.state.settings
    return settings


def model_builds(request: Request) -> dict[str, str]:
    """Which tiny models a launch would first have to build on this machine (turns → warning),
    as create_app was told (none unless `serve` said)."""
    return dict(request.app.state.model_builds())


def _get_cache(request: Request) -> ResponseCache:
    """The app's cache of encoded series responses."""
    cache: ResponseCache = request.app.state.response_cache
    return cache


def _get_alert_cache(request: Request) -> ResponseCache:
    """The app's cache of each run's alerts, keyed by run version."""
    cache: ResponseCache = request.app.state.alert_cache
    return cache


def _get_compare_cache(request: Request) -> ResponseCache:
    """The app's cache of each run's part of compare, keyed by run version."""
    cache: ResponseCache = request.app.state.compare_cache
    return cache


def _get_token_texts(request: Request) -> TokenTextCache:
    """The app's cache of runs' token texts (store.TokenTextCache)."""
    texts: TokenTextCache = request.app.state.token_texts
    return texts


def _get_celery(request: Request) -> Celery:
    """The app's Celery client, made on first use (the embedded broker creates its folders)."""
    state = request.app.state
    with _celery_lock:
        if getattr(state, "celery", None) is None:
            state.celery = make_celery(state.settings)
    celery: Celery = state.celery
    return celery


SessionDep = Annotated[Session, Depends(_get_session)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
CacheDep = Annotated[ResponseCache, Depends(_get_cache)]
CeleryDep = Annotated[Celery, Depends(_get_celery)]
AlertCacheDep = Annotated[ResponseCache, Depends(_get_alert_cache)]
CompareCacheDep = Annotated[ResponseCache, Depends(_get_compare_cache)]
TokenTextsDep = Annotated[TokenTextCache, Depends(_get_token_texts)]


def render(
    request: Request, template: str, context: Mapping[str, Any], *, status_code: int = 200
) -> HTMLResponse:
    """A page from web/templates (autoescaped) with `context` (a view's named context)."""
    templates = request.app.state.templates
    try:
        response: HTMLResponse = templates.TemplateResponse(
            request, template, dict(context), status_code=status_code
        )
    except UnicodeEncodeError:
        # A lone surrogate stored before server.core.textsafe cleaned writes: show U+FFFD, not a 500.
        html = templates.get_template(template).render({"request": request, **context})
        return HTMLResponse(textsafe.storable(html), status_code=status_code)
    return response
