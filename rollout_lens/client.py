"""Read a Rollout Lens dashboard from Python (a notebook, a script) over its JSON API.

    from rollout_lens import Client
    lens = Client("http://127.0.0.1:8000")
    df = lens.series(lens.runs()[0]["id"], names=["reward_mean", "loss"])   # pandas, by step

Series come back as a pandas DataFrame indexed by step when pandas is installed, else as a list
of dicts. Errors are ClientError: the server's message for a 4xx/5xx answer, or the address that
could not be reached.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from http.cookiejar import CookieJar, DefaultCookiePolicy
from pathlib import Path
from typing import Any

import httpx

from rollout_lens.server.core import step_views

# The keys of a rollout (derived from the read view, server.core.step_views.RolloutView: what
# its data() sends); the step viewer's API adds view fields, which step_rollouts leaves out.
ROLLOUT_KEYS = step_views.ROLLOUT_KEYS

BUSY_WAIT_SECONDS = 120  # an import answered 503 (the dashboard writing others) is sent again
UNKNOWN_NAME = 422  # what GET /api/runs/{id}/series answers a name it does not know
PROMPTS_PER_REQUEST = 500  # the prompts list's largest page
HISTORY_PER_REQUEST = 5_000  # a prompt history's largest page


def no_cookies() -> CookieJar:
    """A cookie jar that keeps none."""
    return CookieJar(policy=DefaultCookiePolicy(allowed_domains=[]))


class ClientError(Exception):
    """The server answered with an error (`status`), or could not be reached (`status` None)."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class Client:
    """A dashboard at `base_url`; `token` (one of its ROLLOUT_LENS_AUTH_TOKEN) is sent as
    `Authorization: Bearer`: reading needs it where the dashboard sets ROLLOUT_LENS_AUTH_READ."""

    def __init__(self, base_url: str, token: str | None = None, *, timeout: float = 60.0) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        # No cookies kept: a script is no browser (the dashboard's CSRF cookie, sent back, would
        # make its POSTs look like a browser's, which need the form's CSRF token).
        self._http = httpx.Client(
            base_url=self.base_url, headers=headers, timeout=timeout, cookies=no_cookies()
        )

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # --- reading ---------------------------------------------------------------------------

    def runs(self) -> list[dict[str, Any]]:
        """Every run, newest first (the runs page's data, read a page at a time).

        Pages are read oldest first, so a run created meanwhile lands on a later page instead
        of pushing one already read onto the next."""
        runs: dict[int, dict[str, Any]] = {}
        path: str | None = "/api/runs?sort=created&order=asc&per_page=200"
        while path is not None:
            page = self._get(path)
            runs.update((run["id"], run) for run in page["runs"])
            path = page["links"]["next"]
        return sorted(runs.values(), key=lambda run: -run["id"])

    def run(self, run_id: int) -> dict[str, Any]:
        """One run's columns, plus its first_step, last_step, series_names, live state, alerts."""
        overview = self._get(f"/api/runs/{int(run_id)}")
        return dict(overview["run"]) | {k: v for k, v in overview.items() if k != "run"}

    def series(self, run_id: int, names: Sequence[str] | None = None) -> Any:
        """Every step's series (none downsampled): a DataFrame indexed by step with a column per
        series when pandas is importable, else a list of dicts (one per step, with `step`)."""
        wanted = list(names) if names is not None else None
        rows = []
        with self._stream(
            f"/api/runs/{int(run_id)}/export", params={"format": "jsonl", "what": "steps"}
        ) as response:
            for line in response.iter_lines():
                if line.strip():
                    rows.append(json.loads(line))
        if wanted is not None:
            present = set().union(*rows) if rows else set()
            unknown = [n for n in wanted if n not in present]
            if unknown and rows:
                raise ClientError(
                    f"run {run_id} has no series {', '.join(unknown)}", status=UNKNOWN_NAME
                )
            rows = [{"step": r["step"]} | {n: r.get(n) for n in wanted} for r in rows]
        try:
            import pandas as pd
        except ImportError:
            return rows
        frame = pd.DataFrame.from_records(
            rows, columns=["step", *(wanted or [])] if wanted else None
        )
        if "recorded_at" in frame:
            frame["recorded_at"] = pd.to_datetime(frame["recorded_at"], utc=True)
        return frame.set_index("step") if "step" in frame else frame

    def step_rollouts(self, run_id: int, step: int) -> list[dict[str, Any]]:
        """The rollouts the update at `step` trained on, in group order, each whole: every token
        position and the whole text (as the export has them). One request, streamed: a line a
        rollout (`/api/runs/{id}/steps/{step}/rollouts.jsonl`)."""
        path = f"/api/runs/{int(run_id)}/steps/{int(step)}/rollouts.jsonl"
        with self._stream(path, {}) as response:
            return [
                {key: rollout.get(key) for key in ROLLOUT_KEYS}
                for rollout in map(json.loads, filter(None, response.iter_lines()))
            ]

    def rollouts(self, run_id: int, *, max_rows: int | None = 10_000, **filters: Any) -> Any:
        """Rollouts across steps, as the explorer finds them (`/runs/{id}/rollouts`): filters
        by keyword — steps="100:200" (or a (first, last) pair), group, state, format_valid, vote,
        target, reward_min/max, true_min/max, adv_min/max, len_min/max, diff_min/max (largest
        |Δlogp|), ratio_min/max (sequence ratio), disagree=True, alert=True, q="words" — and
        sort/order (abs_diff_max and seq_ratio among the sorts). A DataFrame (one row a rollout, with its links)
        when pandas is importable, else a list of dicts; at most `max_rows` (None: all)."""
        params = {key: _param(value) for key, value in filters.items() if value is not None}
        params["limit"] = 200
        rows: list[dict[str, Any]] = []
        page = self._get(f"/api/runs/{int(run_id)}/rollouts", params)
        while True:
            rows += page["rollouts"]
            if page["next"] is None or (max_rows is not None and len(rows) >= max_rows):
                break
            page = self._get(f"/api/runs/{int(run_id)}/rollouts", params | {"after": page["next"]})
        return _frame(rows[:max_rows] if max_rows is not None else rows)

    def rollouts_page(self, run_id: int, *, after: str | None = None, **filters: Any) -> Any:
        """One keyset page of the explorer's JSON (`rollouts`, `total`, `total_capped`, `next`:
        pass it as `after` for the next page)."""
        params = {key: _param(value) for key, value in filters.items() if value is not None}
        if after is not None:
            params["after"] = after
        return self._get(f"/api/runs/{int(run_id)}/rollouts", params)

    def prompts(self, run_id: int, *, max_rows: int | None = None, **filters: Any) -> Any:
        """A run's distinct prompts with what happened to each (`/runs/{id}/prompts`): groups,
        first and last step, mean reward and true score, solved_at, last_failed, flips,
        zero_spread_share, top votes and the whole text. Filters by keyword — look="never_solved"
        (or solved, flipping, stuck, forgotten), q="words" — and sort/order. A DataFrame (a row
        a prompt) when pandas is importable, else a list of dicts; at most `max_rows` (None:
        all)."""
        params = {key: _param(value) for key, value in filters.items() if value is not None}
        params["limit"] = PROMPTS_PER_REQUEST
        path = f"/api/runs/{int(run_id)}/prompts"
        rows: list[dict[str, Any]] = []
        page = self._get(path, params)
        while True:
            rows += page["prompts"]
            if page["next"] is None or (max_rows is not None and len(rows) >= max_rows):
                break
            page = self._get(path, params | {"after": page["next"]})
        return _frame(rows[:max_rows] if max_rows is not None else rows)

    def prompts_page(self, run_id: int, *, after: str | None = None, **filters: Any) -> Any:
        """One keyset page of the prompts list's JSON (`prompts`, `total`, `next`: pass it as
        `after` for the next page)."""
        params = {key: _param(value) for key, value in filters.items() if value is not None}
        if after is not None:
            params["after"] = after
        return self._get(f"/api/runs/{int(run_id)}/prompts", params)

    def prompts_export_chunks(self, run_id: int, **filters: Any) -> Iterator[bytes]:
        """The prompts the filters select (look=, q=, sort=, order=) as JSON Lines in the chat
        format a TRL script reads, chunk by chunk as it streams."""
        params = {key: _param(value) for key, value in filters.items() if value is not None}
        with self._stream(f"/api/runs/{int(run_id)}/prompts/export.jsonl", params) as response:
            yield from response.iter_bytes()

    def prompt_history(self, run_id: int, prompt_id: int) -> Any:
        """Every group of one prompt of the run in (step, group) order
        (`/runs/{id}/prompts/{prompt_id}`): step, group, reward and true score means, agreement,
        zero spread, votes, and its rollouts' ids, rewards, true scores, advantages, votes and
        states. A DataFrame (a row a group) when pandas is importable, else a list of dicts."""
        path = f"/api/runs/{int(run_id)}/prompts/{int(prompt_id)}"
        params: dict[str, Any] = {"limit": HISTORY_PER_REQUEST}
        page = self._get(path, params)
        rows = list(page["steps"])
        while page["next"] is not None:
            page = self._get(path, params | {"after": page["next"]})
            rows += page["steps"]
        return _frame(rows)

    def export_chunks(
        self, run_id: int, *, format: str = "jsonl", what: str = "rollouts"
    ) -> Iterator[bytes]:
        """A run's export file, chunk by chunk as it streams (raises before the first chunk when
        the dashboard refuses)."""
        with self._stream(
            f"/api/runs/{int(run_id)}/export", params={"format": format, "what": what}
        ) as response:
            yield from response.iter_bytes()

    def export(
        self,
        run_id: int,
        path: str | Path,
        *,
        format: str = "jsonl",
        what: str = "rollouts",
    ) -> Path:
        """Download a run's export file (see `rollout-lens export`) to `path`, streamed."""
        target = Path(path)
        with self._stream(
            f"/api/runs/{int(run_id)}/export", params={"format": format, "what": what}
        ) as response:
            try:
                with target.open("wb") as f:
                    for chunk in response.iter_bytes():
                        f.write(chunk)
            except BaseException:
                target.unlink(missing_ok=True)  # no half-written file left behind
                raise
        return target

    def import_file(
        self, path: str | Path, *, name: str | None = None, moved: bool = False
    ) -> dict[str, Any]:
        """Import an export file (`rollout-lens export`'s JSONL or Parquet) into the dashboard:
        the new run's id, name, steps and rollouts. `moved`: the file holds a TRL or verl import
        made on this machine (it keeps that source)."""
        params: dict[str, Any] = {"moved": "true" if moved else "false"}
        if name is not None:
            params["name"] = name
        data = Path(path).read_bytes()
        deadline = time.monotonic() + BUSY_WAIT_SECONDS
        while True:
            try:
                response = self._http.post(
                    "/api/record/import",
                    params=params,
                    content=data,
                    headers={"content-type": "application/octet-stream"},
                )
            except httpx.HTTPError as exc:
                raise self._unreachable(exc) from exc
            wait = response.headers.get("retry-after", "")
            if response.status_code != 503 or not wait.isdigit() or time.monotonic() > deadline:
                break
            time.sleep(max(int(wait), 1))
        _raise_for_status(response)
        answer: dict[str, Any] = response.json()
        return answer

    # --- transport -------------------------------------------------------------------------

    def _get(self, path: str, params: dict[str, Any] | None = None) -> Any:
        try:
            response = self._http.get(path, params=params)
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from exc
        _raise_for_status(response)
        return response.json()

    @contextmanager
    def _stream(self, path: str, params: dict[str, Any]) -> Iterator[httpx.Response]:
        try:
            with self._http.stream("GET", path, params=params) as response:
                if response.is_error:
                    response.read()
                    _raise_for_status(response)
                yield response
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from exc

    def _unreachable(self, exc: httpx.HTTPError) -> ClientError:
        kind = type(exc).__name__
        return ClientError(f"cannot reach Rollout Lens at {self.base_url}: {kind}: {exc}")


def _frame(rows: list[dict[str, Any]]) -> Any:
    """Rows as a pandas DataFrame when pandas is importable, else as they are."""
    try:
        import pandas as pd
    except ImportError:
        return rows
    return pd.DataFrame.from_records(rows)


def _param(value: Any) -> Any:
    """A filter's value as the API reads it: booleans as true/false, a step pair as A:B."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)) and len(value) == 2:
        first, last = value
        return f"{'' if first is None else int(first)}:{'' if last is None else int(last)}"
    return value


def _raise_for_status(response: httpx.Response) -> None:
    """A 4xx/5xx answer → ClientError with the server's own message."""
    if not response.is_error:
        return
    try:
        detail = response.json().get("detail")
    except ValueError:
        detail = None
    message = detail if isinstance(detail, str) else response.text[:500] or response.reason_phrase
    raise ClientError(
        f"{response.request.method} {response.request.url.path} → {response.status_code}: "
        f"{message}",
        status=response.status_code,
    )
