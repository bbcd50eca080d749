"""Rows of a trainer's own dump files (TRL's completions, verl's rollout dumps) as rollouts: groups
by runs of identical prompts, plain JSON values, and the step values such rows allow."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from typing import Any

from rollout_lens.server.core.errors import InvalidInput
from rollout_lens.server.core.records import NO_FLOATS, NO_IDS, ControlProbs, RolloutRecord
from rollout_lens.server.core.vocab import MAX_SERIES_PER_RUN
from rollout_lens.server.exchange import bounds

BLANK: Any = object()  # what json_line gives for a blank line (a line may hold `null`)


def json_line(raw: bytes, where: str) -> Any:
    """One line of a JSON Lines file decoded (BLANK for a blank line); a line that is not UTF-8,
    not JSON or nested too deep (server.exchange.bounds) is refused naming `where`."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidInput(f"{where}: not UTF-8 text ({exc.reason})") from exc
    if not text.strip():
        return BLANK
    try:
        return bounds.loads(text, where)
    except json.JSONDecodeError as exc:
        raise InvalidInput(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from exc


def dump_line(
    row: Any, required: Sequence[str], where: str, *, what: str, hint: str
) -> dict[str, Any]:
    """A dump's line as its JSON object, with every `required` key; InvalidInput naming the line
    (`what` the format's line, `hint` what its lines hold) otherwise."""
    if not isinstance(row, dict):
        raise InvalidInput(f"{where}: a JSON {type(row).__name__}, not {what}")
    missing = [k for k in required if k not in row]
    if missing:
        raise InvalidInput(f"{where}: no {', '.join(missing)}: not {what} ({hint})")
    return row


class SeriesNames:
    """The generic series names an import has brought so far: past MAX_SERIES_PER_RUN the step
    that brings one more is refused (the caller names its file and line), before it is written."""

    def __init__(self, known: Iterable[str] = ()) -> None:
        self.names = set(known)

    def add(self, metrics: Iterable[str]) -> None:
        new = [name for name in metrics if name not in self.names]
        if len(self.names) + len(new) > MAX_SERIES_PER_RUN:
            raise InvalidInput(
                f"this step brings the run to {len(self.names) + len(new):,} series names "
                f"({new[0][:60]!r}, …); a run holds at most {MAX_SERIES_PER_RUN:,}"
            )
        self.names.update(new)


def text_rollout(**fields: Any) -> RolloutRecord:
    """A rollout known only as text: no token ids (the token-level fields empty), so its Σ
    logprob is unknown (NaN: stored NULL, shown as a dash), not the 0 of an empty sum; the
    format unchecked."""
    return RolloutRecord(
        completion_ids=NO_IDS,
        token_logprobs=NO_FLOATS,
        control_probs=ControlProbs.of(None, 0),
        vote=None,
        format_valid=True,
        format_state="unchecked",
        given_sum_logprob=math.nan,
        **fields,
    )


def keys(prompts: Iterable[Any]) -> list[str]:
    """Prompts as comparable text (a conversational prompt is a list of messages)."""
    return [p if isinstance(p, str) else json.dumps(p, sort_keys=True) for p in prompts]


def run_lengths(keys: list[str]) -> list[int]:
    """Lengths of the runs of identical consecutive keys."""
    lengths: list[int] = []
    for i, key in enumerate(keys):
        if i and key == keys[i - 1]:
            lengths[-1] += 1
        else:
            lengths.append(1)
    return lengths


def detect_group_size(lengths: list[int], where: str, size_name: str, option: str) -> int:
    """The group size: the common divisor of every run of identical prompts (a prompt drawn twice
    in a row makes a run of 2G, not a different G)."""
    size = math.gcd(*lengths) if lengths else 0
    if size < 2:
        raise InvalidInput(
            f"{where}: cannot tell {size_name} from the files (runs of identical prompts of "
            f"lengths {sorted(set(lengths))[:8]}); pass {option}"
        )
    return size


def positions(
    keys: list[str], group_size: int, where: str, noun: str, size_name: str
) -> list[tuple[int, int]]:
    """(group, index in group) of each row: runs of identical prompts cut into groups of
    `group_size`; InvalidInput naming the rows of a run that is not a multiple of it."""
    out: list[tuple[int, int]] = []
    start = 0
    group = 0
    for length in run_lengths(keys):
        if length % group_size:
            raise InvalidInput(
                f"{where}: {noun} {start + 1}-{start + length} repeat one prompt {length} times, "
                f"not a multiple of {size_name} {group_size}"
            )
        for offset in range(length):
            out.append((group + offset // group_size, offset % group_size))
        group += length // group_size
        start += length
    return out


def number(value: Any) -> float | None:
    """A value as a finite float (a bool as 0 or 1), or None."""
    if isinstance(value, int | float) and math.isfinite(value):
        return float(value)
    return None


def plain(value: Any) -> Any:
    """A value JSON can hold in any database (non-finite floats become None)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if value is None or isinstance(value, str | int | bool):
        return value
    return str(value)


def mean(values: Iterable[float | None]) -> float | None:
    """The mean of the values that are there, or None."""
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def step_values(records: Sequence[RolloutRecord], group_size: int) -> dict[str, float | None]:
    """The step columns such rows allow: mean reward, true accuracy where true scores are known,
    and the share of groups whose rollouts all got one reward."""
    rewards = [r.verifier_reward for r in records]
    groups = [rewards[i : i + group_size] for i in range(0, len(rewards), group_size)]
    return {
        "reward_mean": mean(rewards),
        "true_accuracy": mean(r.true_score for r in records),
        "zero_std_share": sum(len(set(g)) == 1 for g in groups) / len(groups) if groups else None,
    }
