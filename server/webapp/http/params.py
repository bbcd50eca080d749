"""Parsing of list-valued query parameters shared by pages and the API."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Literal

from fastapi import Path, Query
from rollout_lens.server.core.errors import InvalidInput
from rollout_lens.server.webapp.pages.cells import Shade
from rollout_lens.server.webapp.queries import MAX_RUNS_PER_PAGE

MAX_ID = 2**31 - 1  # the largest id or step the databases store (a 32-bit INTEGER)
MAX_RUN_IDS = 100  # run ids one request may name (runs=, ids=): each is read in full
MAX_SERIES_NAMES = 500  # series one request may name: each is a column of one statement

# Path and query integers are validated once, here: an out-of-range value is a 422 naming it,
# never a database error.
RunId = Annotated[int, Path(ge=1, le=MAX_ID, description="a run's id")]
StepNo = Annotated[int, Path(ge=0, le=MAX_ID, description="a recorded step")]
GroupNo = Annotated[int, Path(ge=0, le=MAX_ID, description="a group of the step (from 0)")]
OptionalGroup = Annotated[int | None, Query(ge=0, le=MAX_ID, description="a group of the step")]
Offset = Annotated[int, Query(ge=0, le=MAX_ID, description="how many rows to skip")]
# The groups overview's sort columns and filters (server.webapp.pages.overview.GROUP_SORTS and LOOKS: a test
# keeps these the same); anything else is a 422 naming the choices.
GroupSort = Annotated[
    Literal[
        "group",
        "label",
        "reward_mean",
        "reward_std",
        "accuracy",
        "agreement",
        "broken",
        "disagree",
        "max_abs_advantage",
    ],
    Query(description="the overview column to sort groups by"),
]
GroupOrder = Annotated[Literal["asc", "desc"], Query(description="sort order")]
Look = Annotated[
    Literal["disagree", "stuck", "broken", "solved"] | None,
    Query(
        description="only the groups that need a look: verifier ≠ truth in a rollout, no reward "
        "spread, a broken call, or every rollout correct"
    ),
]
TokenShade = Annotated[
    Shade,
    Query(
        description="what the step viewer shades tokens by: the sampled token's probability, or "
        "where the rollout has the generator's logprobs log r = trainer − generator logprob"
    ),
]
OptionalStep = Annotated[int | None, Query(ge=0, le=MAX_ID, description="a step")]
RangeFrom = Annotated[
    int | None,
    Query(alias="from", ge=0, le=MAX_ID, description="a range's first step (default: the run's)"),
]
RangeTo = Annotated[
    int | None, Query(ge=0, le=MAX_ID, description="a range's last step (default: the run's)")
]
OptionalRunId = Annotated[int | None, Query(ge=1, le=MAX_ID, description="a run's id")]
RunsPage = Annotated[int, Query(ge=1, le=MAX_ID, description="which page of runs (from 1)")]
RunsPerPage = Annotated[
    int, Query(ge=1, le=MAX_RUNS_PER_PAGE, description="runs per page (default 50)")
]


def _split_list(values: Iterable[str] | None) -> list[str]:
    """`a,b` and repeated parameters alike → [a, b] (blank items dropped)."""
    return [item.strip() for value in values or () for item in value.split(",") if item.strip()]


def run_ids(values: Iterable[str] | None) -> list[int]:
    """Run ids from `runs=1,2` or `runs=1&runs=2`."""
    items = _split_list(values)
    if len(items) > MAX_RUN_IDS:
        raise InvalidInput(f"at most {MAX_RUN_IDS} run ids at once, got {len(items)}")
    try:
        ids = [int(item) for item in items]
    except ValueError:
        raise InvalidInput(f"run ids must be whole numbers, got {', '.join(items)}") from None
    out_of_range = [str(i) for i in ids if not 1 <= i <= MAX_ID]
    if out_of_range:
        raise InvalidInput(f"run ids go from 1 to {MAX_ID}, got {', '.join(out_of_range)}")
    return ids


def series_names(values: Iterable[str] | None) -> list[str] | None:
    """Series names from `names=a,b` (repeats dropped, first order kept); None for all of them.
    More than MAX_SERIES_NAMES distinct names is an InvalidInput naming the limit."""
    if not values:
        return None
    names = list(dict.fromkeys(_split_list(values)))
    if len(names) > MAX_SERIES_NAMES:
        raise InvalidInput(f"at most {MAX_SERIES_NAMES} series names at once, got {len(names)}")
    return names
