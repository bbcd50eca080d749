"""Import what TRL's GRPOTrainer already wrote: `completions/completions_NNNNN.parquet` files.

With `log_completions=True`, TRL writes at each logging step one file of its last generation
batch: columns `step`, `prompt`, `completion`, one column per reward function (named after it),
any `log_extra` columns, and `advantage`. Each file becomes a step; rows are grouped by runs of
identical consecutive prompts (TRL generates a prompt's `num_generations` completions side by
side). There are no token ids, logprobs or control-token probabilities in those files.
server/exchange/dump_import.py imports a folder in one go; server/exchange/follow.py follows it while TRL writes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_lens.server.core.errors import InvalidInput
from rollout_lens.server.core.records import RolloutRecord, StepRecord
from rollout_lens.server.exchange.dump_files import (
    DumpFile,
    Incomplete,
    Unit,
    numbered,
)
from rollout_lens.server.exchange.dump_import import RunPlan
from rollout_lens.server.exchange.dump_rows import (
    detect_group_size,
    keys,
    number,
    plain,
    positions,
    run_lengths,
    step_values,
    text_rollout,
)
from rollout_lens.server.store.models import RunRow, RunSource

REQUIRED = ("step", "prompt", "completion", "advantage")
TOTAL = "reward"  # a column with this name is taken as the total reward, not a component
FILE_NAME = re.compile(r"^completions_(\d+)\.parquet$")


@dataclass
class _TrlFileShape:
    """What planning needs of a file: its prompts' run lengths and its other columns."""

    lengths: list[int]
    numeric: dict[str, bool]  # every column beyond the required ones → is it a number


class TrlDump:
    """A TRL output_dir's completions files, read file by file."""

    source = RunSource.trl_import
    folder_key = "trl_output_dir"

    def __init__(
        self,
        output_dir: Path,
        *,
        name: str | None = None,
        num_generations: int | None = None,
        model: str = "unknown",
        reward_columns: Sequence[str] | None = None,
    ) -> None:
        if num_generations is not None and num_generations < 1:
            raise InvalidInput(f"num_generations must be at least 1, not {num_generations}")
        self.folder = output_dir
        self.name = name
        self.num_generations = num_generations
        self.model = model
        self.reward_columns = list(reward_columns) if reward_columns is not None else None
        self.rewards: list[str] = []
        self.extras: list[str] = []
        self.empty = (
            f"{output_dir}: no completions/completions_NNNNN.parquet files (GRPOTrainer writes "
            "them with log_completions=True)"
        )

    def scan(self) -> list[DumpFile]:
        """The completions files of the output directory (or of its completions/ folder)."""
        nested = self.folder / "completions"
        return numbered(nested if nested.is_dir() else self.folder, FILE_NAME, root=self.folder)

    def check(self, unit: Unit) -> _TrlFileShape:
        path = unit.files[0].path
        schema = _read(path, schema_only=True)
        missing = [c for c in REQUIRED if c not in schema.names]
        if missing:
            raise InvalidInput(
                f"{path}: no column {', '.join(missing)} (TRL writes {', '.join(REQUIRED)})"
            )
        numeric = {f.name: _is_number(f.type) for f in schema if f.name not in REQUIRED}
        prompts = _read(path, columns=["prompt"]).column("prompt").to_pylist()
        return _TrlFileShape(run_lengths(keys(prompts)), numeric)

    def wants_more(self, unit: Unit) -> bool:
        return False

    def plan(self, checked: Sequence[Any]) -> RunPlan:
        numeric: dict[str, bool] = {}
        for c in checked:
            for column, is_number in c.numeric.items():
                numeric.setdefault(column, is_number)
        lengths = [n for c in checked for n in c.lengths]
        detected = self.num_generations is None
        group_size = self.num_generations or detect_group_size(
            lengths, str(self.folder), "num_generations", "--num-generations"
        )
        self.num_generations = group_size
        self.rewards, self.extras = _split_columns(numeric, self.reward_columns)
        components = [c for c in self.rewards if c != TOTAL]
        notes = [
            f"imported from TRL's completions files in {self.folder}: only the steps TRL logged, "
            "each with its last generation batch",
            "no token ids, logprobs or control-token probabilities (TRL does not write them)",
        ]
        if detected:
            notes.append(f"num_generations {group_size}: detected from runs of identical prompts")
        return RunPlan(
            name=self.name or f"TRL {self.folder.resolve().name}",
            model=self.model,
            group_size=group_size,
            config={
                self.folder_key: str(self.folder.resolve()),
                "num_generations": group_size,
                "reward_columns": self.rewards,
                "extra_columns": self.extras,
                "verifier_reward": TOTAL
                if TOTAL in self.rewards
                else f"sum of {', '.join(components)}",
                "judged": {"vote": False, "true_score": False, "format_valid": False},
            },
            notes=notes,
        )

    def adopt(self, run: RunRow) -> None:
        config = run.config or {}
        stored_n = config.get("num_generations") or run.group_size
        rewards = list(config.get("reward_columns") or [])
        if self.num_generations is not None and self.num_generations != stored_n:
            raise InvalidInput(
                f"run {run.id} ({run.name}) follows {self.folder} with --num-generations "
                f"{stored_n}, not {self.num_generations}: leave it out to resume that run"
            )
        if self.reward_columns is not None and self.reward_columns != rewards:
            raise InvalidInput(
                f"run {run.id} ({run.name}) follows {self.folder} with the reward columns "
                f"{rewards}, not {self.reward_columns}: leave --reward out to resume that run"
            )
        self.num_generations = int(stored_n)
        self.rewards, self.extras = rewards, list(config.get("extra_columns") or [])

    def record(self, unit: Unit) -> StepRecord:
        path = unit.files[0].path
        rows = _read(path).to_pylist()
        steps = {row["step"] for row in rows}
        if len(steps) != 1 or not isinstance(next(iter(steps)), int):
            raise InvalidInput(
                f"{path}: one step per file expected, found {sorted(steps, key=str)[:5]}"
            )
        step = steps.pop()
        if step != unit.step:
            raise InvalidInput(f"{path}: step {step} in the file of step {unit.step}")
        records = self._rollouts(path, rows)
        assert self.num_generations is not None
        return StepRecord(
            step=step,
            rollout_step=step,
            values=step_values(records, self.num_generations),
            rollouts=records,
            metrics=_reward_means(records, self.rewards),
        )

    def _rollouts(self, path: Path, rows: list[dict[str, Any]]) -> list[RolloutRecord]:
        """A file's rows as rollouts, grouped by runs of identical prompts."""
        assert self.num_generations is not None
        places = positions(
            keys(row["prompt"] for row in rows),
            self.num_generations,
            str(path),
            "rows",
            "num_generations",
        )
        components = [c for c in self.rewards if c != TOTAL]
        return [
            _rollout(path, i, row, group, index, components, self.rewards, self.extras)
            for i, (row, (group, index)) in enumerate(zip(rows, places, strict=True))
        ]


def _read(path: Path, *, columns: list[str] | None = None, schema_only: bool = False) -> Any:
    """A file's schema, or its table (those columns); Incomplete if it is not (yet) Parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if schema_only:
            return pq.read_schema(path)
        return pq.read_table(path, columns=columns)
    except (pa.ArrowException, OSError) as exc:
        raise Incomplete(f"{path}: not a readable Parquet file ({exc})") from exc


def _is_number(kind: Any) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_floating(kind) or pa.types.is_integer(kind))


def _split_columns(
    numeric: dict[str, bool], reward_columns: Sequence[str] | None
) -> tuple[list[str], list[str]]:
    """(reward columns, extra columns). By default every numeric column beyond the required ones
    is a reward function's (TRL names them after the functions); `reward_columns` names them."""
    if reward_columns is None:
        rewards = [c for c, is_number in numeric.items() if is_number]
    else:
        unknown = [c for c in reward_columns if c not in numeric]
        if unknown:
            raise InvalidInput(
                f"no reward column {', '.join(unknown)}; the files have {', '.join(numeric)}"
            )
        rewards = list(reward_columns)
    return rewards, [c for c in numeric if c not in rewards]


def _rollout(
    path: Path,
    number_: int,
    row: dict[str, Any],
    group: int,
    index: int,
    components: list[str],
    rewards: list[str],
    extras: list[str],
) -> RolloutRecord:
    advantage = row["advantage"]
    if (
        isinstance(advantage, bool)
        or not isinstance(advantage, int | float)
        or advantage != advantage
    ):
        raise InvalidInput(f"{path}: row {number_ + 1}: advantage is {advantage!r}, not a number")
    scores = {name: number(row.get(name)) for name in rewards}
    total = scores.get(TOTAL) if TOTAL in scores else None
    if total is None:
        total = sum(v for c in components if (v := scores.get(c)) is not None)
    meta: dict[str, Any] = {"rewards": scores}
    if extras:
        meta["extra"] = {name: plain(row.get(name)) for name in extras}
    prompt, completion = row["prompt"], row["completion"]
    if not isinstance(completion, str):
        meta["completion_messages"] = plain(completion)
    return text_rollout(
        group=group,
        index=index,
        prompt=_text(prompt, path, number_, "prompt"),
        completion=_text(completion, path, number_, "completion"),
        target=None,
        verifier_reward=float(total),
        true_score=None,
        advantage=float(advantage),
        meta=meta,
    )


def _text(value: Any, path: Path, number_: int, column: str) -> str:
    """A prompt or completion as text: a conversation becomes `role: content` lines."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        return "\n".join(f"{m.get('role', '?')}: {m.get('content') or ''}" for m in value)
    raise InvalidInput(f"{path}: row {number_ + 1}: {column} is {type(value).__name__}, not text")


def _reward_means(records: list[RolloutRecord], rewards: list[str]) -> dict[str, float | None]:
    """Each reward function's mean over the rows where it scored (TRL's rewards/NAME/mean)."""
    out: dict[str, float | None] = {}
    for name in rewards:
        values = [v for r in records if (v := r.meta["rewards"].get(name)) is not None]
        out[f"rewards/{name}/mean"] = sum(values) / len(values) if values else None
    return out
