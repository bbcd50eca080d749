"""Request dependencies: one database session per request, the settings, page rendering."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.responses import HTMLResponse
from sqlalchemy.orm import Session

from server.config import Settings
from server.routes.cache import ResponseCache


def get_session(request: Request) -> Iterator[Session]:
    """A session for this request, closed after the response (pages only read: nothing to commit)."""
    with request.app.state.session_factory() as session:
        yield session


def get_settings(request: Request) -> Settings:
    """The settings the app was created with."""
    settings: Settings = request.app.state.settings
    return settings


def get_cache(request: Request) -> ResponseCache:
    """The app's cache of encoded series responses."""
    cache: ResponseCache = request.app.state.response_cache
    return cache


SessionDep = Annotated[Session, Depends(get_session)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
CacheDep = Annotated[ResponseCache, Depends(get_cache)]


def render(
    request: Request, template: str, context: dict[str, Any], *, status_code: int = 200
) -> HTMLResponse:
    """A page from web/templates (autoescaped) with `context`."""
    response: HTMLResponse = request.app.state.templates.TemplateResponse(
        request, template, context, status_code=status_code
    )
    return response
