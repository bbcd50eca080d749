"""bench/remote.py in its --quick mode on both databases, so the remote-recording bench cannot
rot: trainers on machines of their own (network namespaces) through a slow, lossy link that is
cut mid-run record every step once, and a recorder over its buffer budget loses only what it
counted. Its invariants are asserted; its speed figures are printed for people, not asserted.
Where namespaces cannot be made, the bench runs on loopback, and the test checks the same and
then skips, saying why."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import PG_URL

ROOT = Path(__file__).resolve().parents[2]


def _bench(tmp_path: Path, *argv: str) -> dict[str, Any]:
    figures = tmp_path / "figures.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.remote", "--quick", "--json", str(figures), *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for label in ("steps sent", "the cut", "caught up", "runs page", "run page", "series"):
        assert label in done.stdout, done.stdout
    result: dict[str, Any] = json.loads(figures.read_text())
    return result


def _on_machines_or_skip(figures: dict[str, Any]) -> None:
    if not figures["namespaces"]:
        pytest.skip(f"the bench ran its trainers on loopback: {figures['where']}")


@pytest.mark.parametrize("where", ["--sqlite", pytest.param("--pg", marks=pytest.mark.postgres)])
def test_remote_bench_through_a_cut_loses_and_doubles_nothing(where: str, tmp_path: Path) -> None:
    argv = [where] if where == "--sqlite" else [where, PG_URL]
    figures = _bench(tmp_path, *argv)
    assert figures["cut_seconds"] is not None  # the links went down mid-run
    assert figures["steps_recorded"] == figures["steps_sent"]
    assert figures["rollouts_recorded"] == figures["rollouts_sent"]
    assert figures["doubled"] == 0
    assert (figures["lost_steps"], figures["lost_rollouts"]) == (0, 0)
    assert figures["dropped_by_recorders"] == figures["dropped_on_runs"] == [0, 0]
    assert figures["caught_up"] is not None  # every step handed over before the end was written
    _on_machines_or_skip(figures)


def test_remote_bench_over_the_buffer_budget_loses_only_what_it_counted(tmp_path: Path) -> None:
    # 20 KB: less than a step's rollouts, so every step is kept without them
    figures = _bench(tmp_path, "--sqlite", "--buffer-mb", "0.02")
    assert figures["doubled"] == 0
    assert figures["lost_rollouts"] > 0
    assert figures["dropped_by_recorders"] == [figures["lost_steps"], figures["lost_rollouts"]]
    assert figures["dropped_on_runs"] == figures["dropped_by_recorders"]
    assert figures["unaccounted"] == 0
    _on_machines_or_skip(figures)
