"""bench/real_model.py's report: the recorded runs read back from the store, summarised as the
docs' tables and the real presets' figures (tests/unit/test_real_figures.py reads them)."""

from __future__ import annotations

import re
import statistics
from pathlib import Path
from typing import Any

from rollout_lens.server.core.config import Settings, get_settings

QUERY = re.compile(r"Query: (.*)\n")
CHANCE = 0.25  # 1 of the 4 tools a patched prompt lists
FIRST, LAST, BUCKET = 5, 10, 5


def settings_for(data_dir: Path) -> Settings:
    return Settings(data_dir=data_dir, model_cache_dir=get_settings().models_dir, torch_threads=1)


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
                "policy": [],
            },
        )
        group["votes"].append(row.vote)
        group["scores"].append(row.true_score or 0.0)
        if row.meta.get("supervised") is None:  # not an expert's reply, not hinted
            group["policy"].append(row.true_score or 0.0)
    return [g | {"true": statistics.fmean(g.pop("scores"))} for _, g in sorted(groups.items())]


def _policy_accuracy(steps: list[int], groups: list[dict[str, Any]]) -> list[float | None]:
    """Each step's true accuracy over the policy's own rollouts: offpolicy's expert replies
    (right by construction) and hinted rollouts left out; the step's figure where none is."""
    scores: dict[int, list[float]] = {}
    for group in groups:
        scores.setdefault(group["step"], []).extend(group["policy"])
    return [statistics.fmean(scores[s]) if scores.get(s) else None for s in steps]


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
            method = re.search(r"\[(\w+)\](?: \(\d+\))?$", run.name)  # " (2)": a name taken
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
            out[-1]["policy_accuracy"] = _policy_accuracy(out[-1]["steps"], out[-1]["groups"])
    engine.dispose()
    return out


def summary(run: dict[str, Any]) -> dict[str, Any]:
    """What the docs' table says of a run: first 5 and last 10 steps, against chance."""
    # the policy's own rollouts (an expert's reply is right by construction); runs read before
    # the series was kept have true accuracy alone
    acc = [a for a in run.get("policy_accuracy", run["true_accuracy"]) if a is not None]
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
    } | _leaky_figures(runs)


def _leaky_figures(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The leaky side of the pair (the format warm-up, seed 0): its accuracy, its cost, and how
    many of its rollouts named the right tool at all."""
    leaky = _pick(runs, "format_warmup", 0, "leaky")
    got = summary(leaky)
    right = sum(v == g["target"] for g in leaky["groups"] for v in g["votes"])
    return {
        "leaky_steps": got["steps"],
        "leaky_first5": round(got["first5"], 2),
        "leaky_last10": round(got["last10"], 2),
        "leaky_right": right,
        "leaky_rollouts": sum(len(g["votes"]) for g in leaky["groups"]),
        "leaky_step_seconds": round(got["stage_medians"]["wall"]),
        "leaky_sft_minutes": round(got["sft_seconds"] / 60),
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
        "| run | variant | method | seed | RL steps | true acc. 1–5 | last 10 |"
        " above chance from step | format-valid 1–5 | last 10 | zero-spread share |"
        " median s/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        got = run["summary"]
        wall = got["stage_medians"].get("wall")
        lines.append(
            f"| {run['run_id']} | {run['variant']} | {run['method']} | {run['seed']} |"
            f" {got['steps']} |"
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
            ("true accuracy", "policy_accuracy" if "policy_accuracy" in run else "true_accuracy"),
            ("format-valid", "format_valid"),
            ("zero spread", "zero_spread"),
        ):
            cells = " | ".join(_cell(v) for v in _buckets(run[key]))
            name = f"{run['run_id']} {run['variant']} {run['method']} s{run['seed']}"
            lines.append(f"| {name} | {label} | {cells} |")
    return "\n".join(lines)
