"""How reading a run's series grows with its number of series names.

Writes runs of `--steps` steps with 125, 250, 500 and 1,000 generic series names (the cap a run
holds, server.core.vocab.MAX_SERIES_PER_RUN) through server.store, then reads each run's
`/api/runs/{id}/series` (every name; `full=1` and the charts' downsampled default) and its run
page through the app, printing the app's own time (Server-Timing) and the body's size, and the
ratio of time per name against the smallest run: near 1 is linear, a quadratic read doubles it
with every doubling of the names.

    .venv/bin/python -m bench.series_names [--steps 200] [--repeat 5] [--db PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from fastapi.testclient import TestClient
from rollout_lens.server import store
from rollout_lens.server.core.config import get_settings
from rollout_lens.server.core.records import StepRecord
from rollout_lens.server.core.vocab import MAX_SERIES_PER_RUN
from rollout_lens.server.store.db import make_engine, make_session_factory, session_scope
from rollout_lens.server.store.migrate import upgrade
from rollout_lens.server.webapp.app import create_app

SIZES = (
    MAX_SERIES_PER_RUN // 8,
    MAX_SERIES_PER_RUN // 4,
    MAX_SERIES_PER_RUN // 2,
    MAX_SERIES_PER_RUN,
)


def write_run(factory, *, names: int, steps: int) -> int:  # type: ignore[no-untyped-def]
    """A run of `steps` steps, each logging `names` series."""
    with session_scope(factory) as session:
        run_id = store.create_run(
            session, name=f"{names} names", model="tiny", total_steps=steps, group_size=8
        ).id
    with session_scope(factory) as session:
        recorder = None
        for step in range(1, steps + 1):
            metrics = {f"user/{i:05d}": (step * 7 + i) % 13 / 13 for i in range(names)}
            record = StepRecord(step, step, {"reward_mean": 0.5}, metrics=metrics)
            recorder = store.record_step(
                session, run_id=run_id, record=record, control_tokens=(), recorder=recorder
            )
    return run_id


def server_ms(client: TestClient, url: str, repeat: int) -> tuple[float, int]:
    """Median server time in ms (after one warm-up) and the body's size."""
    sizes, times = [], []
    for i in range(repeat + 1):
        response = client.get(url)
        if response.status_code != 200:
            raise SystemExit(f"{url} answered {response.status_code}: {response.text[:300]}")
        if i:
            times.append(float(response.headers["server-timing"].split("dur=")[1]))
            sizes.append(len(response.content))
    return statistics.median(times), sizes[0]


def run_bench(db: Path, *, steps: int, repeat: int) -> int:
    url = f"sqlite:///{db}"
    engine = make_engine(url)
    upgrade(engine)
    factory = make_session_factory(engine)
    runs = {n: write_run(factory, names=n, steps=steps) for n in SIZES}
    settings = get_settings().model_copy(update={"database_url": url, "server_timing": True})
    app = create_app(settings, session_factory=factory, cache_size=0)
    print(
        f"{steps} steps a run; server time (median of {repeat}) and bytes; ms per name / smallest's"
    )
    with TestClient(app, base_url="http://127.0.0.1") as client:
        for label, path in (
            ("series full=1", "/api/runs/{id}/series?full=1"),
            ("series", "/api/runs/{id}/series"),
            ("run page", "/runs/{id}"),
        ):
            base = None
            for n, run_id in runs.items():
                ms, size = server_ms(client, path.format(id=run_id), repeat)
                per_name = ms / n
                base = base or per_name
                print(
                    f"{label:>14}  {n:>5} names  {ms:8.1f} ms  {size / 1e6:7.2f} MB  "
                    f"{per_name / base:5.2f}×"
                )
    engine.dispose()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--db", type=Path, help="SQLite file to write (default: a temporary one)")
    args = parser.parse_args(argv)
    if args.db is not None:
        return run_bench(args.db, steps=args.steps, repeat=args.repeat)
    with tempfile.TemporaryDirectory() as folder:
        return run_bench(Path(folder) / "bench.db", steps=args.steps, repeat=args.repeat)


if __name__ == "__main__":
    sys.exit(main())
