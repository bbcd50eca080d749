"""The first seed's picture on the tiny model: the leaky-vs-patched pair, reward against accuracy.

The seed (Qwen2.5-1.5B, seed 4, 500 steps, batch 8) shows two different curves per run: the leaky
run's verifier reward sits around 0.7 while its true accuracy swings 0 <-> 1 between 25-step
buckets, and its group splits its votes (three for one id, two for another at step 125); the
patched run's reward is about 0.88 at true accuracy about 1.0, every rollout voting alike.

This trains the launch form's leaky-vs-patched preset (its verifier and recipe; any field can be
overridden) through the worker's own `train()` and prints, per 25-step bucket, each run's reward
and true accuracy beside the seed's figures, then how the group votes: the mean share of the
modal id, the mean number of distinct ids, and the steps where the group split like the seed's
(at least two ids with two or more votes each).

    .venv/bin/python bench/seed_picture.py --steps 500 --seed 4
    .venv/bin/python bench/seed_picture.py --turns multi --steps 200 --seed 4
    .venv/bin/python bench/seed_picture.py --steps 500 --seed 4 --set learning_rate=1e-3
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rollout_lens.server import store  # noqa: E402
from rollout_lens.server.core import analysis  # noqa: E402
from rollout_lens.server.core.config import get_settings  # noqa: E402
from rollout_lens.server.core.presets import PRESETS  # noqa: E402
from rollout_lens.server.core.runconfig import RunConfig  # noqa: E402
from rollout_lens.server.store.db import make_engine, make_session_factory, session_scope  # noqa: E402
from rollout_lens.server.store.migrate import upgrade  # noqa: E402
from rollout_lens.server.webapp import queries  # noqa: E402
from rollout_lens.trainer.worker.run import train  # noqa: E402

SEED = {  # the seed's figures (000_…: Qwen2.5-1.5B-Instruct, seed 4, 500 steps)
    "leaky": "reward ~0.7 throughout; true accuracy swings 0.0 <-> 1.0 between 25-step buckets",
    "patched": "reward ~0.88; true accuracy ~1.0; all 8 rollouts vote alike at every step",
}


def parse_sets(pairs: list[str]) -> dict[str, Any]:
    out = {}
    for pair in pairs:
        name, _, text = pair.partition("=")
        out[name] = json.loads(text) if text[:1] in "[{" else _number(text)
    return out


def _number(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def votes(factory: Any, run_id: int) -> dict[str, Any]:
    """How the groups voted: modal share, distinct ids, and the steps that split like the seed's."""
    modal, distinct, split = [], [], []
    with session_scope(factory) as session:
        groups: dict[tuple[int, int], list[str | None]] = {}
        for rollout, _ in store.iter_rollouts(session, run_id=run_id):
            groups.setdefault((rollout.step, rollout.group), []).append(rollout.vote)
    for (step, _), group in sorted(groups.items()):
        counts = Counter(v for v in group if v)
        modal.append(max(counts.values(), default=0) / len(group))
        distinct.append(len(counts))
        if sum(n >= 2 for n in counts.values()) >= 2:
            split.append(step)
    return {
        "modal": sum(modal) / len(modal) if modal else None,
        "distinct": sum(distinct) / len(distinct) if distinct else None,
        "split": split,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", default="single", choices=["single", "multi"])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--seed", type=int, default=4)
    parser.add_argument(
        "--set", nargs="*", default=[], metavar="FIELD=VALUE", help="RunConfig overrides"
    )
    parser.add_argument("--only", choices=["leaky", "patched"], help="train one of the pair")
    args = parser.parse_args()
    preset = PRESETS["multi_leaky_vs_patched" if args.turns == "multi" else "leaky_vs_patched"]
    base = dict(preset.base) | {"steps": args.steps, "seed": args.seed, "eval_every": 0}
    base |= parse_sets(args.set)
    out: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        settings = get_settings(data_dir=Path(tmp))
        engine = make_engine(settings.database_url)
        upgrade(engine)
        factory = make_session_factory(engine)
        for run in preset.runs:
            if args.only and run["variant"] != args.only:
                continue
            config = RunConfig(**(base | dict(run)))
            started = time.perf_counter()
            run_id = train(config, settings=settings)
            with session_scope(factory) as session:
                steps = store.steps(session, run_id=run_id)
                alerts = queries.alerts(session, run_id=run_id)
            numbers = [s.step for s in steps]
            out[config.variant] = {
                "config": config,
                "wall": time.perf_counter() - started,
                "reward": analysis.buckets(numbers, [s.reward_mean for s in steps]),
                "acc": analysis.buckets(numbers, [s.true_accuracy for s in steps]),
                "votes": votes(factory, run_id),
                "alerts": Counter(f"{a['severity']} {a['kind']}" for a in alerts),
            }
    first = next(iter(out.values()))["config"]
    print(
        f"\n{args.turns}-turn pair, seed {args.seed}, {args.steps} steps, lr "
        f"{first.learning_rate:g}, verifier {first.verifier} (p {first.verifier_noise:g}), "
        f"G {first.group_size}, temperature {first.temperature:g}"
    )
    variants = list(out)
    header = "steps    " + "".join(f"{v + ' reward':>15}{v + ' acc':>13}" for v in variants)
    print(header)
    rows = zip(*(zip(out[v]["reward"], out[v]["acc"], strict=True) for v in variants), strict=True)
    for parts in rows:
        start = parts[0][0][0]
        cells = "".join(f"{r:>15.2f}{a:>13.2f}" for (_, r), (_, a) in parts)
        print(f"{start:>4}-{start + 24:<4}{cells}")
    for v in variants:
        got = out[v]
        spread = [a for _, a in got["acc"]]
        swing = max(spread) - min(spread) if spread else 0.0
        vote = got["votes"]
        print(
            f"\n{v}: wall {got['wall']:.0f} s; bucket accuracy spread (max - min) {swing:.2f}; "
            f"modal vote share {vote['modal']:.2f}, distinct ids per group {vote['distinct']:.2f}; "
            f"groups split like the seed's (two ids with >= 2 votes) at {len(vote['split'])} "
            f"steps{' e.g. ' + ', '.join(map(str, vote['split'][:5])) if vote['split'] else ''}"
        )
        alerts = ", ".join(f"{n} x {k}" for k, n in sorted(got["alerts"].items())) or "none"
        print(f"  alerts: {alerts}")
        if v in SEED:
            print(f"  the seed: {SEED[v]}")


if __name__ == "__main__":
    main()
