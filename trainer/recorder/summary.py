"""A step's numbers: what TRL logged, and what the step's rollouts say (pure: lists in, dicts out)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from rollout_lens.server.core import vocab
from rollout_lens.server.core.records import RolloutRecord
from rollout_lens.trainer.recorder import metrics as m
from rollout_lens.trainer.recorder import positional, turns

# TRL log keys that have a column of their own on the steps table.
_LOG_COLUMNS = {
    "loss": "loss",
    "kl": "kl",
    "entropy": "entropy",
    "grad_norm": "grad_norm",
    "learning_rate": "learning_rate",
}
# Logged numbers that are not a step's series (the end-of-training summary, counters).
_NOT_SERIES = {"epoch", "step", "total_flos"}


def split_logs(logs: dict[str, Any]) -> tuple[dict[str, float], dict[str, float]]:
    """A step's TRL logs as (step columns, other series named `trl/<key>`)."""
    columns: dict[str, float] = {}
    series: dict[str, float] = {}
    for key, value in logs.items():
        if not isinstance(value, int | float) or isinstance(value, bool):
            continue
        if key in _LOG_COLUMNS:
            columns[_LOG_COLUMNS[key]] = float(value)
        elif key not in _NOT_SERIES and not key.startswith("train_"):
            series[vocab.trl(key)] = float(value)
    return columns, series


def summarize(
    rollouts: Sequence[RolloutRecord],
    group_size: int,
    control_tokens: Sequence[str],
    top_reward: float = 1.0,
) -> tuple[dict[str, float | None], dict[str, float | None]]:
    """Per-step values and extra series computed from the rollouts of one generation
    (`top_reward`: the verifier's best reward, what a solved group's rollouts all got)."""
    grouped = m.groups(rollouts, group_size)
    scored = [r.true_score for r in rollouts if r.true_score is not None]
    values: dict[str, float | None] = {
        "reward_mean": m.mean([r.verifier_reward for r in rollouts]),
        "true_accuracy": m.mean(scored),
        # unknown (no function judged it) is neither valid nor invalid
        "format_valid_rate": m.mean(
            [float(r.format_valid) for r in rollouts if r.format_valid is not None]
        ),
        "vote_agreement": m.mean([m.vote_agreement([r.vote for r in g]) for g in grouped]),
        "vote_entropy": m.mean([m.vote_entropy([r.vote for r in g]) for g in grouped]),
        "zero_std_share": m.mean(
            [float(m.is_zero_std([r.verifier_reward for r in g])) for g in grouped]
        ),
        "completion_length": m.mean([float(len(r.completion_ids)) for r in rollouts]),
    }
    spread = [m.no_spread([r.verifier_reward for r in g], top_reward) for g in grouped]
    series: dict[str, float | None] = {
        vocab.SOLVED_GROUPS: m.mean([float(s == "solved") for s in spread]),
        vocab.STUCK_GROUPS: m.mean([float(s == "stuck") for s in spread]),
    }
    series.update(_control_series(rollouts, control_tokens))
    states = [r.format_state for r in rollouts if r.format_state]
    for state in sorted({*vocab.FormatState, *states}):
        series[vocab.state(state)] = states.count(state) / len(states) if states else None
    series.update(
        positional.aggregate(
            [r.meta.get("probes", {}) for r in rollouts],
            [r.verifier_reward >= 0.5 for r in rollouts],
            [bool(r.meta.get("supervised")) for r in rollouts],
        )
    )
    lenient = [r.meta[vocab.FORMAT_FREE_KEY] for r in rollouts if vocab.FORMAT_FREE_KEY in r.meta]
    if lenient:
        series[vocab.FORMAT_FREE_ACCURACY] = m.mean([float(x) for x in lenient])
    series.update(turns.step_series(rollouts))
    listed = [x for r in rollouts if (x := _column(r, "target_listed")) is not None]
    if listed:
        series[vocab.RETRIEVAL_RECALL] = m.mean([float(x) for x in listed])
    return values, series


def _control_series(
    rollouts: Sequence[RolloutRecord], control_tokens: Sequence[str]
) -> dict[str, float | None]:
    """Each control token's mean and max probability over the positions the model sampled
    (tool-calling rollouts: only the positions the model sampled; tool results hold 0.0): one
    numpy pass a token over the step's columns, not a Python float a position."""
    columns: dict[str, list[np.ndarray]] = {token: [] for token in control_tokens}
    for r in rollouts:
        probs = r.control_probs
        array = probs.array
        keep = turns.model_positions(r.meta, len(r.completion_ids))
        if keep is not None:
            n = min(len(array), len(keep))
            array = array[:n][keep[:n]]
        for token in control_tokens:
            if token in probs.tokens:
                columns[token].append(array[:, probs.tokens.index(token)])
    series: dict[str, float | None] = {}
    for token in control_tokens:
        values = np.concatenate(columns[token]) if columns[token] else np.zeros(0)
        series[vocab.ctrl(token, "mean")] = float(values.mean()) if len(values) else None
        series[vocab.ctrl(token, "max")] = float(values.max()) if len(values) else None
    return series


def _column(r: RolloutRecord, name: str) -> Any:
    """A dataset column of the rollout's row (kept under meta["row"]; at the top of meta in runs
    recorded before one recorder)."""
    row = r.meta.get("row")
    if isinstance(row, dict) and name in row:
        return row[name]
    return r.meta.get(name)
