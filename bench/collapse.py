"""Control-token collapse on the CPU across seeds, whether it is caught early, and what prevents it.

Trains one recorded run per method and seed (same recipe otherwise) through the worker's own
`train()`, reads back what the dashboard shows (steps, series, the alerts the recorder wrote)
and prints:

* per run: the 25-step true and format-free accuracy, when it collapsed, the first
  control-token and collapse alerts;
* per method: seeds collapsed, median collapse step, the lead of the first control-token
  alert before the collapse, false warnings (control-token or collapse alerts on seeds that
  never collapsed, each alert episode counted), final true / format-free accuracy and the last
  greedy ID / format-OOD (single-turn) / content-OOD evaluation;
* per alert rule (kind and series): collapses it caught at or before the collapse step, the
  median lead, how often it first fired late, and on how many runs that never collapsed it
  fired (false runs).

`--save FILE` appends each run's readings to a JSON-lines file; `--load FILE` prints the tables
from such a file without training.

A run collapsed at the first step where its 25-step true accuracy falls below 0.3 after reaching
0.8, or where its 25-step share of structurally broken rollouts first exceeds 0.5: every rollout
that is not a healthy call (a collapsed call, text polluting a call such as a repeated closing
tag, or no call at all; for a tool-calling run, its worst turn's state).

    .venv/bin/python bench/collapse.py --lr 1e-3 --steps 300 --seeds 0          # single-turn
    .venv/bin/python bench/collapse.py --turns multi --seeds 0 1 2 3 4           # multi-turn
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rollout_lens.server import store  # noqa: E402
from rollout_lens.server.core import analysis, vocab  # noqa: E402
from rollout_lens.server.core.config import get_settings  # noqa: E402
from rollout_lens.server.core.runconfig import RunConfig  # noqa: E402
from rollout_lens.server.store.db import make_engine, make_session_factory, session_scope  # noqa: E402
from rollout_lens.server.store.migrate import upgrade  # noqa: E402
from rollout_lens.server.webapp import queries  # noqa: E402
from rollout_lens.trainer.worker.run import train  # noqa: E402

SINGLE_METHODS = ("none", "offpolicy", "hint", "interleaved_sft", "sft_then_rl")
# Multi-turn: plain GRPO at the study's rate; the SFT signals (expert conversations before RL,
# or every 10 RL steps 10 SFT steps on the episodes that failed: every 25 steps 5 held none of 5
# seeds); the same rate with TRL's KL penalty toward the starting model; and plain GRPO at a safe
# rate (healthy runs: where false alarms are counted). The in-group signals (off-policy experts,
# hints) are single-turn only.
MULTI_METHODS = ("none", "sft_then_rl", "interleaved_sft", "kl", "safe_lr")
WARNING_KINDS = ("control_token_spike", "collapse")


def collapse_step(
    steps: list[int], acc: list[float | None], peak_at_least: float = 0.8, fall_below: float = 0.3
) -> int | None:
    """First step where the 25-step true accuracy falls below `fall_below` after reaching
    `peak_at_least`."""
    peaked = False
    for step, mean in zip(steps, analysis.rolling_mean(acc), strict=True):
        if mean is None:
            continue
        peaked = peaked or mean >= peak_at_least
        if peaked and mean < fall_below:
            return step
    return None


def structural_collapse_step(
    healthy: list[tuple[int, float | None]], above: float = 0.5
) -> int | None:
    """First step where the 25-step mean share of broken rollouts (1 - healthy calls) exceeds
    `above`."""
    steps = [s for s, _ in healthy]
    broken = [None if v is None else 1.0 - v for _, v in healthy]
    for step, mean in zip(steps, analysis.rolling_mean(broken), strict=True):
        if mean is not None and mean > above:
            return step
    return None


def config_for(args: argparse.Namespace, method: str, seed: int) -> RunConfig:
    if args.turns == "multi":
        return RunConfig(
            turns="multi",
            variant=args.variant,
            steps=args.steps,
            seed=seed,
            learning_rate=args.safe_lr if method == "safe_lr" else args.lr,
            kl_coef=args.kl if method == "kl" else 0.0,
            supervision=method if method in ("sft_then_rl", "interleaved_sft") else "none",
            sft_steps=50 if method == "sft_then_rl" else args.sft_steps,
            sft_every=args.sft_every,
            max_completion_tokens=128,
            eval_every=25,
            name=f"multi-turn {method} seed {seed}",
        )
    return RunConfig(
        variant=args.variant,
        steps=args.steps,
        seed=seed,
        learning_rate=args.lr,
        supervision=method,
        eval_every=25,
        sft_steps=50 if method == "sft_then_rl" else 5,
    )


def read_run(factory: Any, run_id: int) -> dict[str, Any]:
    """What one recorded run says, as the dashboard reads it: curves, states, alerts, evals."""
    with session_scope(factory) as session:
        steps = store.steps(session, run_id=run_id)
        series = store.metric_series(session, run_id=run_id)
        alerts = queries.alerts(session, run_id=run_id)
    return {
        "steps": [s.step for s in steps],
        "acc": [s.true_accuracy for s in steps],
        "free": [v for _, v in series.get(vocab.FORMAT_FREE_ACCURACY, [])],
        "states": {
            state: series.get(vocab.state(state), [])
            for state in vocab.STATES
            if series.get(vocab.state(state))
        },
        "alerts": [a for a in alerts if a["kind"] in WARNING_KINDS],
        "eval": {
            name: (series.get(f"eval/{name}") or [(0, None)])[-1][1]
            for name in ("id", "format_ood", "content_ood")
        },
    }


def judge(raw: dict[str, Any]) -> dict[str, Any]:
    """Collapse step and cause, first control-token alert and its lead, final figures."""
    numbers, acc = raw["steps"], raw["acc"]
    by_accuracy = collapse_step(numbers, acc)
    by_structure = structural_collapse_step(
        [tuple(p) for p in raw["states"].get("healthy_call", [])]  # type: ignore[misc]
    )
    fell = min((s for s in (by_accuracy, by_structure) if s is not None), default=None)
    ctrl = [a for a in raw["alerts"] if a["kind"] == "control_token_spike"]
    lead = fell - ctrl[0]["step"] if fell is not None and ctrl and ctrl[0]["step"] <= fell else None
    return raw | {
        "fell": fell,
        "why": "accuracy" if fell is not None and fell == by_accuracy else "structure",
        "first_ctrl": ctrl[0] if ctrl else None,
        "lead": lead,
        "final_acc": analysis.final_mean(acc),
        "final_free": analysis.final_mean(raw["free"]) if raw["free"] else None,
    }


def print_run(m: dict[str, Any]) -> None:
    print(f"\n== {m['name']} (lr {m['lr']:g}), wall {m['wall']:.0f} s")
    print(
        "25-step true accuracy:  ",
        " ".join(f"{v:.2f}" for _, v in analysis.buckets(m["steps"], m["acc"])),
    )
    if m["free"]:
        free = analysis.buckets(m["steps"][: len(m["free"])], m["free"])
        print("25-step format-free acc:", " ".join(f"{v:.2f}" for _, v in free))
    for state, points in m["states"].items():
        share = analysis.buckets([s for s, _ in points], [v for _, v in points])
        label = f"25-step {vocab.state_label(state)}:"
        print(f"{label:<24}", " ".join(f"{v:.2f}" for _, v in share))
    first = m["first_ctrl"]
    print(
        f"collapsed at: {m['fell']} ({m['why'] if m['fell'] else '-'}); first "
        f"control-token alert: {first['step'] if first else None} "
        f"({first['series'] if first else ''}); lead: {m['lead']}; warnings: "
        f"{len(m['alerts'])}",
        flush=True,
    )


def f(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def train_all(
    args: argparse.Namespace, methods: list[str], results: dict[str, list[dict[str, Any]]]
) -> None:
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        save = stack.enter_context(Path(args.save).open("a")) if args.save else None
        settings = get_settings(data_dir=Path(tmp))
        engine = make_engine(settings.database_url)
        upgrade(engine)
        factory = make_session_factory(engine)
        for method in methods:
            for seed in args.seeds:
                config = config_for(args, method, seed)
                started = time.perf_counter()
                run_id = train(config, settings=settings)
                raw = read_run(factory, run_id) | {
                    "method": method,
                    "seed": seed,
                    "name": config.name,
                    "lr": config.learning_rate,
                    "wall": time.perf_counter() - started,
                }
                if save is not None:
                    save.write(json.dumps(raw) + "\n")
                    save.flush()
                m = judge(raw)
                results[method].append(m)
                print_run(m)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", default="single", choices=["single", "multi"])
    parser.add_argument("--lr", type=float, help="default: 1e-3 single-turn, 3e-3 multi-turn")
    parser.add_argument("--safe-lr", type=float, default=1e-3, help="multi-turn healthy arm")
    parser.add_argument("--kl", type=float, default=0.1, help="multi-turn KL arm's beta")
    parser.add_argument(
        "--sft-every", type=int, default=10, help="multi-turn interleaved SFT: RL steps between"
    )
    parser.add_argument(
        "--sft-steps", type=int, default=10, help="multi-turn interleaved SFT: steps per phase"
    )
    parser.add_argument("--steps", type=int, help="default: 300 single-turn, 200 multi-turn")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--methods", nargs="+")
    parser.add_argument("--variant", default="patched", choices=["patched", "leaky"])
    parser.add_argument("--save", help="append each run's readings to this JSON-lines file")
    parser.add_argument("--load", help="print the tables from a --save file, training nothing")
    args = parser.parse_args()
    multi = args.turns == "multi"
    args.lr = args.lr or (3e-3 if multi else 1e-3)
    args.steps = args.steps or (200 if multi else 300)
    methods = args.methods or list(MULTI_METHODS if multi else SINGLE_METHODS)
    results: dict[str, list[dict[str, Any]]] = defaultdict(list)
    if args.load:
        for line in Path(args.load).read_text().splitlines():
            m = judge(json.loads(line))
            results[m["method"]].append(m)
            print_run(m)
    else:
        train_all(args, methods, results)
    print(
        f"\nRuns read from {args.load} (each run's lr is in its heading)"
        if args.load
        else f"\nRecipe: {args.turns}-turn {args.variant}, {args.steps} steps, lr {args.lr:g}, "
        f"seeds {args.seeds}"
    )
    print(
        f"{'method':<16} {'collapsed':>9} {'median':>6} {'leads':>14} {'false warn':>10} "
        f"{'acc25':>5} {'free25':>6} {'ID':>5} {'fmt':>5} {'cnt':>5}"
    )
    for method, runs in results.items():
        fell = [r["fell"] for r in runs if r["fell"] is not None]
        leads = [r["lead"] for r in runs if r["fell"] is not None]
        false = sum(len(r["alerts"]) for r in runs if r["fell"] is None)
        final = statistics.mean(r["final_acc"] or 0.0 for r in runs)
        frees = [r["final_free"] for r in runs if r["final_free"] is not None]
        evals = {
            k: [r["eval"][k] for r in runs if r["eval"][k] is not None]
            for k in ("id", "format_ood", "content_ood")
        }
        print(
            f"{method:<16} {len(fell):>4}/{len(runs):<4} "
            f"{(statistics.median(fell) if fell else '-'):>6} "
            f"{','.join('-' if x is None else str(x) for x in leads) or '-':>14} {false:>10} "
            f"{final:>5.2f} {f(statistics.mean(frees) if frees else None):>6} "
            + " ".join(f"{f(statistics.mean(v) if v else None):>5}" for v in evals.values())
        )
    rules: dict[str, dict[str, list[int]]] = defaultdict(
        lambda: {"leads": [], "late": [], "false": []}
    )
    for runs in results.values():
        for r in runs:
            firsts: dict[str, int] = {}
            for a in r["alerts"]:
                firsts.setdefault(f"{a['kind']} {a['series'] or ''}".strip(), a["step"])
            for rule, step in firsts.items():
                if r["fell"] is None:
                    rules[rule]["false"].append(step)
                elif step <= r["fell"]:
                    rules[rule]["leads"].append(r["fell"] - step)
                else:
                    rules[rule]["late"].append(step - r["fell"])
    collapsed_runs = sum(r["fell"] is not None for runs in results.values() for r in runs)
    print(f"\nPer alert rule (over {collapsed_runs} collapsed runs):")
    print(f"{'rule':<52} {'caught':>6} {'median lead':>11} {'late':>4} {'false runs':>10}")
    for rule, got in sorted(rules.items()):
        lead = statistics.median(got["leads"]) if got["leads"] else None
        print(
            f"{rule:<52} {len(got['leads']):>6} {('-' if lead is None else f'{lead:g}'):>11} "
            f"{len(got['late']):>4} {len(got['false']):>10}"
        )


if __name__ == "__main__":
    main()
