"""HTML pages of the prompt lens: a run's prompts with their heatmap, one prompt's history, and
the same prompts across runs (each has a JSON twin in server.webapp.routes.api)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from pydantic import ValidationError
from rollout_lens.server.core.errors import InvalidInput
from rollout_lens.server.webapp import queries
from rollout_lens.server.webapp.http.deps import SessionDep, render
from rollout_lens.server.webapp.http.params import RunId, run_ids
from rollout_lens.server.webapp.pages import prompt_pages

router = APIRouter(include_in_schema=False)
PromptId = Annotated[int, Path(ge=1, le=2**63 - 1, description="a prompt of the run")]
HISTORY_GROUPS = 200  # groups a history page shows (each with its rollouts' completions)


def _url(request: Request) -> prompt_pages.Url:
    def url(name: str, **params: Any) -> str:
        return str(request.app.url_path_for(name, **params))

    return url


@router.get("/runs/{run_id}/prompts", name="prompts_page", response_model=None)
def prompts_page(
    request: Request, session: SessionDep, run_id: RunId
) -> HTMLResponse | RedirectResponse:
    """A run's prompts, filtered, searched and sorted a page at a time, and the heatmap of the
    same rows over the run's steps. Empty form fields are dropped from the URL (one redirect);
    parameters that do not parse leave the form as typed with the reason."""
    given = request.query_params.multi_items()
    kept = [(name, value) for name, value in given if value.strip()]
    url = _url(request)
    if len(kept) < len(given):
        return RedirectResponse(
            prompt_pages.with_params(url("prompts_page", run_id=run_id), dict(kept)), 303
        )
    try:
        query = queries.PromptQuery.model_validate(dict(kept))
        data = queries.prompts_page(session, run_id=run_id, query=query)
        heat = queries.heatmap(session, run_id=run_id, query=query)  # its default width
    except (ValidationError, InvalidInput) as exc:
        run = queries.run_card(session, run_id=run_id)
        context = prompt_pages.prompts_invalid(run, dict(kept), exc, url)
        status = 422 if isinstance(exc, ValidationError) else 400
        return render(request, "prompts.html", context, status_code=status)
    return render(
        request, "prompts.html", prompt_pages.prompts_page(data, heat, url, run_id=run_id)
    )


@router.get("/runs/{run_id}/prompts/{prompt_id}", name="prompt_page")
def prompt_page(
    request: Request,
    session: SessionDep,
    run_id: RunId,
    prompt_id: PromptId,
    after: Annotated[str | None, Query(max_length=4096)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = HISTORY_GROUPS,
) -> HTMLResponse:
    """Every group of one prompt of the run in step order, with its rollouts and completions
    and a chart of its reward and true score; `after` pages on."""
    data = queries.prompt_history(
        session, run_id=run_id, prompt_id=prompt_id, after=after, limit=limit, completions=True
    )
    context = prompt_pages.prompt_page(data, _url(request), run_id=run_id, limit=limit)
    return render(request, "prompt.html", context)


@router.get("/compare/prompts", name="compare_prompts_page")
def compare_prompts_page(
    request: Request,
    session: SessionDep,
    runs: Annotated[list[str], Query(description="two or more run ids, comma-separated")],
    match: Literal["query", "user", "exact"] = "query",
    q: Annotated[str | None, Query(max_length=500)] = None,
    every: bool = True,
    show: Annotated[str | None, Query(max_length=200)] = None,
    after: Annotated[str | None, Query(max_length=4096)] = None,
) -> HTMLResponse:
    """The runs' prompts matched by `match`, each run's figures side by side; the match `show`
    (else the first) with each run's history side by side."""
    ids = run_ids(runs)
    data = queries.compare_prompts(
        session, run_ids=ids, match=match, q=q or None, every=every, after=after
    )
    chosen = next((m for m in data["prompts"] if m["key"] == show), None)
    if chosen is None and show is None and data["prompts"]:
        chosen = data["prompts"][0]
    histories: list[dict[str, Any] | None] = []
    for side in chosen["runs"] if chosen is not None else [{"prompts": []} for _ in ids]:
        first = side["prompts"][0] if side["prompts"] else None
        histories.append(
            None
            if first is None
            else queries.prompt_history(
                session, run_id=side["run_id"], prompt_id=first["prompt_id"], limit=HISTORY_GROUPS
            )
        )
    context = prompt_pages.compare_prompts_page(
        data,
        histories,
        _url(request),
        shown=chosen["key"] if chosen is not None else None,
        every=every,
        q=q,
    )
    return render(request, "compare_prompts.html", context)
