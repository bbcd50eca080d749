"""What `Client.step_rollouts` costs at a user's step: one streamed request
(`/api/runs/{id}/steps/{step}/rollouts.jsonl`) against the group-by-group paging it replaced.

One step of bench/scale_data.py's shape (default 64 groups × 8 rollouts × ~1,024 tokens, a
150k vocabulary) is recorded into an SQLite file and served by a real `rollout-lens serve`
(bench/load.py); then, alternating, `--repeat` times each:

- stream: `Client.step_rollouts` (every rollout whole, one request);
- groups: what the client did before 6 Dec 2026: the step's groups a page of 500 at a time,
  then each group's rollouts a page at a time with every token position
  (`/steps/{step}/groups/{group}?limit=32&max_tokens=2**31-1`; the API cuts a page to 16,384
  positions, so that asked one rollout a request).

Both must return the same rollouts (checked). Prints each arm's median seconds and requests,
and the ratio.

    .venv/bin/python -m bench.client_step [--groups 64 --group-size 8 --tokens 1024 --repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.load import serving
from bench.scale import open_database
from bench.scale_data import ScaleRun, Shape
from rollout_lens import Client
from rollout_lens.client import ROLLOUT_KEYS

ALL_TOKENS = 2**31 - 1


def record(url: str, shape: Shape) -> int:
    """A run of one step of `shape`, written as the scale bench writes its steps; its id."""
    run = ScaleRun(shape)
    database = open_database("SQLite", url, run, total_steps=1)
    database.write(run.step(1))
    database.engine.dispose()
    return database.run_id


class Counted:
    """An httpx event hook: the requests answered."""

    def __init__(self) -> None:
        self.requests = 0

    def __call__(self, response: httpx.Response) -> None:
        self.requests += 1


def by_groups(base: str, run_id: int, step: int, counted: Counted) -> list[dict[str, Any]]:
    """The step's rollouts as the client read them before: group by group, page by page."""
    path = f"/api/runs/{run_id}/steps/{step}"
    with httpx.Client(base_url=base, timeout=600, event_hooks={"response": [counted]}) as http:
        groups: list[int] = []
        url: str | None = f"{path}?limit=500"
        while url is not None:
            page = http.get(url).raise_for_status().json()
            groups += [g["group"] for g in page["groups"]]
            url = page["links"]["next"]
        rollouts: list[dict[str, Any]] = []
        for group in groups:
            url = f"{path}/groups/{group}?limit=32&max_tokens={ALL_TOKENS}"
            while url is not None:
                part = http.get(url).raise_for_status().json()
                rollouts += [{k: r.get(k) for k in ROLLOUT_KEYS} for r in part["rollouts"]]
                url = part["next"]
        return rollouts


def streamed(base: str, run_id: int, step: int, counted: Counted) -> list[dict[str, Any]]:
    with Client(base) as lens:
        lens._http.event_hooks = {"response": [counted]}  # noqa: SLF001 - the bench counts
        return lens.step_rollouts(run_id, step)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    shape = Shape(groups=args.groups, group_size=args.group_size, tokens=args.tokens)
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        url = f"sqlite:///{tmp / 'client.db'}"
        start = time.perf_counter()
        run_id = record(url, shape)
        print(
            f"one step of {shape.groups} groups × {shape.group_size} rollouts × ~{shape.tokens}"
            f" tokens recorded in {time.perf_counter() - start:.1f} s",
            flush=True,
        )
        arms = {"stream": streamed, "groups": by_groups}
        seconds: dict[str, list[float]] = {arm: [] for arm in arms}
        counts: dict[str, Counted] = {}
        with serving(url, tmp) as (base, _log):
            reference = None
            for i in range(args.repeat):
                for arm in list(arms) if i % 2 == 0 else list(arms)[::-1]:
                    counted = Counted()
                    start = time.perf_counter()
                    rows = arms[arm](base, run_id, 1, counted)
                    seconds[arm].append(time.perf_counter() - start)
                    counts[arm] = counted
                    reference = reference if reference is not None else rows
                    if rows != reference:
                        raise SystemExit(f"{arm}: not the same rollouts as the other arm")
                    print(
                        f"  {arm}: {seconds[arm][-1]:.2f} s, {len(rows)} rollouts,"
                        f" {counted.requests} requests",
                        flush=True,
                    )
        for arm in arms:
            median = statistics.median(seconds[arm])
            print(f"{arm:>7}: median {median:.2f} s ({counts[arm].requests} requests)")
        ratio = statistics.median(seconds["groups"]) / statistics.median(seconds["stream"])
        print(f"groups ÷ stream: {ratio:.1f}×")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
