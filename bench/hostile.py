"""Hostile-input benchmark: server time of the step viewer on a step whose completions are 1 MB.

Writes, through server.store (the trainer's write path), steps of 8 rollouts whose completions
are 1 MB of HTML, template syntax and control characters each — once as a few tokens (a hostile
text) and once as 262,144 tokens (a real long generation, with its per-token arrays) — then reads
the step viewer, its compare card, the compare page and the step JSON through the app, printing
the app's own time from its Server-Timing header. The target: the step viewer under 100 ms.

    .venv/bin/python -m bench.hostile [--repeat 20] [--db PATH]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import tempfile
from pathlib import Path

from fastapi.testclient import TestClient
from rollout_lens.server import store
from rollout_lens.server.core.config import get_settings
from rollout_lens.server.core.records import RolloutRecord, StepRecord
from rollout_lens.server.store.db import make_engine, make_session_factory, session_scope
from rollout_lens.server.store.migrate import upgrade
from rollout_lens.server.webapp.app import create_app

CONTROL_TOKENS = ("<tool>", "</tool>", "</assistant>")
MB = 2**20
# HTML, a script, template syntax of Jinja and of JS frameworks, control characters.
PATTERN = (
    "<script>alert(1)</script><img src=x onerror=alert(2)> {{ 7*7 }} {% if %} ${7*7} \x07\x1b[31m "
)


def hostile_text(size: int = MB) -> str:
    """`size` characters of PATTERN repeated."""
    return (PATTERN * (size // len(PATTERN) + 1))[:size]


def hostile_step(step: int, *, tokens: list[int], size: int = MB, seed: int = 0) -> StepRecord:
    """A step of one group of len(tokens) rollouts, each a `size`-character completion of
    tokens[i] tokens."""
    rng = random.Random(seed)
    text = hostile_text(size)
    rollouts = [
        RolloutRecord(
            group=0,
            index=i,
            prompt="<user>" + PATTERN * 4 + "</user><assistant>",
            completion=text,
            completion_ids=[rng.randrange(50_000) for _ in range(n)],
            token_logprobs=[-rng.random() for _ in range(n)],
            control_probs={t: [rng.random() * 0.1 for _ in range(n)] for t in CONTROL_TOKENS},
            vote=None,
            target="tool_01",
            verifier_reward=0.0,
            true_score=0.0,
            advantage=0.0,
            format_valid=False,
            format_state="text_pollution",
            meta={"query": PATTERN},
        )
        for i, n in enumerate(tokens)
    ]
    return StepRecord(step=step, rollout_step=step, values={"reward_mean": 0.0}, rollouts=rollouts)


def write_run(database_url: str, *, tokens: list[int], name: str) -> int:
    """A run of two hostile steps (step 1 and 2), written through store.record_step."""
    engine = make_engine(database_url)
    upgrade(engine)
    factory = make_session_factory(engine)
    try:
        with session_scope(factory) as session:
            run_id = store.create_run(
                session,
                name=name,
                model="tiny",
                total_steps=2,
                group_size=8,
                config={"note": PATTERN},
                control_tokens=CONTROL_TOKENS,
            ).id
        for step in (1, 2):
            with session_scope(factory) as session:
                store.record_step(
                    session,
                    run_id=run_id,
                    record=hostile_step(step, tokens=tokens, seed=step),
                    control_tokens=CONTROL_TOKENS,
                )
        return run_id
    finally:
        engine.dispose()


def server_ms(client: TestClient, url: str) -> tuple[float, int]:
    """The app's own time for `url` (Server-Timing) and the body's size."""
    response = client.get(url)
    if response.status_code != 200:
        raise SystemExit(f"{url} answered {response.status_code}: {response.text[:300]}")
    return float(response.headers["server-timing"].split("dur=")[1]), len(response.content)


def measure(client: TestClient, url: str, repeat: int) -> tuple[float, float, int]:
    """p50 and p95 of the server time in ms after two warm-up requests, and the body size."""
    for _ in range(2):
        server_ms(client, url)
    runs = [server_ms(client, url) for _ in range(repeat)]
    times = sorted(t for t, _ in runs)
    p95 = times[min(len(times) - 1, math.ceil(0.95 * len(times)) - 1)]
    return statistics.median(times), p95, runs[0][1]


def run_bench(db: Path, *, repeat: int) -> int:
    url = f"sqlite:///{db}"
    long = 262_144  # 1 MB of text at 4 characters a token
    cases = {
        "8 × 1 MB, 64 tokens each": write_run(url, tokens=[64] * 8, name=PATTERN + " a"),
        "1 × 1 MB of 262,144 tokens": write_run(url, tokens=[long] + [64] * 7, name=PATTERN + " b"),
        "8 × 1 MB of 262,144 tokens": write_run(url, tokens=[long] * 8, name=PATTERN + " c"),
    }
    ids = list(cases.values())
    other = {run_id: ids[(i + 1) % len(ids)] for i, run_id in enumerate(ids)}
    app = create_app(get_settings(database_url=url, server_timing=True), cache_size=0)
    print(f"\n  a step of 8 rollouts; server time in ms, {repeat} requests each\n")
    print(f"  {'':<28} {'page':<22} {'p50':>8} {'p95':>8} {'body':>10}")
    worst = 0.0
    with TestClient(app, base_url="http://127.0.0.1") as client:
        for label, run_id in cases.items():
            pages = {
                "step viewer (HTML)": f"/runs/{run_id}/steps/1",
                "compare card (HTML)": f"/runs/{run_id}/steps/1/card",
                "compare page (HTML)": f"/compare?runs={run_id},{other[run_id]}",
                "run page (HTML)": f"/runs/{run_id}",
                "step JSON (groups)": f"/api/runs/{run_id}/steps/1",
                "group JSON (a page)": f"/api/runs/{run_id}/steps/1/groups/0",
            }
            for page, path in pages.items():
                n = max(3, repeat // 5) if "JSON" in page else repeat
                p50, p95, size = measure(client, path, n)
                if page == "step viewer (HTML)":
                    worst = max(worst, p95)
                print(f"  {label:<28} {page:<22} {p50:8.1f} {p95:8.1f} {size / MB:8.2f} MB")
    verdict = "under" if worst < 100 else "OVER"
    print(f"\n  step viewer p95, worst case: {worst:.1f} ms ({verdict} the 100 ms target)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--db", type=Path, help="SQLite file to write (default: a temporary one)")
    args = parser.parse_args(argv)
    if args.db:
        return run_bench(args.db, repeat=args.repeat)
    with tempfile.TemporaryDirectory(prefix="rollout-lens-hostile-") as tmp:
        return run_bench(Path(tmp) / "hostile.db", repeat=args.repeat)


if __name__ == "__main__":
    sys.exit(main())
