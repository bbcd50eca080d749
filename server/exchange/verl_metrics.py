"""verl's own metrics, read from its `file` logger beside its rollout dumps (`import-verl --metrics`).

With `trainer.logger=['console','file']`, verl's Tracking writes every `log(data, step)` call to
a JSON Lines file (verl 0.9.1, verl/utils/tracking.py, `FileLogger`, lines 529–549): the file is
`VERL_FILE_LOGGER_PATH`, else `{VERL_FILE_LOGGER_ROOT or .}/{project_name}/{experiment_name}.jsonl`,
opened "wb" (a trainer started again writes it afresh), one line a call, `{"step": step, "data":
{...}}`, written by orjson with OPT_SERIALIZE_NUMPY: NaN and the infinities as null, numpy scalars
as numbers. RayPPOTrainer.fit (verl/trainer/ppo/ray_trainer.py) logs the validation before
training at step 0 (line 1442) and one line a training step after its update (line 1802): the
step's validation metrics, `rollout_corr/*`, `training/rollout_probs_diff_*` and every other
scalar of that step. The fully async trainer logs several lines for one step (its timing, then
its aggregated metrics: verl/experimental/fully_async_policy/fully_async_trainer.py): they are
merged, a later value of a key over an earlier one.

Each number becomes the step's `verl/<key>` series (server/core/vocab.py); null is a value logged
without a finite one. The file is read as it grows (from where the last read stopped; again from
the start when it shrank or was replaced): a last line not ended yet is read once it is. A line
that is not verl's is refused naming the file and line: not JSON or not an object, no step or
data, a step that is not a whole number in range, a key too long for a series name, more keys
than a run holds, or a NaN or infinity written as a number (verl's logger writes null for them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout_lens.server.core import vocab
from rollout_lens.server.core.errors import InvalidInput
from rollout_lens.server.exchange import bounds
from rollout_lens.server.exchange.dump_files import DumpFile
from rollout_lens.server.exchange.dump_rows import BLANK, dump_line, json_line
from rollout_lens.server.exchange.wire import MAX_NAME_CHARS

KIND = "metrics"  # the kind of a step's DumpFile in the metrics file
MAX_LINE_BYTES = 4 * 2**20  # one step's metrics: a few thousand numbers at the most
MAX_KEY_CHARS = MAX_NAME_CHARS - len(vocab.verl(""))  # what a series name holds after verl/
SKIPPED_SHOWN = 8  # non-numeric keys named in the run's note


@dataclass
class _Read:
    """What was read of the file so far, and where reading stopped."""

    identity: tuple[int, int] = (0, 0)  # the file's device and inode
    offset: int = 0  # after the last whole line
    lines: int = 0  # whole lines read
    steps: dict[int, dict[str, float | None]] = field(default_factory=dict)
    skipped: set[str] = field(default_factory=set)  # keys whose values are not numbers


class VerlMetrics:
    """verl's file logger output, read as it grows (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._read = _Read()

    def files(self) -> list[DumpFile]:
        """A DumpFile (kind `metrics`, the file's own path) for each training step logged so far
        (step 1 on: step 0 is the validation before training); InvalidInput for a missing file
        or a line that is not verl's."""
        self._update()
        return [DumpFile(self.path, step, KIND) for step in sorted(self._read.steps) if step >= 1]

    def at(self, step: int) -> dict[str, float | None]:
        """The step's metrics as series (`verl/<key>`), every line of that step merged."""
        return {vocab.verl(k): v for k, v in self._read.steps.get(step, {}).items()}

    def notes(self) -> list[str]:
        """What the run's notes say of the file: where it is, and what was not charted."""
        read = self._read
        out = [
            f"verl's own metrics from its file logger {self.path.resolve()} "
            "(trainer.logger=['console','file']): every number it logs as verl/<key>"
        ]
        if 0 in read.steps:
            out.append(
                f"verl's step 0 (the validation before training) logged {len(read.steps[0])} "
                "metrics: not charted (steps start at 1)"
            )
        if read.skipped:
            shown = ", ".join(sorted(read.skipped)[:SKIPPED_SHOWN])
            more = len(read.skipped) - SKIPPED_SHOWN
            out.append(
                f"verl's metrics that are not numbers are not charted: {shown}"
                + (f" and {more} more" if more > 0 else "")
            )
        return out

    def _update(self) -> None:
        """Read the lines written since the last read (all of them again when the file shrank
        or is another file now)."""
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            raise InvalidInput(
                f"{self.path}: no such file (verl's file logger creates it when the trainer "
                "starts with trainer.logger=['console','file'], at VERL_FILE_LOGGER_PATH)"
            ) from None
        identity = (stat.st_dev, stat.st_ino)
        if identity != self._read.identity or stat.st_size < self._read.offset:
            self._read = _Read(identity)
        if stat.st_size == self._read.offset:
            return
        try:
            with self.path.open("rb") as f:
                f.seek(self._read.offset)
                self._lines(f)
        except OSError as exc:
            raise InvalidInput(f"{self.path}: cannot be read ({exc.strerror})") from exc

    def _lines(self, f: Any) -> None:
        read = self._read
        while True:
            raw = f.readline(MAX_LINE_BYTES + 1)
            where = f"{self.path} line {read.lines + 1}"
            if len(raw) > MAX_LINE_BYTES:
                raise InvalidInput(
                    f"{where}: longer than {MAX_LINE_BYTES:,} bytes, more than a step's metrics"
                )
            if not raw.endswith(b"\n"):
                return  # the end, or a line being written: read from its start next time
            row = json_line(raw, where)
            if row is not BLANK:
                step, data = _line(row, where)
                merged = read.steps.setdefault(step, {})
                for key, value in data.items():
                    if value is _NOT_A_NUMBER:
                        read.skipped.add(key)
                    else:
                        merged[key] = value
            read.offset += len(raw)
            read.lines += 1


_NOT_A_NUMBER: Any = object()


def _line(row: Any, where: str) -> tuple[int, dict[str, Any]]:
    """One line of verl's file logger: its step and its data, each value a float, None (logged
    without a finite value) or _NOT_A_NUMBER; InvalidInput naming `where` otherwise."""
    line = dump_line(
        row,
        ("step", "data"),
        where,
        what="a line of verl's file logger",
        hint='each holds {"step": N, "data": {...}}, as verl\'s FileLogger writes them',
    )
    step, data = line["step"], line["data"]
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= bounds.MAX_INT32:
        raise InvalidInput(
            f"{where}: step {str(step)[:40]!r} is not a step number (a whole number from 0 to "
            f"{bounds.MAX_INT32:,})"
        )
    if not isinstance(data, dict):
        raise InvalidInput(f"{where}: data is a JSON {type(data).__name__}, not an object")
    if len(data) > vocab.MAX_SERIES_PER_RUN:
        raise InvalidInput(
            f"{where}: {len(data):,} metrics in one line; a run holds at most "
            f"{vocab.MAX_SERIES_PER_RUN:,} series"
        )
    return step, {key: _value(key, value, where) for key, value in data.items()}


def _value(key: str, value: Any, where: str) -> Any:
    if not key or len(key) > MAX_KEY_CHARS:
        raise InvalidInput(
            f"{where}: a metric named {key[:60]!r} ({len(key)} characters): a name is 1 to "
            f"{MAX_KEY_CHARS} characters"
        )
    if value is None:
        return None
    if isinstance(value, int | float):  # a bool too: 0 or 1
        if not math.isfinite(value):
            raise InvalidInput(
                f"{where}: {key[:60]!r} is {value!r}, not a finite number (verl's logger writes "
                "null for NaN and the infinities)"
            )
        return float(value)
    return _NOT_A_NUMBER
