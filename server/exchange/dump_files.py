"""A trainer's numbered dump files (one per step) and when each is whole enough to read.

The rule, for files a trainer is still writing: a step's files are read once a file of a later
step exists (TRL and verl write one step's dumps before the next step's, from one thread), or,
for the newest step, once each of its files has kept its size and modification time for
`settle` seconds by this process's clock (or was last modified longer ago than that) AND reads
whole — its format says what whole is (verl: ends with a newline; TRL: Parquet with its footer).
A file of an earlier step that still does not read whole is an error, not a wait.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rollout_lens.server.core.errors import InvalidInput
from rollout_lens.server.exchange import bounds

SETTLE_SECONDS = 2.0  # how long the newest file must keep its size and mtime before it is read


class Incomplete(InvalidInput):
    """A file that does not read whole (yet): still being written, or cut short."""


@dataclass(frozen=True)
class DumpFile:
    """One dump file: its path, the step it holds and which series it belongs to."""

    path: Path
    step: int
    kind: str = "train"  # or "validation"


@dataclass(frozen=True)
class Unit:
    """The files of one step, and whether a later step's file proves them written."""

    step: int
    files: tuple[DumpFile, ...]
    followed: bool

    def of(self, kind: str) -> DumpFile | None:
        """The step's file of that series, if any."""
        return next((f for f in self.files if f.kind == kind), None)


def numbered(
    folder: Path, pattern: re.Pattern[str], kind: str = "train", *, root: Path | None = None
) -> list[DumpFile]:
    """The files of a folder whose name matches `pattern` (group 1: the step), in step order;
    InvalidInput for one that links out of `root` (the folder given; default `folder`)."""
    if not folder.is_dir():
        raise InvalidInput(f"{folder}: no such directory")
    inside = (root or folder).resolve()
    found = []
    for path in folder.iterdir():
        if not (match := pattern.match(path.name)) or not path.is_file():
            continue
        if not path.resolve().is_relative_to(inside):
            # A link out of the folder is never followed: its target could be any file this
            # process may read, shown on a step page as a completion.
            raise InvalidInput(
                f"{path}: a link to {path.resolve()}, outside {root or folder}; only the folder's own "
                "files are imported (copy the file in instead)"
            )
        found.append(DumpFile(path, bounds.check_step(match.group(1), str(path)), kind))
    return sorted(found, key=lambda f: f.step)


class Settling:
    """Watches files for change by this process's clock (mtimes of a network filesystem may come
    from another clock): a file is settled once its size and mtime held for `settle` seconds."""

    def __init__(self, settle: float = SETTLE_SECONDS, clock: Callable[[], float] = time.monotonic):
        self.settle = settle
        self.clock = clock
        self._seen: dict[Path, tuple[tuple[int, int], float]] = {}
        self.last_change = clock()  # when a watched file last appeared or changed

    def settled(self, path: Path) -> bool:
        """Whether the file has stopped changing (False for a file that vanished)."""
        try:
            stat = path.stat()
        except FileNotFoundError:
            return False
        state = (stat.st_size, stat.st_mtime_ns)
        now = self.clock()
        seen = self._seen.get(path)
        if seen is None or seen[0] != state:
            self._seen[path] = seen = (state, now)
            self.last_change = now
        return now - seen[1] >= self.settle or time.time() - stat.st_mtime >= self.settle


def units(
    files: Sequence[DumpFile],
    *,
    after: int | None,
    settling: Settling,
    wants_more: Callable[[Unit], bool],
    final: bool,
) -> list[Unit]:
    """The steps after `after` that may be read now, in order: every step below the newest, and
    the newest once its files have settled and, unless `final`, it expects no more files
    (`wants_more`: verl's train dump waiting for the same step's validation dump)."""
    by_step: dict[int, list[DumpFile]] = {}
    for f in files:
        by_step.setdefault(f.step, []).append(f)
    newest = max(by_step, default=None)
    out = []
    for step in sorted(by_step):
        if after is not None and step <= after:
            continue
        unit = Unit(step, tuple(by_step[step]), followed=step != newest)
        if not unit.followed:
            if not all([settling.settled(f.path) for f in unit.files]):
                break
            if not final and wants_more(unit):
                break
        out.append(unit)
    return out
