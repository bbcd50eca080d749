"""Leaky (64 tools) vs patched (top-k shortlist): same model, seed and recipe, on the CPU.

Trains both variants through the real recording trainer into a temporary SQLite file and prints,
per run, true accuracy and verifier reward per 25-step bucket, vote agreement, the step it
converged at (analysis.converged_at, as compare shows it), and wall time.

    .venv/bin/python bench/escalation.py --steps 150 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rollout_lens.server import store  # noqa: E402
from rollout_lens.server.core import analysis  # noqa: E402
from rollout_lens.server.core.config import get_settings  # noqa: E402
from rollout_lens.server.core.runconfig import RunConfig  # noqa: E402
from rollout_lens.server.core.vocab import WINDOW  # noqa: E402
from rollout_lens.server.store.db import make_engine, make_session_factory, session_scope  # noqa: E402
from rollout_lens.server.store.migrate import upgrade  # noqa: E402
from rollout_lens.trainer.worker.run import train  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", default=["patched", "leaky"])
    parser.add_argument("--lr", type=float, default=RunConfig.model_fields["learning_rate"].default)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        settings = get_settings(data_dir=Path(tmp))  # the model cache setting still applies
        engine = make_engine(settings.database_url)
        upgrade(engine)
        factory = make_session_factory(engine)
        table = []
        for seed in args.seeds:
            for variant in args.variants:
                config = RunConfig(
                    variant=variant, steps=args.steps, seed=seed, learning_rate=args.lr
                )
                started = time.perf_counter()
                run_id = train(config, settings=settings)
                wall = time.perf_counter() - started
                with session_scope(factory) as session:
                    steps = store.steps(session, run_id=run_id)
                table.append(_report(config, steps, wall))
        print(
            f"\nsummary (converged: the first closed {WINDOW}-step bucket reaching {analysis.CONVERGED})"
        )
        print(
            f"{'variant':<8} {'seed':>4} {'converged':>9} {'final acc':>9} {'final agree':>11} {'s/step':>7} {'wall s':>7}"
        )
        for row in table:
            print(
                f"{row['variant']:<8} {row['seed']:>4} {str(row['reach']):>9} {row['final_acc']:>9.2f} "
                f"{row['final_agree']:>11.2f} {row['s_per_step']:>7.3f} {row['wall']:>7.1f}"
            )


def _report(config: RunConfig, steps: list, wall: float) -> dict:  # type: ignore[type-arg]
    numbers = [s.step for s in steps]
    acc = [s.true_accuracy for s in steps]
    reward = [s.reward_mean for s in steps]
    agree = [s.vote_agreement for s in steps]
    ends, bucket_acc = analysis.bucket_ends(numbers, acc)
    reach = analysis.converged_at(ends, bucket_acc, numbers[-1] if numbers else None)
    print(f"\n== {config.name}: {len(steps)} steps, lr {config.learning_rate}, wall {wall:.1f} s")
    print(f"{'bucket':>9} {'true acc':>8} {'reward':>8} {'agreement':>9}")
    rows = zip(
        analysis.buckets(numbers, acc),
        analysis.buckets(numbers, reward),
        analysis.buckets(numbers, agree),
        strict=True,
    )
    for (start, a), (_, r), (_, g) in rows:
        print(f"{start:>4}-{start + WINDOW - 1:<4} {a:>8.2f} {r:>8.2f} {g:>9.2f}")
    print(f"converged at (first closed bucket with true accuracy >= {analysis.CONVERGED}): {reach}")
    return {
        "variant": config.variant,
        "seed": config.seed,
        "reach": reach,
        "final_acc": analysis.final_mean(acc) or 0.0,
        "final_agree": analysis.final_mean(agree) or 0.0,
        "s_per_step": wall / max(len(steps), 1),
        "wall": wall,
    }


if __name__ == "__main__":
    main()
