"""The seed's task on a real pretrained chat model: SmolLM2-135M-Instruct on the Escalation env.

zero-shot: greedy replies to the env's training queries, as a launched run prompts them (the
model's chat template), patched (4 tools) and leaky (64): how many name the right tool
somewhere, how many are in the `<tool>ID</tool>` format, which tool the leaky ones name most.

grid: the recipe of the `real_patched` preset (server/core/presets.py) trained with each
supervisory signal (plain GRPO, the format warm-up, off-policy experts, SFT then RL as the
issue tried it), each seed, as launched runs in this process's children (one torch thread
each, `--jobs` at a time), every step's stage costs timed (bench/real_model_stages.py). Runs
go into `--data-dir`; `report` reads them back at any time, finished or not:

    .venv/bin/python bench/real_model.py zero-shot
    .venv/bin/python bench/real_model.py grid --data-dir D --seeds 0 1 --jobs 2   # hours on a CPU
    .venv/bin/python bench/real_model.py report --data-dir D --json docs/benchmarks/real-model.json

The report gives each run's true accuracy, format-valid share and zero-spread share per step
and in 5-step buckets; its first 5 steps against its last 10, against chance (1 in 4), and the
first step from which its 5-step mean stays above chance; and the median seconds of each stage.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rollout_lens.server.core.config import Settings, get_settings  # noqa: E402
from rollout_lens.trainer.envs.onestep import EscalationEnv  # noqa: E402

TAGGED = re.compile(r"<tool>\s*(tool_\d\d)\s*</tool>")
NAMED = re.compile(r"tool_\d\d")
QUERY = re.compile(r"Query: (.*)\n")
CHANCE = 0.25  # 1 of the 4 tools a patched prompt lists
FIRST, LAST, BUCKET = 5, 10, 5
# The signals compared, as overrides of the real_patched preset. sft_then_rl as the issue ran it:
# 20 SFT steps on the training queries' own answers at the pretrained default SFT rate.
METHODS: dict[str, dict[str, Any]] = {
    "none": {"supervision": "none"},
    "format_warmup": {},  # the preset's own
    "offpolicy": {"supervision": "offpolicy", "supervised_per_group": 1},
    "sft_then_rl": {"supervision": "sft_then_rl", "sft_steps": 20, "sft_learning_rate": 1e-5},
}


def zero_shot(path: Path, variant: str, max_new_tokens: int) -> dict[str, object]:
    """Greedy replies to the training queries of `variant`, as a launched run prompts them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    env = EscalationEnv(seed=0, variant=variant)
    right = tagged = 0
    named: collections.Counter[str] = collections.Counter()
    started = time.perf_counter()
    for query in env.train_queries:
        example = env.example(query)
        inputs = tokenizer.apply_chat_template(
            [{"role": "user", "content": example.prompt}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )
        with torch.no_grad():
            out = model.generate(
                **inputs,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
            )
        reply = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        right += example.target in reply
        tagged += bool(TAGGED.search(reply))
        named.update(set(NAMED.findall(reply)))
    return {
        "queries": len(env.train_queries),
        "right": right,
        "tagged": tagged,
        "most_named": named.most_common(1)[0] if named else None,
        "seconds": time.perf_counter() - started,
    }


def configs(preset: str, method: str, seed: int, steps: int) -> list[Any]:
    """The preset's runs with `method`'s overrides, validated as a launch is."""
    from rollout_lens.server.core.presets import PRESETS
    from rollout_lens.server.webapp.pages import launch_fields

    values = METHODS[method] | {"seed": seed, "steps": steps}
    built = launch_fields.build_configs(PRESETS[preset], values)
    return [c.model_copy(update={"name": f"{c.name} [{method}]"}) for c in built]


def settings_for(data_dir: Path) -> Settings:
    return Settings(data_dir=data_dir, model_cache_dir=get_settings().models_dir, torch_threads=1)


def train_one(args: argparse.Namespace) -> None:
    """One launched run (the config's JSON), trained here with its stages timed."""
    from rollout_lens.server.core.runconfig import RunConfig
    from rollout_lens.trainer.worker import run

    from bench.real_model_stages import StageTimer
    from rollout_lens.cli import migrated_factory

    config = RunConfig.model_validate_json(args.config)
    settings = settings_for(args.data_dir)
    engine, _ = migrated_factory(settings)
    engine.dispose()
    original = run.make_trainer

    def timed(*a: Any, **k: Any) -> Any:
        trainer = original(*a, **k)
        StageTimer(trainer, args.timings).install(k["callback"])
        return trainer

    run.make_trainer = timed  # this process only: the bench's timers around the trainer's stages
    run_id = run.train(config, settings=settings)
    print(f"run {run_id} done", flush=True)


def grid(args: argparse.Namespace) -> None:
    """Every (method, seed) run of the preset, `--jobs` children at a time."""
    logs = args.data_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    queue = [
        (method, seed, config)
        for seed in args.seeds
        for method in args.methods
        for config in configs(args.preset, method, seed, args.steps)
        if args.variants is None or config.variant in args.variants
    ]
    running: list[subprocess.Popen[bytes]] = []
    env = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    while queue or running:
        running = [p for p in running if p.poll() is None]
        while queue and len(running) < args.jobs:
            method, seed, config = queue.pop(0)
            stem = f"{config.variant}-{method}-seed{seed}"
            command = [
                sys.executable,
                __file__,
                "one",
                "--data-dir",
                str(args.data_dir),
                "--timings",
                str(logs / f"{stem}.jsonl"),
                "--config",
                config.model_dump_json(),
            ]
            with (logs / f"{stem}.log").open("ab") as log:
                running.append(subprocess.Popen(command, stdout=log, stderr=log, env=env))
            print(f"started {stem}", flush=True)
        time.sleep(5)


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _above_from(values: list[float]) -> int | None:
    """The first step from which every 5-step mean stays above chance."""
    means = [statistics.fmean(values[i : i + BUCKET]) for i in range(len(values) - BUCKET + 1)]
    for start in range(len(means)):
        if all(m > CHANCE for m in means[start:]):
            return start + 1
    return None


def _groups(rollouts: Any) -> list[dict[str, Any]]:
    """Each recorded group: its step, query, target, the ids its rollouts voted and its mean
    true score (a query's history across the run, and the vote splits)."""
    groups: dict[tuple[int, int], dict[str, Any]] = {}
    for row, prompt in rollouts:
        found = QUERY.search(prompt)
        group = groups.setdefault(
            (row.step, row.group),
            {
                "step": row.step,
                "query": found.group(1) if found else None,
                "target": row.target,
                "votes": [],
                "scores": [],
            },
        )
        group["votes"].append(row.vote)
        group["scores"].append(row.true_score or 0.0)
    return [g | {"true": statistics.fmean(g.pop("scores"))} for _, g in sorted(groups.items())]


def per_query(run: dict[str, Any]) -> dict[str, list[float]]:
    """Each query's mean true score at each of its visits, in order."""
    visits: dict[str, list[float]] = {}
    for group in run["groups"]:
        visits.setdefault(group["query"], []).append(group["true"])
    return visits


def read_runs(data_dir: Path) -> list[dict[str, Any]]:
    """Every run in `data_dir`'s database with its per-step curves and stage costs."""
    from rollout_lens.server import store
    from rollout_lens.server.store.db import make_engine, make_session_factory, session_scope

    from bench import real_model_stages

    settings = settings_for(data_dir)
    engine = make_engine(settings.database_url)
    out = []
    with session_scope(make_session_factory(engine)) as session:
        for run in sorted(store.list_runs(session), key=lambda r: r.id):
            config = dict(run.config or {})
            method = re.search(r"\[(\w+)\]$", run.name)
            rows = store.steps(session, run_id=run.id)
            stem = f"{config.get('variant')}-{method.group(1) if method else '?'}"
            timings = data_dir / "logs" / f"{stem}-seed{run.seed}.jsonl"
            stages, phases = real_model_stages.read(timings)
            out.append(
                {
                    "run_id": run.id,
                    "name": run.name,
                    "method": method.group(1) if method else None,
                    "variant": config.get("variant"),
                    "seed": run.seed,
                    "status": str(run.status.value if hasattr(run.status, "value") else run.status),
                    "steps": [s.step for s in rows],
                    "true_accuracy": [s.true_accuracy for s in rows],
                    "format_valid": [s.format_valid_rate for s in rows],
                    "zero_spread": [s.zero_std_share for s in rows],
                    "reward": [s.reward_mean for s in rows],
                    "wall": [s.wall_time for s in rows],
                    "stages": stages,
                    "sft": phases,
                    "device_minutes": run.device_seconds / 60.0,
                    "groups": _groups(store.iter_rollouts(session, run_id=run.id)),
                }
            )
    engine.dispose()
    return out


def summary(run: dict[str, Any]) -> dict[str, Any]:
    """What the docs' table says of a run: first 5 and last 10 steps, against chance."""
    acc = [a for a in run["true_accuracy"] if a is not None]
    first, last = _mean(acc[:FIRST]), _mean(acc[-LAST:]) if len(acc) >= FIRST + LAST else None
    stage_medians = {
        stage: statistics.median(s[stage] for s in run["stages"])
        for stage in ("wall", "generation", "scoring", "loss", "backward", "recording", "other")
        if run["stages"]
    }
    return {
        "steps": len(acc),
        "first5": first,
        "last10": last,
        "format_first5": _mean([f for f in run["format_valid"][:FIRST] if f is not None]),
        "format_last10": _mean([f for f in run["format_valid"][-LAST:] if f is not None])
        if len(acc) >= FIRST + LAST
        else None,
        "zero_spread_mean": _mean([z for z in run["zero_spread"] if z is not None]),
        "above_chance_from": _above_from(acc),
        "learns": first is not None
        and last is not None
        and first <= 0.5
        and last > CHANCE
        and last >= first + 0.15,
        "stage_medians": stage_medians,
        "sft_seconds": sum(p["sft_seconds"] for p in run["sft"]),
    }


def _pick(runs: list[dict[str, Any]], method: str, seed: int, variant: str) -> dict[str, Any]:
    (run,) = [
        r
        for r in runs
        if (r["method"], r["seed"], r["variant"]) == (method, seed, variant) and r["steps"]
    ]
    return run


def preset_figures(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures the real presets' texts state (server.core.presets.REAL_FIGURES), from the
    recorded runs: the format warm-up and plain GRPO on the patched task, seed 0."""
    warm, plain = _pick(runs, "format_warmup", 0, "patched"), _pick(runs, "none", 0, "patched")
    w, p = summary(warm), summary(plain)
    group = len(warm["groups"][0]["votes"])
    return {
        "warmup_steps": w["steps"],
        "warmup_format_first5": round(w["format_first5"], 2),
        "warmup_first5": round(w["first5"], 2),
        "warmup_last10": round(w["last10"], 2),
        "warmup_step_seconds": round(w["stage_medians"]["wall"]),
        "warmup_sft_minutes": round(w["sft_seconds"] / 60),
        "plain_steps": p["steps"],
        "plain_formatted": round(sum(f * group for f in plain["format_valid"] if f is not None)),
        "plain_rollouts": group * p["steps"],
    }


def _series(values: list[float | None]) -> str:
    return " ".join("  — " if v is None else f"{v:.2f}" for v in values)


def _buckets(values: list[float | None]) -> list[float | None]:
    kept = [v for v in values]
    return [
        _mean([v for v in kept[i : i + BUCKET] if v is not None])
        for i in range(0, len(kept), BUCKET)
    ]


def _cell(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def markdown(runs: list[dict[str, Any]]) -> str:
    """The docs' tables: each run's summary, then its curves in 5-step buckets."""
    lines = [
        "| run | method | seed | RL steps | true acc. 1–5 | last 10 | above chance from step |"
        " format-valid 1–5 | last 10 | zero-spread share | median s/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        got = run["summary"]
        wall = got["stage_medians"].get("wall")
        lines.append(
            f"| {run['run_id']} | {run['method']} | {run['seed']} | {got['steps']} |"
            f" {_cell(got['first5'])} | {_cell(got['last10'])} |"
            f" {got['above_chance_from'] or 'never'} | {_cell(got['format_first5'])} |"
            f" {_cell(got['format_last10'])} | {_cell(got['zero_spread_mean'])} |"
            f" {'—' if wall is None else f'{wall:.0f}'} |"
        )
    width = max((len(_buckets(r["true_accuracy"])) for r in runs), default=0)
    heads = " | ".join(f"{i * BUCKET + 1}–{(i + 1) * BUCKET}" for i in range(width))
    lines += ["", f"| run | series | {heads} |", "|---|---|" + "---|" * width]
    for run in runs:
        for label, key in (
            ("true accuracy", "true_accuracy"),
            ("format-valid", "format_valid"),
            ("zero spread", "zero_spread"),
        ):
            cells = " | ".join(_cell(v) for v in _buckets(run[key]))
            lines.append(f"| {run['run_id']} {run['method']} s{run['seed']} | {label} | {cells} |")
    return "\n".join(lines)


def report(args: argparse.Namespace) -> None:
    runs = read_runs(args.data_dir)
    for run in runs:
        run["summary"] = got = summary(run)
        print(
            f"\nrun {run['run_id']} {run['name']} ({run['status']}, {got['steps']} steps,"
            f" {run['device_minutes']:.1f} device-minutes)"
        )
        for label, key in (
            ("true accuracy", "true_accuracy"),
            ("format-valid ", "format_valid"),
            ("zero spread  ", "zero_spread"),
        ):
            print(f"  {label} per step  : {_series(run[key])}")
            print(f"  {label} 5-step    : {_series(_buckets(run[key]))}")
        visits = ", ".join(
            f"{q!r} {' '.join(f'{v:.2f}' for v in vs)}" for q, vs in per_query(run).items()
        )
        print(f"  each query's visits (mean true score): {visits}")
        figures = {k: v for k, v in got.items() if k != "stage_medians"}
        print(f"  summary: {figures}")
        if got["stage_medians"]:
            stages = ", ".join(f"{k} {v:.1f}" for k, v in got["stage_medians"].items())
            print(f"  median seconds a step: {stages}; SFT before RL {got['sft_seconds']:.0f} s")
    if args.markdown:
        print("\n" + markdown(runs))
        print(f"\nthe presets' figures: {preset_figures(runs)}")
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1) + "\n")
        print(f"\nwrote {args.json}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    shot = sub.add_parser("zero-shot", help="greedy replies of the untrained model")
    shot.add_argument("--variants", nargs="+", default=["patched", "leaky"])
    shot.add_argument("--max-new-tokens", type=int, default=48)
    run_grid = sub.add_parser("grid", help="train every method and seed of a preset")
    run_grid.add_argument("--data-dir", type=Path, required=True)
    run_grid.add_argument("--preset", default="real_patched")
    run_grid.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    run_grid.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    run_grid.add_argument("--steps", type=int, default=40)
    run_grid.add_argument("--jobs", type=int, default=2)
    run_grid.add_argument("--variants", nargs="+", help="only these of the preset's runs")
    one = sub.add_parser("one", help="(grid's child) train one run")
    one.add_argument("--data-dir", type=Path, required=True)
    one.add_argument("--timings", type=Path, required=True)
    one.add_argument("--config", required=True)
    read = sub.add_parser("report", help="the runs in a data dir, as curves and a summary")
    read.add_argument("--data-dir", type=Path, required=True)
    read.add_argument("--json", type=Path, help="also write every run's curves here")
    read.add_argument("--markdown", action="store_true", help="also print the docs' tables")
    args = parser.parse_args(argv)
    if args.command == "zero-shot":
        from rollout_lens.trainer.builders import pretrained

        path = pretrained.ensure(get_settings().models_dir)
        for variant in args.variants:
            found = zero_shot(path, variant, args.max_new_tokens)
            print(
                f"zero-shot {variant:<8}: right tool named {found['right']}/{found['queries']},"
                f" <tool>ID</tool> format {found['tagged']}/{found['queries']},"
                f" most named {found['most_named']}, {found['seconds']:.0f} s"
            )
    elif args.command == "grid":
        grid(args)
    elif args.command == "one":
        train_one(args)
    else:
        report(args)


if __name__ == "__main__":
    main()
