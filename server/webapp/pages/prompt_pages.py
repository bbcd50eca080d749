"""What the prompt lens's pages show, from what queries.prompts reads (pure: data and a
`url(name, **params)` in, template context out): a run's prompts with their heatmap, one
prompt's history, and the same prompts across runs.

Prompt and completion texts stay plain strings here: templates escape them (autoescape) and
the figures pass them through plotly_text.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import urlencode

from pydantic import ValidationError
from rollout_lens.server.webapp.pages import prompt_figures
from rollout_lens.server.webapp.queries.prompts import LOOKS

Url = Callable[..., str]  # route name and path params → path

PROMPT_COLUMNS = (  # (sort key, header, numeric, what it means)
    ("label", "Prompt", False, "what tells it apart from the run's other prompts"),
    ("groups", "Groups", True, "groups of it the run drew"),
    ("first_step", "First", True, "first step it was seen"),
    ("last_step", "Last", True, "last step it was seen"),
    ("reward_mean", "Reward", True, "mean verifier reward of its rollouts"),
    ("true_mean", "True", True, "mean true score of its rollouts"),
    ("solved_at", "Solved at", True, "first step a group of it was solved by majority"),
    ("last_failed", "Last failed", True, "last step a group of it failed"),
    ("flips", "Flips", True, "times it turned from solved to failed or back"),
    ("zero_spread_share", "Zero spread", True, "share of its groups with no reward spread"),
)
# the filter's choices in the words queries.prompts.LOOKS gives them (with their thresholds)
LOOK_LABELS = {key: words for key, (words, _) in LOOKS.items()}
FACT_VOTES = 10  # votes a prompt's history lists over the run (the rest counted)
MATCH_LABELS = {
    "query": "its query (the env's, else the last user turn)",
    "user": "the last user turn",
    "exact": "the exact text",
}


def with_params(path: str, params: Mapping[str, Any]) -> str:
    kept = {k: v for k, v in params.items() if v is not None and v != ""}
    kept = {k: (str(v).lower() if isinstance(v, bool) else v) for k, v in kept.items()}
    return f"{path}?{urlencode(kept)}" if kept else path


def _errors_of(error: Exception) -> str:
    """What is wrong with a page's parameters, in one line."""
    if isinstance(error, ValidationError):
        return "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'input'}: "
            f"{str(e['msg']).removeprefix('Value error, ')}"
            for e in error.errors()
        )
    return str(error)


# --- a run's prompts and the heatmap -----------------------------------------------------------


def buckets(heat: Mapping[str, Any]) -> list[tuple[int, int]]:
    """The heatmap's columns as (first, last) step."""
    first, last, width = heat["first_step"], heat["last_step"], heat["bucket"]
    if first is None:
        return []
    return [
        (first + c * width, min(last, first + (c + 1) * width - 1)) for c in range(heat["columns"])
    ]


def _heatmap_figure(heat: Mapping[str, Any], labels: Mapping[int, str]) -> dict[str, Any]:
    """queries.heatmap's rows (sparse cells by column) as the heatmap figure, each row labelled
    by its prompt's distinguishing text (`labels`, else the heatmap's own)."""
    columns = buckets(heat)
    rows = []
    for r in heat["rows"]:
        cells: list[dict[str, Any] | None] = [None] * len(columns)
        for cell in r["cells"]:
            cells[cell["col"]] = cell
        rows.append(
            {
                "prompt_id": r["prompt_id"],
                "label": labels.get(r["prompt_id"], r["label"]),
                "cells": cells,
            }
        )
    return prompt_figures.heatmap(rows, columns)


def prompts_page(
    data: dict[str, Any], heat: dict[str, Any], url: Url, *, run_id: int
) -> dict[str, Any]:
    """A run's prompts: the table (sortable headers that keep the filters, the look filter, the
    next page), the heatmap of the same rows, and the JSON twins' links."""
    path = url("prompts_page", run_id=run_id)
    filters = data["filters"]
    sort, order = filters.get("sort", "first_step"), filters.get("order", "asc")
    limit = filters.get("limit")
    keep = filters | ({"limit": limit} if limit else {})
    for p in data["prompts"]:
        p["history_url"] = url("prompt_page", run_id=run_id, prompt_id=p["prompt_id"])
    headers = [
        {
            "key": key,
            "label": label,
            "numeric": numeric,
            "title": title,
            "active": key == sort,
            "order": order if key == sort else None,
            "url": with_params(
                path,
                keep | {"sort": key, "order": "desc" if key == sort and order == "asc" else "asc"},
            ),
        }
        for key, label, numeric, title in PROMPT_COLUMNS
    ]
    looks = [
        {"key": key, "label": label, "active": filters.get("look") == key}
        for key, label in LOOK_LABELS.items()
    ]
    figure = _heatmap_figure(heat, {p["prompt_id"]: p["label"] for p in data["prompts"]})
    return {
        "run": data["run"],
        "rows": data["prompts"],
        "total": data["total"],
        "f": {"q": None, "look": None, "sort": sort, "order": order} | filters,
        "limit": limit,
        "error": "",
        "looks": looks,
        "headers": headers,
        "first_url": with_params(path, keep),
        "next_page_url": None
        if data["next"] is None
        else with_params(path, keep | {"after": data["next"]}),
        "json_url": with_params(
            url("api_run_prompts", run_id=run_id), keep | {"after": filters.get("after")}
        ),
        "heatmap_url": with_params(url("api_prompts_heatmap", run_id=run_id), keep),
        "export_url": with_params(url("export_prompts", run_id=run_id), filters),
        "run_url": url("run_page", run_id=run_id),
        "path": path,
        "heat": {k: heat[k] for k in ("first_step", "last_step", "bucket", "columns")},
        "figure": figure,
        "page": {
            "figures": [figure] if data["prompts"] else [],
            "steps": url("step_jump", run_id=run_id),
        },
    }


def prompts_invalid(
    run: Mapping[str, Any], given: Mapping[str, str], error: Exception, url: Url
) -> dict[str, Any]:
    """The prompts page when its parameters do not parse: the form as typed, the reason, no
    rows."""
    path = url("prompts_page", run_id=run["id"])
    return {
        "run": run,
        "rows": [],
        "total": 0,
        "f": {"q": None, "look": None, "sort": "first_step", "order": "asc"} | dict(given),
        "limit": None,
        "error": _errors_of(error),
        "looks": [
            {"key": k, "label": v, "active": given.get("look") == k} for k, v in LOOK_LABELS.items()
        ],
        "headers": [],
        "first_url": path,
        "next_page_url": None,
        "json_url": with_params(url("api_run_prompts", run_id=run["id"]), given),
        "heatmap_url": None,
        "export_url": None,
        "run_url": url("run_page", run_id=run["id"]),
        "path": path,
        "heat": None,
        "figure": None,
        "page": {"figures": [], "steps": url("step_jump", run_id=run["id"])},
    }


# --- one prompt's history ----------------------------------------------------------------------


def top_votes(votes: Mapping[str, int], top: int = FACT_VOTES) -> dict[str, Any]:
    """A {vote: count} object (most first) as the `top` votes a page lists and what is left:
    how many other votes, and how many rollouts cast them."""
    items = list(votes.items())
    rest = items[top:]
    return {"top": dict(items[:top]), "others": len(rest), "others_count": sum(c for _, c in rest)}


def _vote_split(votes: Mapping[str, int]) -> list[dict[str, Any]]:
    """A group's {vote: count} as the bar the page draws: each vote's count and share."""
    total = sum(votes.values()) or 1
    return [{"vote": v, "count": c, "share": c / total} for v, c in votes.items()]


def _history_steps(
    steps: Sequence[dict[str, Any]], url: Url, *, run_id: int
) -> list[dict[str, Any]]:
    """queries.prompt_history's groups (read with their completions) with their rollouts as rows
    (index, reward, true score, advantage, vote, state, completion) and links to the step
    viewer."""
    out = []
    for s in steps:
        group_url = url("group_page", run_id=run_id, step=s["step"], group=s["group"])
        rollouts = [
            {
                "id": rid,
                "index": idx,
                "reward": reward,
                "true_score": true,
                "advantage": adv,
                "vote": vote,
                "state": state,
                "completion": completion,
                "url": f"{group_url}#r{idx}",
            }
            for rid, idx, reward, true, adv, vote, state, completion in zip(
                s["rollout_ids"],
                s["indexes"],
                s["rewards"],
                s["true_scores"],
                s["advantages"],
                s["rollout_votes"],
                s["states"],
                s.get("completions") or [""] * len(s["rollout_ids"]),
                strict=True,
            )
        ]
        out.append(
            s
            | {
                "group_url": group_url,
                "split": _vote_split(s["votes"]),
                "rollouts": rollouts,
                "state_counts": _counts([r["state"] for r in rollouts]),
            }
        )
    return out


def _counts(values: Sequence[str | None]) -> list[tuple[str, int]]:
    counts: dict[str, int] = {}
    for v in values:
        key = v if v is not None else "—"
        counts[key] = counts.get(key, 0) + 1
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))


def prompt_page(data: dict[str, Any], url: Url, *, run_id: int, limit: int) -> dict[str, Any]:
    """One prompt's groups in order (figures, vote split, rollouts and their completions), its
    reward and true score over steps, and links to its JSON and the next page of groups."""
    prompt_id = data["prompt"]["prompt_id"]
    path = url("prompt_page", run_id=run_id, prompt_id=prompt_id)
    steps = _history_steps(data["steps"], url, run_id=run_id)
    figure = prompt_figures.history(steps)
    return {
        "run": data["run"],
        "prompt": data["prompt"],
        "votes": top_votes(data["prompt"]["votes"]),
        "steps": steps,
        "figure": figure,
        "next_page_url": None
        if data["next"] is None
        else with_params(path, {"after": data["next"], "limit": limit}),
        "json_url": with_params(
            url("api_prompt_history", run_id=run_id, prompt_id=prompt_id), {"completions": True}
        ),
        "prompts_url": url("prompts_page", run_id=run_id),
        "run_url": url("run_page", run_id=run_id),
        "page": {"figures": [figure], "steps": url("step_jump", run_id=run_id)},
    }


# --- across runs ---------------------------------------------------------------------------------


def compare_prompts_page(
    data: dict[str, Any],
    histories: Sequence[dict[str, Any] | None],
    url: Url,
    *,
    shown: str | None,
    every: bool,
    q: str | None,
) -> dict[str, Any]:
    """Prompts matched across runs (a row a match, each run's figures side by side) and, for the
    match shown, each run's history side by side with its chart."""
    run_ids = [r["id"] for r in data["runs"]]
    path = url("compare_prompts_page")
    base = {"runs": ",".join(map(str, run_ids)), "match": data["match"], "q": q}
    base |= {"every": "false"} if not every else {}
    _link_matches(data["prompts"], url, page=path, query=base, shown=shown)
    sides = [_history_side(run, h, url) for run, h in zip(data["runs"], histories, strict=True)]
    return {
        "compare": data,
        "runs": data["runs"],
        "matches": data["prompts"],
        "match": data["match"],
        "match_labels": MATCH_LABELS,
        "every": every,
        "q": q or "",
        "shown": shown,
        "shown_label": next((m["label"] for m in data["prompts"] if m["key"] == shown), ""),
        "sides": sides,
        "next_page_url": None
        if data["next"] is None
        else with_params(path, base | {"after": data["next"]}),
        "json_url": with_params(url("api_compare_prompts"), base),
        "compare_url": with_params(url("compare_page"), {"runs": base["runs"]}),
        "page": {
            "figures": [s["figure"] for s in sides if s["figure"] is not None],
            "steps_of": {
                str(s["run"]["id"]): url("step_jump", run_id=s["run"]["id"]) for s in sides
            },
        },
    }


def _link_matches(
    matches: list[dict[str, Any]],
    url: Url,
    *,
    page: str,
    query: dict[str, Any],
    shown: str | None,
) -> None:
    """Each match's link to this page (`page` with `query`) showing its histories, whether it is
    the one shown, and each of its prompts' own page."""
    for m in matches:
        m["show_url"] = with_params(page, query | {"show": m["key"]}) + "#histories"
        m["shown"] = m["key"] == shown
        for side in m["runs"]:
            for p in side["prompts"]:
                p["history_url"] = url(
                    "prompt_page", run_id=side["run_id"], prompt_id=p["prompt_id"]
                )


def _history_side(run: dict[str, Any], h: dict[str, Any] | None, url: Url) -> dict[str, Any]:
    """One run's side of the match shown: its history (each step's vote split) and its chart;
    None where the run has no prompt of the match."""
    if h is None:
        return {"run": run, "history": None, "figure": None}
    figure = prompt_figures.history(h["steps"]) | {"id": f"history-{run['id']}"}
    steps = [s | {"split": _vote_split(s["votes"])} for s in h["steps"]]
    return {
        "run": run,
        "history": h | {"steps": steps},
        "figure": figure,
        "steps_url": url("step_jump", run_id=run["id"]),
        "history_url": url("prompt_page", run_id=run["id"], prompt_id=h["prompt"]["prompt_id"]),
    }
