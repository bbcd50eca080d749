"""The explorer's parameters range-checked before they reach the database: huge steps, forged and
foreign cursors, text in a numeric sort's cursor and lone surrogates are a 4xx with a message on
the page and in the API, on both databases, never a 500 — and a hypothesis pass over all of it."""

from __future__ import annotations

import base64
import html
import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rollout_lens.server.store import search
from rollout_lens.server.webapp.queries.explorer import MAX_ID
from sqlalchemy.orm import Session, sessionmaker

from tests.factories import make_run
from tests.web_support import client_for


def _cursor(*fields: Any) -> str:
    raw = json.dumps(list(fields), allow_nan=True)
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def _decoded(cursor: str) -> list[Any]:
    raw = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    assert isinstance(raw, list)
    return raw


@pytest.fixture
def two_runs(session_factory: sessionmaker[Session]) -> tuple[TestClient, int, int]:
    """Two runs of 4 steps × 8 rollouts (32 rollouts a run), and a client on them."""
    first = make_run(session_factory, steps=4, seed=0)
    second = make_run(session_factory, steps=4, seed=1)
    return client_for(session_factory), first, second


def _text(response: Any) -> str:
    """The answer's text as a reader sees it (the page escapes quotes)."""
    return html.unescape(response.text)


def _both(client: TestClient, run_id: int, query: str) -> list[Any]:
    """The API's and the page's answers to one query."""
    return [
        client.get(f"/api/runs/{run_id}/rollouts?{query}"),
        client.get(f"/runs/{run_id}/rollouts?{query}"),
    ]


@pytest.mark.parametrize(
    ("query", "says"),
    [
        ("steps=99999999999999999999", "steps go from 0 to 2,147,483,647"),
        ("steps=1:99999999999999999999999", "steps go from 0 to 2,147,483,647"),
        (f"steps={MAX_ID + 1}:", "steps go from 0 to 2,147,483,647"),
        ("steps=" + "9" * 60, "steps"),
        ("vote=%ED%A0%80", ""),  # not UTF-8: the server reads U+FFFD, no error either way
    ],
)
def test_steps_out_of_range_are_a_422_naming_them(
    two_runs: tuple[TestClient, int, int], query: str, says: str
) -> None:
    client, run_id, _ = two_runs
    for response in _both(client, run_id, query):
        if query.startswith("vote"):
            assert response.status_code == 200
            continue
        assert response.status_code == 422, response.text[:300]
        assert says in _text(response)


def test_a_big_step_within_range_finds_nothing(two_runs: tuple[TestClient, int, int]) -> None:
    client, run_id, _ = two_runs
    page = client.get(f"/api/runs/{run_id}/rollouts?steps={MAX_ID}")
    assert page.status_code == 200 and page.json()["total"] == 0


def test_a_cursor_belongs_to_its_run_and_its_query(two_runs: tuple[TestClient, int, int]) -> None:
    """Run 2's `next` passed to run 1 skipped run 1's first rows while `total` said all of them;
    a search's cursor was taken without the search."""
    client, first, second = two_runs
    foreign = client.get(f"/api/runs/{second}/rollouts?limit=5").json()["next"]
    for response in _both(client, first, f"limit=5&after={foreign}"):
        assert response.status_code == 400
        assert f"the cursor is for run {second}'s rollouts, not run {first}'s" in _text(response)
    searched = client.get(f"/api/runs/{first}/rollouts?limit=2&q=tool*").json()
    assert searched["next"], searched["total"]
    for response in _both(client, first, f"limit=2&after={searched['next']}"):
        assert response.status_code == 400 and "other filters or another search" in _text(response)
    filtered = client.get(f"/api/runs/{first}/rollouts?limit=2&steps=2:3").json()["next"]
    moved = client.get(f"/api/runs/{first}/rollouts?limit=2&steps=1:3&after={filtered}")
    assert moved.status_code == 400
    # the same query (another page size) goes on from where it was
    page = client.get(f"/api/runs/{first}/rollouts?limit=5&steps=2:3&after={filtered}")
    assert page.status_code == 200 and page.json()["rollouts"]


def _forged(client: TestClient, run_id: int, sort: str, value: Any, **changes: Any) -> list[Any]:
    """A real cursor of `sort` with its value (or another field) replaced."""
    real = client.get(f"/api/runs/{run_id}/rollouts?limit=1&sort={sort}").json()["next"]
    fields = _decoded(real)
    fields[5] = value
    for index, replaced in changes.items():
        fields[int(index.removeprefix("at"))] = replaced
    return _both(client, run_id, f"limit=1&sort={sort}&after={_cursor(*fields)}")


@pytest.mark.parametrize(
    ("sort", "value", "changes", "says"),
    [
        ("step", 10**30, {}, "the cursor's step is not a whole number in range"),
        ("step", float("inf"), {}, "the cursor's step is not a whole number in range"),
        ("reward", float("inf"), {"at6": float("inf")}, "not a cursor this explorer gave out"),
        ("reward", 10**400, {}, "the cursor's reward is out of range"),
        ("reward", float("nan"), {}, "the cursor's reward is not a number"),
        ("advantage", "abc", {}, "the cursor's advantage is not a number"),
        ("sum_logprob", "\ud800", {}, "the cursor's sum_logprob is not a number"),
        ("vote", "\ud800", {}, "the cursor's vote is not a text this explorer sorts"),
        ("target", 5, {}, "the cursor's target is not a text this explorer sorts"),
        ("step", 1, {"at6": 10**30}, "not a cursor this explorer gave out"),
        ("step", 1, {"at0": 10**30}, "not a cursor this explorer gave out"),
        ("step", 1, {"at4": "yes"}, "not a cursor this explorer gave out"),
    ],
)
def test_a_forged_cursor_is_a_400_never_a_500(
    two_runs: tuple[TestClient, int, int],
    sort: str,
    value: Any,
    changes: dict[str, Any],
    says: str,
) -> None:
    client, run_id, _ = two_runs
    for response in _forged(client, run_id, sort, value, **changes):
        assert response.status_code == 400, response.text[:300]
        assert says in _text(response)


def test_infinite_values_stored_page_through(two_runs: tuple[TestClient, int, int]) -> None:
    """-inf is a value the database holds (Σ logprob keeps it): a cursor at -inf still works."""
    client, run_id, _ = two_runs
    cursor = _decoded(client.get(f"/api/runs/{run_id}/rollouts?limit=1&sort=reward").json()["next"])
    cursor[5] = float("-inf")
    page = client.get(f"/api/runs/{run_id}/rollouts?limit=50&sort=reward&after={_cursor(*cursor)}")
    assert page.status_code == 200 and len(page.json()["rollouts"]) == 32


def test_search_words_are_20_of_200_characters(two_runs: tuple[TestClient, int, int]) -> None:
    client, run_id, _ = two_runs
    twenty = "+".join(f"w{i:03d}" + "x" * 196 for i in range(search.MAX_WORDS))
    for response in _both(client, run_id, f"q={twenty}"):
        assert response.status_code == 200, response.text[:300]
    for response in _both(client, run_id, "q=" + "+".join(f"w{i}" for i in range(21))):
        assert response.status_code == 400 and "at most 20 words, got 21" in _text(response)
    for response in _both(client, run_id, "q=" + "y" * 201):
        assert response.status_code == 400
        assert "a word has at most 200 characters, got one of 201" in _text(response)


# --- a hypothesis pass: whatever the parameters, a 2xx or a 4xx with a message ---------------------

_EDGES = [0, 1, MAX_ID, MAX_ID + 1, 2**63 - 1, 2**63, 2**64, 10**20, 10**30, -1, -(2**63) - 1]
_INTS = st.one_of(st.integers(min_value=-3, max_value=40), st.sampled_from(_EDGES))
_NUMBERS = st.one_of(
    _INTS,
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["1e309", "-0", "0x10", "١٢", " 7 ", "NaN", "Infinity", "9" * 30]),
)
_TEXT = st.text(max_size=30)
_SORTS = ["step", "group", "index", "reward", "advantage", "sum_logprob", "vote", "length"]
_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    _INTS,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from(["\ud800", "abc", "", "1"]),
    st.lists(st.integers(), max_size=2),
)


@st.composite
def _params(draw: st.DrawFn) -> dict[str, Any]:
    params: dict[str, Any] = {}
    if draw(st.booleans()):
        lo, hi = draw(_NUMBERS), draw(_NUMBERS)
        params["steps"] = draw(st.sampled_from([f"{lo}", f"{lo}:{hi}", f":{hi}", f"{lo}:"]))
    for name in ("reward_min", "adv_max", "len_min", "group"):
        if draw(st.booleans()):
            params[name] = str(draw(_NUMBERS))
    for name in ("vote", "q", "state"):
        if draw(st.booleans()):
            params[name] = draw(_TEXT)
    params["sort"] = draw(st.sampled_from(_SORTS))
    return params


@st.composite
def _cursor_changes(draw: st.DrawFn) -> dict[int, Any]:
    """Fields of a real cursor to replace (by position), each with a drawn value."""
    return draw(st.dictionaries(st.integers(min_value=0, max_value=7), _VALUES, max_size=3))


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(params=_params(), changes=st.one_of(st.none(), _cursor_changes()))
def test_fuzzed_explorer_parameters_never_answer_5xx(
    two_runs: tuple[TestClient, int, int], params: dict[str, Any], changes: dict[int, Any] | None
) -> None:
    """Filters, sorts and cursors (a real one with fields replaced) drawn by hypothesis: every
    answer is a page or a 400/422 with a message."""
    client, run_id, _ = two_runs
    if changes is not None:
        real = client.get(f"/api/runs/{run_id}/rollouts?limit=1&sort={params['sort']}").json()
        fields = _decoded(real["next"])
        for at, value in changes.items():
            fields[at % len(fields)] = value
        params["after"] = _cursor(*fields)
    for path in (f"/api/runs/{run_id}/rollouts", f"/runs/{run_id}/rollouts"):
        # a text httpx cannot send (a lone surrogate) is the client's refusal, not the server's
        try:
            response = client.get(path, params=params)
        except UnicodeEncodeError:
            continue
        assert response.status_code < 500, (params, response.text[:300])
        if response.status_code >= 400:
            assert response.status_code in (400, 422), (params, response.status_code)
            body = response.json()["detail"] if path.startswith("/api") else response.text
            assert body
