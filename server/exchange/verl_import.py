"""Import (or follow) the rollout dumps verl already writes.

With `trainer.rollout_data_dir=DIR`, verl's RayPPOTrainer._dump_generations writes at every step
`DIR/{global_step}.jsonl`: one JSON object a line with `input` (the prompt, decoded), `output`
(the response), `gts` (the ground truth; verl 0.5 on), `score` (the sequence reward), `step`, and
every key of the reward function's `reward_extra_info` with one value per sample (`acc`, `pred`,
…). The batch is repeated `rollout.n` times per prompt, interleaved: a prompt's n responses are
consecutive lines. `trainer.validation_data_dir` gets the same for each validation.

Each file becomes a step; groups are runs of identical `input` (or `n`); `score` is the verifier
reward, `gts` the target, the extra keys are kept by name in each rollout's meta["extra"] (numeric
ones also as `verl/<key>` step means); a true-score key (`acc` when present) gives true score and
true accuracy. Advantages are GRPO's group-normalised score, computed here: verl's own are not in
its dump. Validation dumps become the `eval/validation` series (plus `verl/val/…`). With its file
logger's output (`metrics`: trainer.logger=['console','file']), every number verl logs for a step
lands on that step as `verl/<key>` (server/exchange/verl_metrics.py), verl's own over a dump key's
mean of the same name.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout_lens.server.core import vocab
from rollout_lens.server.core.errors import InvalidInput
from rollout_lens.server.core.records import RolloutRecord, StepRecord
from rollout_lens.server.exchange import bounds
from rollout_lens.server.exchange.dump_files import DumpFile, Incomplete, Unit, numbered
from rollout_lens.server.exchange.dump_import import RunPlan
from rollout_lens.server.exchange.dump_rows import (
    BLANK,
    detect_group_size,
    dump_line,
    json_line,
    keys,
    mean,
    number,
    plain,
    positions,
    run_lengths,
    step_values,
    text_rollout,
)
from rollout_lens.server.exchange.verl_metrics import KIND as METRICS
from rollout_lens.server.exchange.verl_metrics import VerlMetrics
from rollout_lens.server.store.models import RunRow, RunSource

FILE_NAME = re.compile(r"^(\d+)\.jsonl$")
REQUIRED = ("input", "output", "score", "step")
OWN = frozenset({*REQUIRED, "gts"})  # the rest of a line is the reward function's extra info
TRUE_SCORE_KEY = "acc"  # taken as the true score when present and no other key is named
EPSILON = 1e-6  # verl's compute_grpo_outcome_advantage
TARGET_CHARS = 64  # the rollouts' target column; a longer ground truth is kept whole in meta
VALIDATION = vocab.eval_set("validation")
NO_TOKENS = (
    "verl's dump has no token ids, logprobs or control-token probabilities, nor loss, KL, "
    "entropy or grad norm (verl logs those to its own loggers)"
)


@dataclass
class _VerlStepShape:
    """What planning needs of a step: its prompts' run lengths and the extra keys it holds."""

    lengths: list[int] = field(default_factory=list)
    numeric: dict[str, bool] = field(default_factory=dict)
    gts: bool = False


class VerlDump:
    """verl's rollout dump folder (and its validation folder), read step by step."""

    source = RunSource.verl_import
    folder_key = "verl_rollout_dir"

    def __init__(
        self,
        folder: Path,
        *,
        validation: Path | None = None,
        name: str | None = None,
        n: int | None = None,
        true_score_key: str | None = None,
        model: str | None = None,
        metrics: Path | None = None,
    ) -> None:
        if n is not None and n < 1:
            raise InvalidInput(f"n must be at least 1, not {n}")
        self.folder = folder
        self.validation = validation
        self.name = name
        self.n = n
        self.true_score_key = true_score_key
        self.model = model
        self.metrics = VerlMetrics(metrics) if metrics is not None else None
        self.empty = (
            f"{folder}: no {{step}}.jsonl files (verl writes them with "
            f"trainer.rollout_data_dir={folder})"
        )

    # -- files ---------------------------------------------------------------------------------

    def scan(self) -> list[DumpFile]:
        """The train dumps and, with a validation folder, its dumps from step 1 on (verl's step 0
        is the validation before training: a run's steps start at 1, so it becomes a note)."""
        if not self.folder.is_dir():
            raise InvalidInput(
                f"{self.folder}: no such directory (verl makes it at its first dump: create it "
                "to follow a run from its start)"
            )
        found = numbered(self.folder, FILE_NAME)
        if self.validation is not None:
            found += numbered(self.validation, FILE_NAME, "validation")
        found = [f for f in found if f.step >= 1]
        return found + (self.metrics.files() if self.metrics is not None else [])

    def check(self, unit: Unit) -> _VerlStepShape:
        out = _VerlStepShape()
        train = unit.of("train")
        if train is not None:
            rows = _read_lines(train)
            out.lengths = run_lengths(keys(row["input"] for row in rows))
            out.numeric = _numeric(rows)
            out.gts = any("gts" in row for row in rows)
        validation = unit.of("validation")
        if validation is not None:
            _read_lines(validation)
        return out

    def wants_more(self, unit: Unit) -> bool:
        # verl writes a step's validation dump next to its train dump (after it in RayPPOTrainer,
        # before it in the v1 trainer) when it validates there, and logs the step's metrics
        # after both (RayPPOTrainer.fit): the newest step waits for all it follows (or for a
        # later step's file), so its evaluation and metrics land with its rollouts.
        return (
            unit.of("train") is None
            or (self.validation is not None and unit.of("validation") is None)
            or (self.metrics is not None and unit.of(METRICS) is None)
        )

    # -- the run -------------------------------------------------------------------------------

    def plan(self, checked: Sequence[Any]) -> RunPlan:
        lengths = [n for c in checked for n in c.lengths]
        if not lengths and self.n is None:
            raise Incomplete(f"{self.folder}: no train dump read yet")
        numeric: dict[str, bool] = {}
        for c in checked:
            for key, is_number in c.numeric.items():
                numeric[key] = numeric.get(key, True) and is_number
        detected = self.n is None
        self.n = self.n or detect_group_size(lengths, str(self.folder), "n", "--n N")
        self.true_score_key = _true_score_key(self.true_score_key, numeric, self.folder)
        folder = self.folder.resolve()
        notes = [
            f"imported from verl's rollout dumps in {folder} ({{step}}.jsonl, written with "
            "trainer.rollout_data_dir)",
            "advantages computed from scores as GRPO's group-normalised score, (score − group "
            "mean) / (group std + 1e-6): verl's own advantages are not in its dump",
            NO_TOKENS,
        ]
        if detected:
            notes.append(f"n {self.n}: detected from runs of identical prompts")
        if self.true_score_key:
            notes.append(f"true score: each sample's `{self.true_score_key}`")
        else:
            notes.append(
                f"no true score: the dumps have no `{TRUE_SCORE_KEY}` (--true-score-key KEY names "
                "another)"
            )
        if not any(c.gts for c in checked if c.lengths):
            notes.append("no targets: these dumps predate verl's `gts` field")
        if self.validation is not None:
            notes.append(
                f"evaluation: verl's validation dumps in {self.validation.resolve()}; "
                f"{VALIDATION} is their mean {self.true_score_key or 'score'}"
            )
            notes += self._before_training()
        if self.metrics is not None:
            notes += self.metrics.notes()
        return RunPlan(
            name=self.name or f"verl {folder.name}",
            model=self.model or "unknown",
            group_size=self.n,
            config={
                self.folder_key: str(folder),
                "verl_validation_dir": str(self.validation.resolve()) if self.validation else None,
                "verl_metrics_file": str(self.metrics.path.resolve()) if self.metrics else None,
                "n": self.n,
                "true_score_key": self.true_score_key,
                "extra_keys": sorted(numeric),
                "verifier_reward": "score",
                "advantage": "GRPO group-normalised score, computed on import",
                "judged": {
                    "vote": False,
                    "true_score": self.true_score_key is not None,
                    "format_valid": False,
                },
            },
            notes=notes,
        )

    def _before_training(self) -> list[str]:
        """A note of the validation before training (verl's step 0), when its dump reads whole."""
        assert self.validation is not None
        path = self.validation / "0.jsonl"
        try:
            rows = _read_lines(DumpFile(path, 0, "validation")) if path.is_file() else []
        except InvalidInput:
            return []  # still being written, or damaged: the run goes on without the note
        if not rows:
            return []
        value = self._validation_mean(rows)
        what = self.true_score_key or "score"
        shown = "—" if value is None else f"{value:.4g}"
        return [
            f"validation before training (verl's step 0): mean {what} {shown} over {len(rows)} "
            "samples (not charted: steps start at 1)"
        ]

    def _validation_mean(self, rows: list[dict[str, Any]]) -> float | None:
        """A validation dump's mean true score, or its mean score without one."""
        key = self.true_score_key
        if key and any(key in row for row in rows):
            return _key_mean(rows, key)
        return mean(row["score"] for row in rows)

    def adopt(self, run: RunRow) -> None:
        config = run.config or {}
        stored = {
            "--n": config.get("n"),
            "--true-score-key": config.get("true_score_key"),
            "--validation": config.get("verl_validation_dir"),
            "--metrics": config.get("verl_metrics_file"),
        }
        given = {
            "--n": self.n,
            "--true-score-key": self.true_score_key,
            "--validation": str(self.validation.resolve()) if self.validation else None,
            "--metrics": str(self.metrics.path.resolve()) if self.metrics else None,
        }
        for option, value in given.items():
            if value is not None and value != stored[option]:
                raise InvalidInput(
                    f"run {run.id} ({run.name}) follows {self.folder} with {option} "
                    f"{stored[option]}, not {value}: leave it out to resume that run"
                )
        self.n = int(config.get("n") or run.group_size)
        self.true_score_key = stored["--true-score-key"]
        if stored["--validation"]:
            self.validation = Path(stored["--validation"])
        if stored["--metrics"] and self.metrics is None:
            self.metrics = VerlMetrics(Path(stored["--metrics"]))

    # -- a step --------------------------------------------------------------------------------

    def record(self, unit: Unit) -> StepRecord:
        rollouts: list[RolloutRecord] = []
        values: dict[str, float | None] = {}
        metrics: dict[str, float | None] = {}
        train = unit.of("train")
        if train is not None:
            rows = _read_lines(train)
            rollouts = self._rollouts(train, rows)
            assert self.n is not None
            values = step_values(rollouts, self.n)
            metrics = {vocab.verl(k): _key_mean(rows, k) for k, ok in _numeric(rows).items() if ok}
        validation = unit.of("validation")
        if validation is not None:
            rows = _read_lines(validation)
            metrics[VALIDATION] = self._validation_mean(rows)
            metrics[vocab.verl("val/score")] = mean(row["score"] for row in rows)
            for k, ok in _numeric(rows).items():
                if ok:
                    metrics[vocab.verl(f"val/{k}")] = _key_mean(rows, k)
        if self.metrics is not None and unit.of(METRICS) is not None:
            metrics.update(self.metrics.at(unit.step))  # verl's own over a dump key's mean
        return StepRecord(
            step=unit.step,
            rollout_step=unit.step,
            values=values,
            rollouts=rollouts,
            metrics=metrics,
        )

    def _rollouts(self, file: DumpFile, rows: list[dict[str, Any]]) -> list[RolloutRecord]:
        assert self.n is not None
        places = positions(keys(row["input"] for row in rows), self.n, str(file.path), "lines", "n")
        advantages = _advantages([row["score"] for row in rows], [g for g, _ in places])
        out: list[RolloutRecord] = []
        for row, (group, index), advantage in zip(rows, places, advantages, strict=True):
            target, exact = _target(row.get("gts"))
            meta: dict[str, Any] = {"extra": {k: plain(v) for k, v in row.items() if k not in OWN}}
            if not exact:
                meta["gts"] = plain(row.get("gts"))
            key = self.true_score_key
            out.append(
                text_rollout(
                    group=group,
                    index=index,
                    prompt=row["input"],
                    completion=row["output"],
                    target=target,
                    verifier_reward=row["score"],
                    true_score=number(row.get(key)) if key else None,
                    advantage=advantage,
                    meta=meta,
                )
            )
        return out


# --- reading a file ------------------------------------------------------------------------------


def _read_lines(file: DumpFile) -> list[dict[str, Any]]:
    """A dump file's samples; Incomplete when it does not read whole (empty, or its last line not
    ended), InvalidInput naming the file and line for anything that is not verl's format."""
    path = file.path
    rows = []
    try:
        with path.open("rb") as f:
            for number_, raw in bounds.lines(f, str(path)):  # one line in memory at a time
                if not raw.endswith(b"\n"):
                    raise Incomplete(f"{path} line {number_}: ends mid-line (cut short?)")
                where = f"{path} line {number_}"
                row = json_line(raw, where)
                if row is not BLANK:
                    rows.append(_sample(row, where, file.step))
    except OSError as exc:
        raise InvalidInput(f"{path}: cannot be read ({exc.strerror})") from exc
    if not rows:
        raise Incomplete(f"{path}: empty (still being written?)")
    return rows


def _sample(row: Any, where: str, step: int) -> dict[str, Any]:
    """One line, checked against verl's dump format."""
    line = dump_line(
        row,
        REQUIRED,
        where,
        what="one of verl's dump lines",
        hint="they have input, output, score, step and, since verl 0.5, gts",
    )
    for text in ("input", "output"):
        if not isinstance(line[text], str):
            raise InvalidInput(f"{where}: {text} is a {type(line[text]).__name__}, not text")
    score = line["score"]
    if isinstance(score, bool) or number(score) is None:
        raise InvalidInput(f"{where}: score is {score!r}, not a finite number")
    line["score"] = float(score)
    if line["step"] != step or isinstance(line["step"], bool):
        raise InvalidInput(f"{where}: step {line['step']!r} in the file of step {step}")
    return line


def _numeric(rows: list[dict[str, Any]]) -> dict[str, bool]:
    """Each extra key → whether every value it has is a number (a bool counts: acc)."""
    out: dict[str, bool] = {}
    for row in rows:
        for key, value in row.items():
            if key not in OWN:
                ok = value is None or (isinstance(value, int | float) and number(value) is not None)
                out[key] = out.get(key, True) and ok
    return out


def _key_mean(rows: list[dict[str, Any]], key: str) -> float | None:
    return mean(number(row.get(key)) for row in rows)


def _true_score_key(given: str | None, numeric: dict[str, bool], folder: Path) -> str | None:
    """The key read as the true score: the one named (it must be a numeric key of the dumps), or
    `acc` when the dumps have it."""
    if given is None:
        return TRUE_SCORE_KEY if numeric.get(TRUE_SCORE_KEY) else None
    if not numeric.get(given):
        have = ", ".join(k for k, ok in numeric.items() if ok) or "none"
        raise InvalidInput(
            f"{folder}: no numeric key {given!r} in the dumps (their numeric keys: {have})"
        )
    return given


def _target(gts: Any) -> tuple[str | None, bool]:
    """The ground truth as the rollout's target, and whether that is all of it (a longer or
    structured ground truth is also kept whole in meta["gts"])."""
    if gts is None:
        return None, True
    text = gts if isinstance(gts, str) else json.dumps(gts, ensure_ascii=False)
    if len(text) > TARGET_CHARS:
        return text[: TARGET_CHARS - 1] + "…", False
    return text, isinstance(gts, str)


def _advantages(scores: list[float], groups: list[int]) -> list[float]:
    """GRPO's advantage, as verl's compute_grpo_outcome_advantage: (score − group mean) / (group
    std + ε), the std with Bessel's correction; a group of one gets mean 0 and std 1."""
    members: dict[int, list[float]] = {}
    for score, group in zip(scores, groups, strict=True):
        members.setdefault(group, []).append(score)
    stats = {
        g: (statistics.fmean(s), statistics.stdev(s)) if len(s) > 1 else (0.0, 1.0)
        for g, s in members.items()
    }
    return [
        (s - stats[g][0]) / (stats[g][1] + EPSILON) for s, g in zip(scores, groups, strict=True)
    ]
