"""Mismatch drill-down bench (issue 47): the page and its JSON for one step and for a range at
the range's bound, at a user's shape (512 rollouts × ~1,000 tokens a step), and what the
rollouts' mismatch columns cost the write path.

Data: bench/scale_data.py's steps (64 groups × 8 rollouts × ~1,000 tokens, its logprobs: most
near 0, a tail to −25) with a generator side added to every rollout: the trainer's logprob plus
noise that grows as the token's probability falls (σ = 0.02 + 0.3 · (1 − p)), 1 % of positions
NaN (a token the engine gave none for); written by `store.write_batch` (the StepWriter's
transaction) into a migrated SQLite file and, with --pg, a database created on that PostgreSQL
server (dropped at the end). Enough steps are written that a range from step 1 is cut by
queries.mismatch_page's token bound (MAX_TOKENS), so "range" is the page at its bound.

It prints, for each database: ms a step written (median) and the share of it the mismatch
columns took (recording.rollout_mismatch over the step's rollouts, timed alone); then p50 and
max of the app's own Server-Timing through FastAPI's TestClient, and bytes, for the drill-down
page and its JSON at one step and for the range, the explorer sorted by largest |Δlogp| and
filtered by sequence ratio; then where one step's drill-down spends its time (read and decode,
pool, histogram, table, worst tokens with their text, sample), measured in process.

    .venv/bin/python -m bench.mismatch_drill [--pg [URL]] [--quick] [--tokens 1000]
        [--groups 64] [--group-size 8] [--repeat 5]

`--quick` (seconds: 4 groups × 8 × 96 tokens, 2 requests) keeps it working in CI.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from fastapi.testclient import TestClient
from rollout_lens.server import store
from rollout_lens.server.core import mismatch
from rollout_lens.server.core import mismatch_drill as drill
from rollout_lens.server.core.config import get_settings
from rollout_lens.server.core.records import StepRecord
from rollout_lens.server.store import recording
from rollout_lens.server.store.db import make_engine, make_session_factory, session_scope
from rollout_lens.server.store.migrate import upgrade
from rollout_lens.server.store.models import RunSource, RunStatus
from rollout_lens.server.webapp.app import create_app
from rollout_lens.server.webapp.queries import mismatch_page

from bench.pages import PG_DEFAULT, pg_database
from bench.scale_data import ScaleRun, Shape

QUICK = {"groups": 4, "group_size": 8, "tokens": 96, "repeat": 2}


def with_generator(record: StepRecord, seed: int) -> StepRecord:
    """`record` with a generator side on every rollout: the trainer's logprobs plus noise that
    grows as the token's probability falls, 1 % NaN."""
    rng = np.random.default_rng([seed, record.step])
    for r in record.rollouts:
        trainer = r.token_logprobs
        sigma = 0.02 + 0.3 * (1.0 - np.exp(trainer))
        generator = np.minimum(trainer + rng.normal(0.0, 1.0, len(trainer)) * sigma, 0.0)
        generator[rng.random(len(trainer)) < 0.01] = math.nan
        r.generator_logprobs = generator
    return record


def _steps_for_range(shape: Shape) -> int:
    """Steps enough that a range from step 1 passes MAX_TOKENS (at least 2, at most 8)."""
    per_step = shape.rollouts * shape.tokens
    return max(2, min(8, mismatch_page.MAX_TOKENS // max(per_step, 1) + 2))


def write(url: str, shape: Shape, steps: int) -> tuple[int, list[float], list[float]]:
    """The run written at `url`: its id, each step's write (s) and the mismatch columns' part."""
    engine = make_engine(url)
    upgrade(engine)
    run = ScaleRun(shape)
    with session_scope(make_session_factory(engine)) as session:
        run_id = store.create_run(
            session, name=f"drill {shape.groups}x{shape.group_size}x{shape.tokens}",
            model="Qwen/Qwen3-8B", total_steps=steps, group_size=shape.group_size,
            prompts_per_step=shape.groups, control_tokens=run.control_tokens,
            status=RunStatus.running, source=RunSource.callback,
        ).id  # fmt: skip
    recorder = None
    writes, columns = [], []
    for step in range(1, steps + 1):
        record = with_generator(run.step(step), seed=0)
        started = time.perf_counter()
        recording.rollout_mismatch(record.rollouts)
        columns.append(time.perf_counter() - started)
        started = time.perf_counter()
        recorder = store.write_batch(
            engine, recorder, [record], run_id=run_id,
            control_tokens=run.control_tokens, price_per_hour=2.0,
        )  # fmt: skip
        writes.append(time.perf_counter() - started)
        print(f"  wrote step {step}/{steps}", file=sys.stderr, end="\r")
    engine.dispose()
    return run_id, writes, columns


def _get(client: TestClient, url: str) -> tuple[float, int]:
    response = client.get(url)
    if response.status_code != 200:
        raise SystemExit(f"{url} answered {response.status_code}: {response.text[:300]}")
    return float(response.headers["server-timing"].split("dur=")[1]), len(response.content)


def pages(url: str, run_id: int, steps: int, repeat: int) -> None:
    settings = get_settings(database_url=url, lost_after_seconds=10**9, server_timing=True)
    middle = max(1, steps // 2)
    asked = {
        "drill-down, one step (HTML)": f"/runs/{run_id}/mismatch?step={middle}",
        "drill-down, one step (JSON)": f"/api/runs/{run_id}/mismatch?step={middle}",
        "drill-down, range at its bound (HTML)": f"/runs/{run_id}/mismatch?from=1&to={steps}",
        "drill-down, range at its bound (JSON)": f"/api/runs/{run_id}/mismatch?from=1&to={steps}",
        "explorer, sort max |Δlogp| desc": f"/runs/{run_id}/rollouts?sort=abs_diff_max&order=desc",
        "explorer, seq. ratio outside ×2": f"/api/runs/{run_id}/rollouts?ratio_min=2",
    }
    with TestClient(create_app(settings), base_url="http://127.0.0.1") as client:
        cut = client.get(f"/api/runs/{run_id}/mismatch?from=1&to={steps}").json()
        read = cut["steps"]["read"]
        print(
            f"  range from 1 to {steps}: steps {read[0]}–{read[-1]} read ({cut['tokens']:,} "
            f"tokens compared; cut: {cut['steps']['cut']}, bound {mismatch_page.MAX_TOKENS:,} "
            f"tokens or {mismatch_page.MAX_STEPS} steps)"
        )
        print(f"\n  {'server time (ms)':<40} {'p50':>8} {'max':>8} {'bytes':>11}")
        for label, path in asked.items():
            _get(client, path)  # warm-up
            runs = [_get(client, path) for _ in range(repeat)]
            times = [t for t, _ in runs]
            print(
                f"  {label:<40} {statistics.median(times):8.1f} {max(times):8.1f} "
                f"{runs[-1][1]:>11,}"
            )


def _timed(parts: dict[str, float], name: str, work: Callable[[], Any]) -> Any:
    started = time.perf_counter()
    value = work()
    parts[name] = parts.get(name, 0.0) + (time.perf_counter() - started) * 1000
    return value


def _one_pass(session: Any, run_id: int, step: int, parts: dict[str, float]) -> tuple[int, int]:
    """One step's drill-down, part by part, each part's ms added to `parts`; (rollouts, tokens)."""
    q = mismatch_page
    found = _timed(
        parts, "read + decode 2 blobs a rollout", lambda: q.read_sides(session, run_id, [step])
    )
    tokens = _timed(parts, "pool (compared tokens)", lambda: mismatch.pool(found.sides))
    _timed(parts, "histogram", lambda: drill.histogram(tokens.log_ratios()))
    _timed(parts, "table by probability", lambda: drill.probability_table(tokens))
    _timed(
        parts,
        "step figures",
        lambda: mismatch.pooled_figures(tokens.log_ratios(), tokens.counts()),
    )
    worst = _timed(parts, "worst tokens (partition)", lambda: drill.worst_of(tokens, q.WORST))
    _timed(
        parts,
        "their text and context",
        lambda: q.worst_in_context(session, run_id, found, tokens, worst),
    )
    _timed(parts, "scatter sample", lambda: q.scatter_points(tokens, found, worst))
    return len(found.sides), len(tokens.trainer)


def breakdown(url: str, run_id: int, step: int, repeat: int) -> None:
    """Where one step's drill-down spends its time, each part timed alone in process (ms)."""
    engine = make_engine(url)
    parts: dict[str, float] = {}
    factory = make_session_factory(engine)
    for _ in range(repeat):
        with session_scope(factory) as session:
            rollouts, tokens = _one_pass(session, run_id, step, parts)
    engine.dispose()
    print(
        f"\n  one step's drill-down in process ({rollouts} rollouts, {tokens:,} tokens "
        f"compared), ms each, mean of {repeat}:"
    )
    for name, total in parts.items():
        print(f"    {name:<34} {total / repeat:8.1f}")


def run_on(label: str, url: str, shape: Shape, steps: int, repeat: int) -> None:
    print(f"\n{label}: {steps} steps of {shape.rollouts} rollouts × ~{shape.tokens:,} tokens")
    run_id, writes, columns = write(url, shape, steps)
    share = statistics.median(c / w for c, w in zip(columns, writes, strict=True))
    print(
        f"  a step written in {statistics.median(writes) * 1000:,.0f} ms (median); the mismatch "
        f"columns {statistics.median(columns) * 1000:,.1f} ms of it ({share:.1%})"
    )
    pages(url, run_id, steps, repeat)
    breakdown(url, run_id, max(1, steps // 2), repeat)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pg", nargs="?", const=PG_DEFAULT, default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    shape = Shape(groups=args.groups, group_size=args.group_size, tokens=args.tokens)
    steps = _steps_for_range(shape)
    with tempfile.TemporaryDirectory() as folder:
        run_on("SQLite", f"sqlite:///{Path(folder) / 'drill.db'}", shape, steps, args.repeat)
    if args.pg:
        with pg_database(args.pg) as url:
            run_on("PostgreSQL", url, shape, steps, args.repeat)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
