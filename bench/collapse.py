"""Control-token collapse on the CPU, and whether supervisory signals prevent it.

Trains the patched tiny run with a too-high learning rate, once per method (plain GRPO and each
supervisory signal), same seed and recipe; prints per method the 25-step true accuracy curve,
whether and when it collapsed, the first control-token-spike alert and its lead over the fall of
true accuracy, and the final in-distribution / format-OOD / content-OOD greedy accuracy.

    .venv/bin/python bench/collapse.py --lr 1e-3 --steps 300 --seed 0
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rollout_lens.server import alerts, analysis, store  # noqa: E402
from rollout_lens.server.config import get_settings  # noqa: E402
from rollout_lens.server.db import make_engine, make_session_factory, session_scope  # noqa: E402
from rollout_lens.server.domain.runconfig import RunConfig  # noqa: E402
from rollout_lens.server.migrate import upgrade  # noqa: E402
from rollout_lens.trainer.run import train  # noqa: E402

METHODS = ("none", "offpolicy", "hint", "interleaved_sft", "sft_then_rl")


def collapse_step(
    steps: list[int], acc: list[float | None], peak_at_least: float = 0.8, fall_below: float = 0.3
) -> int | None:
    """First step where the 25-step true accuracy falls below `fall_below` after reaching `peak_at_least`."""
    peaked = False
    for step, mean in zip(steps, analysis.rolling_mean(acc), strict=True):
        if mean is None:
            continue
        peaked = peaked or mean >= peak_at_least
        if peaked and mean < fall_below:
            return step
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--variant", default="patched", choices=["patched", "leaky"])
    args = parser.parse_args()
    thresholds = alerts.AlertThresholds()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        settings = get_settings(data_dir=Path(tmp))
        engine = make_engine(settings.database_url)
        upgrade(engine)
        factory = make_session_factory(engine)
        for method in args.methods:
            config = RunConfig(
                variant=args.variant,
                steps=args.steps,
                seed=args.seed,
                learning_rate=args.lr,
                supervision=method,
                eval_every=25,
                sft_steps=50 if method == "sft_then_rl" else 5,
            )
            started = time.perf_counter()
            run_id = train(config, settings=settings)
            wall = time.perf_counter() - started
            with session_scope(factory) as session:
                steps = store.steps(session, run_id=run_id)
                series = store.metric_series(session, run_id=run_id)
            numbers = [s.step for s in steps]
            acc = [s.true_accuracy for s in steps]
            fell = collapse_step(numbers, acc)
            all_series = dict(series)
            all_series["zero_std_share"] = [(s.step, s.zero_std_share) for s in steps]
            spikes = [
                a
                for a in alerts.evaluate(all_series, thresholds)
                if a.kind == "control_token_spike"
            ]
            first_spike = spikes[0] if spikes else None
            before = [a for a in spikes if fell is not None and a.step <= fell]
            lead = fell - before[0].step if before else None
            print(f"\n== {config.name} (lr {args.lr}), wall {wall:.0f} s")
            print(
                "25-step true accuracy:",
                " ".join(f"{v:.2f}" for _, v in analysis.buckets(numbers, acc)),
            )
            collapse_share = series.get("state/collapse", [])
            print(
                "25-step collapse share:",
                " ".join(
                    f"{v:.2f}"
                    for _, v in analysis.buckets(
                        [s for s, _ in collapse_share], [v for _, v in collapse_share]
                    )
                ),
            )
            print(
                f"collapsed at step: {fell}; first control-token spike: {first_spike.message if first_spike else None}; lead: {lead}"
            )
            final = {
                name: (series.get(f"eval/{name}") or [(0, None)])[-1][1]
                for name in ("id", "format_ood", "content_ood")
            }
            rows.append(
                (
                    method,
                    max((v for v in analysis.rolling_mean(acc) if v is not None), default=0.0),
                    analysis.final_mean(acc),
                    fell,
                    lead,
                    final,
                    wall,
                )
            )
    print(
        f"\n{'method':<16} {'peak acc25':>10} {'final acc25':>11} {'collapsed':>9} {'lead':>5} {'eval ID':>7} {'fmt-OOD':>7} {'cnt-OOD':>7} {'wall s':>6}"
    )
    for method, peak, final_acc, fell, lead, final, wall in rows:

        def f(v: float | None) -> str:
            return "-" if v is None else f"{v:.2f}"

        print(
            f"{method:<16} {peak:>10.2f} {f(final_acc):>11} {str(fell):>9} {str(lead):>5} {f(final['id']):>7} {f(final['format_ood']):>7} {f(final['content_ood']):>7} {wall:>6.0f}"
        )


if __name__ == "__main__":
    main()
