"""Page-time benchmark: server time of the dashboard on a 10,000-step run vs a 100-step run.

Fills an SQLite file (through server.store, the trainer's write path) with a synthetic leaky run
of 10,000 steps × 8 rollouts whose prompts list all 64 tools, and a 100-step run like it; then
times the step viewer, the run page's series JSON and the runs page through the app, reading the
app's own Server-Timing header. The targets: the step viewer and the series endpoint cost about
the same whatever the run's length (ratio ≤ 1.5), and the step viewer p50 ≤ 20 ms.

    .venv/bin/python -m bench.pages [--steps 10000] [--repeat 200] [--db PATH]

`--demo PATH` instead writes a small leaky-vs-patched pair for looking at the pages.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from fastapi.testclient import TestClient
from rollout_lens.server import figures, queries, store
from rollout_lens.server.app import create_app
from rollout_lens.server.config import get_settings
from rollout_lens.server.db import make_engine, make_session_factory, session_scope
from rollout_lens.server.migrate import upgrade
from rollout_lens.server.models import RunStatus
from rollout_lens.server.records import RolloutRecord, StepRecord
from sqlalchemy.orm import Session, sessionmaker

CONTROL_TOKENS = ("<tool>", "</tool>", "</assistant>")
TOOLS = [f"tool_{i:02d}" for i in range(64)]
QUERIES = [
    ("evaluate 17 * 38", "evaluate an arithmetic expression"),
    ("look up who wrote hamlet", "look up a fact in an encyclopedia"),
    ("translate good morning into french", "translate text between languages"),
    ("get the weather forecast for paris", "get the weather forecast for a city"),
    ("convert 5 miles to metric units", "convert between units of measure"),
    ("send an email to alice about the meeting", "send an email message"),
    ("search for recent news about the mars rover", "search the web for recent news"),
    ("set a reminder to call mom at 6 pm", "set a reminder for a time"),
    ("define the word ephemeral using a dictionary", "look up a word in a dictionary"),
]
TRL_KEYS = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "num_tokens")


def _capabilities(rng: random.Random) -> dict[str, str]:
    caps = [cap for _, cap in QUERIES]
    caps += [f"miscellaneous tool number {i}" for i in range(len(TOOLS) - len(caps))]
    rng.shuffle(caps)
    return dict(zip(TOOLS, caps, strict=True))


class SyntheticRun:
    """Steps of a leaky (oscillating, 64 tools) or patched (converging, top-4) run."""

    def __init__(self, *, variant: str, seed: int) -> None:
        self.variant, self.rng = variant, random.Random(seed)
        self.caps = _capabilities(self.rng)
        self.by_cap = {cap: tool for tool, cap in self.caps.items()}
        self.level = 0.5

    def prompt(self, query: str, target: str) -> tuple[str, list[str]]:
        if self.variant == "leaky":
            listed = TOOLS
        else:
            others = [t for t in TOOLS if t != target]
            listed = sorted([target, *self.rng.sample(others, 3)], key=lambda t: self.caps[t])
        listing = "\n".join(f"- {t}: {self.caps[t]}" for t in listed)
        text = (
            f"<user>Tools:\n{listing}\nQuery: {query}\n"
            "Reply with only <tool>ID</tool> for the one tool whose capability matches the query."
            "</user><assistant>"
        )
        return text, list(listed)

    def accuracy(self, step: int) -> float:
        if self.variant == "patched":
            return min(0.99, 0.25 + 0.75 * (1 - math.exp(-step / 9)))
        if step % 25 == 1:  # the leaky run's bucket-to-bucket swings
            self.level = self.rng.choice([0.05, 0.2, 0.5, 0.8, 0.95])
        return self.level

    def collapsing(self, step: int) -> bool:
        """The leaky run breaks its call format for a stretch (end-of-turn after the opening tag)."""
        return self.variant == "leaky" and 180 <= step % 1000 < 195

    def rollout(
        self, index: int, prompt: str, target: str, listed: list[str], p_correct: float, step: int
    ) -> RolloutRecord:
        rng = self.rng
        correct = rng.random() < p_correct
        vote = target if correct else rng.choice([t for t in listed if t != target] or [target])
        collapse = self.variant == "leaky" and rng.random() < (
            0.7 if self.collapsing(step) else 0.03
        )
        p_vote = rng.uniform(0.55, 0.98) if correct else rng.uniform(0.05, 0.6)
        if collapse:
            completion, ids = "<tool>", [5, 2]
            logprobs = [math.log(rng.uniform(0.9, 0.99)), math.log(rng.uniform(0.3, 0.6))]
            ctrl = {
                "<tool>": [math.exp(logprobs[0]), 0.01],
                "</tool>": [0.001, 0.05],
                "</assistant>": [0.002, math.exp(logprobs[1])],
            }
        else:
            completion = f"<tool>{vote}</tool>"
            ids = [5, 100 + TOOLS.index(vote), 6, 2]
            logprobs = [
                math.log(rng.uniform(0.95, 0.999)),
                math.log(p_vote),
                math.log(rng.uniform(0.9, 0.99)),
                math.log(rng.uniform(0.9, 0.99)),
            ]
            spike = (
                rng.uniform(0.2, 0.45)
                if self.variant == "leaky" and rng.random() < 0.05
                else rng.uniform(0, 0.02)
            )
            ctrl = {
                "<tool>": [
                    math.exp(logprobs[0]),
                    rng.uniform(0, 0.01),
                    rng.uniform(0, 0.01),
                    rng.uniform(0, 0.01),
                ],
                "</tool>": [
                    rng.uniform(0, 0.01),
                    spike,
                    math.exp(logprobs[2]),
                    rng.uniform(0, 0.02),
                ],
                "</assistant>": [
                    rng.uniform(0, 0.01),
                    rng.uniform(0, 0.02),
                    rng.uniform(0, 0.05),
                    math.exp(logprobs[3]),
                ],
            }
        reward = (
            1.0
            if vote == target and not collapse
            else (0.0 if collapse else rng.choice([0.0, 0.0, 0.5]))
        )
        tokens = (
            ["<tool>", "</assistant>"] if collapse else ["<tool>", vote, "</tool>", "</assistant>"]
        )
        probes = {
            "open_first": ctrl["<tool>"][0],
            "eot_after_open": ctrl["</assistant>"][1],
            "close_after_id": None if collapse else ctrl["</tool>"][2],
            "eot_after_close": None if collapse else ctrl["</assistant>"][3],
        }
        return RolloutRecord(
            group=0,
            index=index,
            prompt=prompt,
            completion=completion,
            completion_ids=ids,
            token_logprobs=logprobs,
            control_probs=ctrl,
            vote=None if collapse else vote,
            target=target,
            verifier_reward=reward,
            true_score=float(vote == target and not collapse),
            advantage=0.0,
            format_valid=not collapse,
            format_state="collapse" if collapse else "healthy_call",
            meta={
                "query": "",
                "tool_ids": listed,
                "target_listed": target in listed,
                "hint": None,
                "tokens": tokens,
                "probes": probes,
            },
        )

    def step(self, step: int, group_size: int = 8) -> StepRecord:
        query, cap = self.rng.choice(QUERIES)
        target = self.by_cap[cap]
        prompt, listed = self.prompt(query, target)
        p = self.accuracy(step)
        rollouts = [self.rollout(i, prompt, target, listed, p, step) for i in range(group_size)]
        for r in rollouts:
            r.meta["query"] = query
        rewards = [r.verifier_reward for r in rollouts]
        mean = sum(rewards) / len(rewards)
        std = statistics.pstdev(rewards) or 1.0
        for r in rollouts:
            r.advantage = (r.verifier_reward - mean) / std
        votes = [r.vote for r in rollouts]
        counts = {v: votes.count(v) for v in set(votes)}
        agree = max((c for v, c in counts.items() if v is not None), default=0) / group_size
        entropy = -sum(c / group_size * math.log2(c / group_size) for c in counts.values())
        values = {
            "reward_mean": mean,
            "true_accuracy": sum(r.true_score or 0 for r in rollouts) / group_size,
            "format_valid_rate": sum(r.format_valid for r in rollouts) / group_size,
            "vote_agreement": agree,
            "vote_entropy": entropy,
            "zero_std_share": float(len(set(rewards)) == 1),
            "loss": self.rng.gauss(0.0, 0.05),
            "kl": abs(self.rng.gauss(0.002 * math.log1p(step), 0.001)),
            "entropy": max(0.01, 1.2 * math.exp(-step / 400) + self.rng.gauss(0, 0.03)),
            "grad_norm": abs(self.rng.gauss(1.0, 0.4)) * (6 if self.rng.random() < 0.01 else 1),
            "learning_rate": 3e-4,
            "completion_length": sum(len(r.completion_ids) for r in rollouts) / group_size,
            "wall_time": self.rng.uniform(0.4, 0.6),
        }
        metrics: dict[str, float | None] = {}
        for token in CONTROL_TOKENS:
            probs = [p for r in rollouts for p in r.control_probs[token]]
            metrics[f"ctrl/{token}/mean"] = sum(probs) / len(probs)
            metrics[f"ctrl/{token}/max"] = max(probs)
        states = [r.format_state for r in rollouts]
        for state in ("healthy_call", "text_pollution", "collapse", "no_call"):
            metrics[f"state/{state}"] = states.count(state) / group_size
        for probe in ("open_first", "eot_after_open", "close_after_id", "eot_after_close"):
            present = [
                r.meta["probes"][probe] for r in rollouts if r.meta["probes"][probe] is not None
            ]
            metrics[f"probe/{probe}/mean"] = sum(present) / len(present) if present else None
            metrics[f"probe/{probe}/max"] = max(present) if present else None
        metrics["retrieval_recall"] = 1.0
        for key in TRL_KEYS:
            metrics[f"trl/{key}"] = self.rng.random()
        return StepRecord(
            step=step, rollout_step=step, values=values, rollouts=rollouts, metrics=metrics
        )


def fill(
    factory: sessionmaker[Session],
    *,
    steps: int,
    variant: str,
    seed: int,
    name: str,
    status: RunStatus = RunStatus.completed,
    batch: int = 100,
    progress: Callable[[int], None] | None = None,
) -> int:
    """A synthetic run written through the recorder (the trainer's write path), one transaction
    per `batch` steps."""
    with session_scope(factory) as session:
        run = store.create_run(
            session,
            name=name,
            model="tiny",
            total_steps=steps,
            group_size=8,
            seed=seed,
            variant=variant,
            k=4 if variant == "patched" else None,
            config={
                "variant": variant,
                "steps": steps,
                "learning_rate": 3e-4,
                "k": 4,
                "seed": seed,
                "temperature": 1.0,
            },
            control_tokens=CONTROL_TOKENS,
            status=RunStatus.running,
        )
        run_id = run.id
    synthetic = SyntheticRun(variant=variant, seed=seed)
    recorder: store.Recorder | None = None
    for start in range(1, steps + 1, batch):
        with factory.kw["bind"].begin() as conn:
            if recorder is None:
                recorder = store.Recorder(conn, run_id=run_id, control_tokens=CONTROL_TOKENS)
            for step in range(start, min(start + batch, steps + 1)):
                record = synthetic.step(step)
                recorder.write(
                    conn, record, device_seconds=record.values["wall_time"] or 0, price_per_hour=2.0
                )
        if progress:
            progress(min(start + batch - 1, steps))
    if status != RunStatus.running:
        with session_scope(factory) as session:
            store.mark_finished(session, run_id=run_id, status=status)
    return run_id


def _server_ms(client: TestClient, url: str) -> float:
    response = client.get(url)
    if response.status_code != 200:
        raise SystemExit(f"{url} answered {response.status_code}: {response.text[:300]}")
    timing = response.headers["server-timing"]
    return float(timing.split("dur=")[1])


def measure(client: TestClient, url: str, repeat: int) -> tuple[float, float]:
    """Median and p95 of the server's own time for `url`, in ms (after a warm-up)."""
    for _ in range(5):
        _server_ms(client, url)
    times = sorted(_server_ms(client, url) for _ in range(repeat))
    return statistics.median(times), times[min(len(times) - 1, math.ceil(0.95 * len(times)) - 1)]


def run_bench(db: Path, *, steps: int, small: int, repeat: int) -> int:
    url = f"sqlite:///{db}"
    engine = make_engine(url)
    upgrade(engine)
    factory = make_session_factory(engine)
    with session_scope(factory) as session:
        existing = {run["name"]: run["id"] for run in queries.list_runs(session)}
    if f"leaky {steps}" in existing and f"leaky {small}" in existing:
        big, little = existing[f"leaky {steps}"], existing[f"leaky {small}"]
        print(f"  reusing the runs already in {db}")
    else:
        started = time.perf_counter()
        big = fill(
            factory,
            steps=steps,
            variant="leaky",
            seed=1,
            name=f"leaky {steps}",
            progress=lambda s: print(f"\r  filled {s}/{steps} steps", end="", flush=True),
        )
        print(f"\n  {steps} steps × 8 rollouts written in {time.perf_counter() - started:.0f} s")
        little = fill(factory, steps=small, variant="leaky", seed=2, name=f"leaky {small}")
        for i in range(20):  # a runs page with a realistic number of rows
            fill(factory, steps=30, variant="patched", seed=10 + i, name=f"patched {i}")
    engine.dispose()

    settings = get_settings(database_url=url)
    warm, cold = create_app(settings), create_app(settings, cache_size=0)

    def chart_names(run_id: int) -> str:
        """The series the run page asks for when it loads (its non-lazy charts)."""
        with session_scope(factory) as session:
            overview = queries.run_overview(session, run_id=run_id)
        figs = figures.run_figures(overview["run"]["control_tokens"], overview["series_names"])
        shown = [f for key in ("main", "structure", "optimization") for f in figs[key]]
        return ",".join(
            sorted({t["meta"]["series"] for f in shown for t in f["data"] if "series" in t["meta"]})
        )

    names = {big: chart_names(big), little: chart_names(little)}
    pages: dict[str, tuple[TestClient, Callable[[int, int], str]]] = {}
    with TestClient(warm) as w, TestClient(cold) as c:
        pages = {
            "step viewer (HTML)": (w, lambda r, n: f"/runs/{r}/steps/{n // 2}"),
            "step JSON": (w, lambda r, n: f"/api/runs/{r}/steps/{n // 2}"),
            "run page (HTML)": (w, lambda r, n: f"/runs/{r}"),
            "series: run page, reload": (w, lambda r, n: f"/api/runs/{r}/series?names={names[r]}"),
            "series: run page, cold": (c, lambda r, n: f"/api/runs/{r}/series?names={names[r]}"),
            "series: live poll": (
                c,
                lambda r, n: f"/api/runs/{r}/series?names={names[r]}&since={n - 1}",
            ),
            "alerts: cold": (c, lambda r, n: f"/api/runs/{r}/alerts"),
        }
        print(
            f"\n  server time (Server-Timing) in ms, {repeat} requests each ({repeat // 5} cold)\n"
        )
        print(f"  {'':<26} {f'{steps} steps':>17} {f'{small} steps':>17} {'ratio':>7}")
        print(f"  {'':<26} {'p50':>8} {'p95':>8} {'p50':>8} {'p95':>8} {'of p50':>7}")
        for label, (client, make) in pages.items():
            n = repeat // 5 if client is c else repeat
            big_p50, big_p95 = measure(client, make(big, steps), n)
            small_p50, small_p95 = measure(client, make(little, small), n)
            ratio = big_p50 / small_p50
            print(
                f"  {label:<26} {big_p50:8.2f} {big_p95:8.2f} {small_p50:8.2f} {small_p95:8.2f} {ratio:7.2f}"
            )
        with session_scope(factory) as session:
            count = len(queries.list_runs(session))
        p50, p95 = measure(w, "/", repeat)
        print(f"  {f'runs page ({count} runs)':<26} {p50:8.2f} {p95:8.2f}")
        p50, p95 = measure(w, "/api/runs", repeat)
        print(f"  {f'runs JSON ({count} runs)':<26} {p50:8.2f} {p95:8.2f}")
    return 0


def demo(db: Path) -> int:
    """A leaky-vs-patched pair and a failed run, for screenshots and a first look."""
    url = f"sqlite:///{db}"
    engine = make_engine(url)
    upgrade(engine)
    factory = make_session_factory(engine)
    fill(factory, steps=250, variant="leaky", seed=4, name="escalation leaky (64 tools)")
    fill(factory, steps=250, variant="patched", seed=4, name="escalation patched (top-4)")
    failed = fill(
        factory, steps=40, variant="leaky", seed=5, name="leaky lr=3e-3", status=RunStatus.failed
    )
    with session_scope(factory) as session:
        store.mark_finished(
            session,
            run_id=failed,
            status=RunStatus.failed,
            error="RuntimeError: CUDA out of memory while generating step 41",
        )
    fill(
        factory, steps=120, variant="patched", seed=6, name="patched live", status=RunStatus.running
    )
    engine.dispose()
    print(f"demo runs written to {url}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--small", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--db", type=Path, help="SQLite file to fill (default: a temporary one)")
    parser.add_argument("--demo", type=Path, help="write demo runs to this SQLite file and exit")
    args = parser.parse_args(argv)
    if args.demo:
        return demo(args.demo)
    if args.db:
        return run_bench(args.db, steps=args.steps, small=args.small, repeat=args.repeat)
    with tempfile.TemporaryDirectory(prefix="rollout-lens-bench-") as tmp:
        return run_bench(
            Path(tmp) / "bench.db", steps=args.steps, small=args.small, repeat=args.repeat
        )


if __name__ == "__main__":
    sys.exit(main())
