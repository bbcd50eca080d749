"""Import what TRL's GRPOTrainer already wrote: `completions/completions_NNNNN.parquet` files.

With `log_completions=True`, TRL writes at each logging step one file of its last generation
batch: columns `step`, `prompt`, `completion`, one column per reward function (named after it),
any `log_extra` columns, and `advantage`. Each file becomes a step; rows are grouped by runs of
identical consecutive prompts (TRL generates a prompt's `num_generations` completions side by
side). There are no token ids, logprobs or control-token probabilities in those files.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_lens.server import store
from rollout_lens.server.db import session_scope
from rollout_lens.server.errors import InvalidInput
from rollout_lens.server.importer import Imported
from rollout_lens.server.models import RunSource, RunStatus
from rollout_lens.server.records import RolloutRecord, StepRecord
from sqlalchemy.exc import DataError, IntegrityError
from sqlalchemy.orm import Session, sessionmaker

REQUIRED = ("step", "prompt", "completion", "advantage")
TOTAL = "reward"  # a column with this name is taken as the total reward, not a component
FILE_NAME = re.compile(r"^completions_(\d+)\.parquet$")


@dataclass
class _File:
    path: Path
    number: int


def completion_files(output_dir: Path) -> list[_File]:
    """The completions files of a TRL output directory (or of its completions/ folder), in order."""
    if not output_dir.is_dir():
        raise InvalidInput(f"{output_dir}: no such directory")
    folder = output_dir / "completions" if (output_dir / "completions").is_dir() else output_dir
    found = [
        _File(path, int(match.group(1)))
        for path in folder.iterdir()
        if path.is_file() and (match := FILE_NAME.match(path.name))
    ]
    if not found:
        raise InvalidInput(
            f"{output_dir}: no completions/completions_NNNNN.parquet files (GRPOTrainer writes "
            "them with log_completions=True)"
        )
    return sorted(found, key=lambda f: f.number)


def import_trl(
    factory: sessionmaker[Session],
    output_dir: Path,
    *,
    name: str | None = None,
    num_generations: int | None = None,
    model: str = "unknown",
    reward_columns: Sequence[str] | None = None,
) -> Imported:
    """Create a run (source `trl-import`) from TRL's completions files; InvalidInput, and nothing
    created, for a directory without them or a damaged file."""
    files = completion_files(output_dir)
    if num_generations is not None and num_generations < 1:
        raise InvalidInput(f"num_generations must be at least 1, not {num_generations}")
    # A first pass over the schemas and the prompt column: checks every file opens and has the
    # columns, and finds the group size, before anything is written.
    lengths: list[int] = []
    numeric: dict[str, bool] = {}  # every column beyond the required ones → is it a number
    for file in files:
        schema = _read(file.path, schema_only=True)
        missing = [c for c in REQUIRED if c not in schema.names]
        if missing:
            raise InvalidInput(
                f"{file.path}: no column {', '.join(missing)} (TRL writes {', '.join(REQUIRED)})"
            )
        for field in schema:
            if field.name not in REQUIRED:
                numeric.setdefault(field.name, _is_number(field.type))
        prompts = _read(file.path, columns=["prompt"]).column("prompt").to_pylist()
        lengths.extend(_run_lengths(_keys(prompts)))
    group_size = num_generations or _detect_group_size(lengths, output_dir)
    rewards, extras = _split_columns(numeric, reward_columns)
    try:
        with session_scope(factory) as session:
            return _write(
                session,
                files,
                output_dir=output_dir,
                name=name or f"TRL {output_dir.resolve().name}",
                model=model,
                group_size=group_size,
                detected=num_generations is None,
                rewards=rewards,
                extras=extras,
            )
    except (IntegrityError, DataError) as exc:
        raise InvalidInput(f"{output_dir}: the database refused a value: {exc.orig}") from exc


def _read(path: Path, *, columns: list[str] | None = None, schema_only: bool = False) -> Any:
    """A file's schema, or its table (those columns); InvalidInput if it is not Parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if schema_only:
            return pq.read_schema(path)
        return pq.read_table(path, columns=columns)
    except (pa.ArrowException, OSError) as exc:
        raise InvalidInput(f"{path}: not a readable Parquet file ({exc})") from exc


def _is_number(kind: Any) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_floating(kind) or pa.types.is_integer(kind))


def _keys(prompts: Iterable[Any]) -> list[str]:
    """Prompts as comparable text (a conversational prompt is a list of messages)."""
    return [p if isinstance(p, str) else json.dumps(p, sort_keys=True) for p in prompts]


def _run_lengths(keys: list[str]) -> list[int]:
    """Lengths of the runs of identical consecutive keys."""
    lengths: list[int] = []
    for i, key in enumerate(keys):
        if i and key == keys[i - 1]:
            lengths[-1] += 1
        else:
            lengths.append(1)
    return lengths


def _detect_group_size(lengths: list[int], output_dir: Path) -> int:
    """num_generations: the common divisor of every run of identical prompts (a prompt asked
    twice in a row makes a run of 2G, not a different G)."""
    size = math.gcd(*lengths)
    if size < 2:
        raise InvalidInput(
            f"{output_dir}: cannot tell num_generations from the files (runs of identical "
            f"prompts of lengths {sorted(set(lengths))[:8]}); pass --num-generations"
        )
    return size


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


def _write(
    session: Session,
    files: list[_File],
    *,
    output_dir: Path,
    name: str,
    model: str,
    group_size: int,
    detected: bool,
    rewards: list[str],
    extras: list[str],
) -> Imported:
    components = [c for c in rewards if c != TOTAL]
    notes = [
        f"imported from TRL's completions files in {output_dir}: only the steps TRL logged, each "
        "with its last generation batch",
        "no token ids, logprobs or control-token probabilities (TRL does not write them)",
    ]
    if detected:
        notes.append(f"num_generations {group_size}: detected from runs of identical prompts")
    run = store.create_run(
        session,
        name=name,
        model=model,
        total_steps=0,
        group_size=group_size,
        config={
            "trl_output_dir": str(output_dir.resolve()),
            "num_generations": group_size,
            "reward_columns": rewards,
            "extra_columns": extras,
            "verifier_reward": TOTAL if TOTAL in rewards else f"sum of {', '.join(components)}",
            "judged": {"vote": False, "true_score": False, "format_valid": False},
        },
        status=RunStatus.completed,
        source=RunSource.trl_import,
        notes=notes,
    )
    last: int | None = None
    rollouts = 0
    groups_per_step = 1
    recorder: store.Recorder | None = None
    for file in files:
        rows = _read(file.path).to_pylist()
        steps = {row["step"] for row in rows}
        if len(steps) != 1 or not isinstance(next(iter(steps)), int):
            raise InvalidInput(
                f"{file.path}: one step per file expected, found {sorted(steps, key=str)[:5]}"
            )
        step = steps.pop()
        if last is not None and step <= last:
            raise InvalidInput(f"{file.path}: step {step} comes after step {last}")
        last = step
        records = _rollouts(file.path, rows, group_size, components, rewards, extras)
        rollouts += len(records)
        if len(records) // group_size > groups_per_step:
            # the alert rules judge shares over enough groups: tell them how many a step holds
            groups_per_step = len(records) // group_size
            store.restore_run_columns(
                session, run_id=run.id, values={"prompts_per_step": groups_per_step}
            )
            recorder = None  # rebuilt from the steps so far, with that number
        recorder = store.record_step(
            session,
            recorder=recorder,
            run_id=run.id,
            record=StepRecord(
                step=step,
                rollout_step=step,
                values=_step_values(records, group_size),
                rollouts=records,
                metrics=_reward_means(records, rewards),
            ),
            control_tokens=(),
        )
    store.restore_run_columns(
        session,
        run_id=run.id,
        values={"total_steps": last or 0, "prompts_per_step": groups_per_step},
    )
    return Imported(run.id, name, len(files), rollouts)


def _rollouts(
    path: Path,
    rows: list[dict[str, Any]],
    group_size: int,
    components: list[str],
    rewards: list[str],
    extras: list[str],
) -> list[RolloutRecord]:
    """A file's rows as rollouts, grouped by runs of identical prompts."""
    keys = _keys(row["prompt"] for row in rows)
    out: list[RolloutRecord] = []
    start = 0
    group = 0
    for length in _run_lengths(keys):
        if length % group_size:
            raise InvalidInput(
                f"{path}: rows {start + 1}-{start + length} repeat one prompt {length} times, not "
                f"a multiple of num_generations {group_size}"
            )
        for offset in range(length):
            row = rows[start + offset]
            if offset and offset % group_size == 0:
                group += 1
            out.append(
                _rollout(
                    path,
                    start + offset,
                    row,
                    group,
                    offset % group_size,
                    components,
                    rewards,
                    extras,
                )
            )
        group += 1
        start += length
    return out


def _rollout(
    path: Path,
    number: int,
    row: dict[str, Any],
    group: int,
    index: int,
    components: list[str],
    rewards: list[str],
    extras: list[str],
) -> RolloutRecord:
    advantage = row["advantage"]
    if not isinstance(advantage, int | float):
        raise InvalidInput(f"{path}: row {number + 1}: advantage is {advantage!r}, not a number")
    scores = {name: _number(row.get(name)) for name in rewards}
    total = scores.get(TOTAL) if TOTAL in scores else None
    if total is None:
        total = sum(v for c in components if (v := scores.get(c)) is not None)
    meta: dict[str, Any] = {"rewards": scores}
    if extras:
        meta["extra"] = {name: _plain(row.get(name)) for name in extras}
    prompt, completion = row["prompt"], row["completion"]
    if not isinstance(completion, str):
        meta["completion_messages"] = _plain(completion)
    return RolloutRecord(
        group=group,
        index=index,
        prompt=_text(prompt, path, number, "prompt"),
        completion=_text(completion, path, number, "completion"),
        completion_ids=[],
        token_logprobs=[],
        control_probs={},
        vote=None,
        target=None,
        verifier_reward=float(total),
        true_score=None,
        advantage=float(advantage),
        format_valid=True,
        format_state="unchecked",
        meta=meta,
    )


def _number(value: Any) -> float | None:
    """A reward as a finite float, or None (a reward function may return None: NaN in TRL)."""
    if isinstance(value, int | float) and math.isfinite(value):
        return float(value)
    return None


def _plain(value: Any) -> Any:
    """A value JSON can hold in any database (non-finite floats become None)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, str | int | bool):
        return value
    return str(value)


def _text(value: Any, path: Path, number: int, column: str) -> str:
    """A prompt or completion as text: a conversation becomes `role: content` lines."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        return "\n".join(f"{m.get('role', '?')}: {m.get('content') or ''}" for m in value)
    raise InvalidInput(f"{path}: row {number + 1}: {column} is {type(value).__name__}, not text")


def _step_values(records: list[RolloutRecord], group_size: int) -> dict[str, float | None]:
    """The step columns TRL's rows allow: mean reward and the share of groups with one reward."""
    rewards = [r.verifier_reward for r in records]
    groups = [rewards[i : i + group_size] for i in range(0, len(rewards), group_size)]
    return {
        "reward_mean": sum(rewards) / len(rewards) if rewards else None,
        "zero_std_share": sum(len(set(g)) == 1 for g in groups) / len(groups) if groups else None,
    }


def _reward_means(records: list[RolloutRecord], rewards: list[str]) -> dict[str, float | None]:
    """Each reward function's mean over the rows where it scored (TRL's rewards/NAME/mean)."""
    out: dict[str, float | None] = {}
    for name in rewards:
        values = [v for r in records if (v := r.meta["rewards"].get(name)) is not None]
        out[f"rewards/{name}/mean"] = sum(values) / len(values) if values else None
    return out
