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
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rollout_lens.server.core.config import get_settings  # noqa: E402
from rollout_lens.trainer.envs.onestep import EscalationEnv  # noqa: E402

from bench.real_model_report import (  # noqa: E402
    _buckets,
    _series,
    markdown,
    per_query,
    preset_figures,
    read_runs,
    settings_for,
    summary,
)

TAGGED = re.compile(r"<tool>\s*(tool_\d\d)\s*</tool>")
NAMED = re.compile(r"tool_\d\d")
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


def train_one(args: argparse.Namespace) -> None:
    """One launched run (the config's JSON), trained here with its stages timed."""
    from rollout_lens.server.core.runconfig import RunConfig
    from rollout_lens.trainer.worker import run

    from bench.real_model_stages import StageTimer

    config = RunConfig.model_validate_json(args.config)
    settings = settings_for(args.data_dir)  # migrated by the grid before it started this child
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
    from rollout_lens.cli.base import migrated_factory

    # the database migrated once, here: children migrating one new SQLite file at once race
    engine, _ = migrated_factory(settings_for(args.data_dir))
    engine.dispose()
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
            ("  the policy's", "policy_accuracy"),  # offpolicy's expert replies left out
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
