"""`import-verl --metrics`: verl's own metrics from its file logger (trainer.logger=['console',
'file']) on the run's steps as `verl/<key>`, beside its rollout dumps. verl's own FileLogger
(tests/verl_dump.py, from the installed verl's source) writes these tests' metrics files, and its
own `_dump_generations` their dumps, in the order RayPPOTrainer.fit writes them."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rollout_lens.server import store
from rollout_lens.server.core.errors import InvalidInput
from rollout_lens.server.exchange.dump_import import import_dumps
from rollout_lens.server.exchange.verl_import import VerlDump
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.store.models import RunStatus
from sqlalchemy.orm import Session, sessionmaker

from tests import verl_dump
from tests.factories import run_count
from tests.follow_support import follow_while, newest_run, recorded, use_database
from tests.store.test_verl_import import (
    PROMPTS,
    STEPS,
    VALIDATED,
    N,
    write_step,
    write_validation,
)
from tests.waiting import until


def logged(step: int) -> dict[str, Any]:
    """One step's metrics as verl hands them to its logger: numpy scalars among plain numbers, a
    NaN (the logger writes null), an array (not a number: not charted), the validation's
    metrics at the steps that validate (step 0: the validation before training alone)."""
    val = {"val-core/openai/gsm8k/acc/mean@1": np.float32(0.25 * step)}
    if step == 0:
        return val
    out: dict[str, Any] = {
        "training/global_step": step,
        "rollout_corr/log_ppl_abs_diff": np.float32(0.01 * step),
        "rollout_corr/k3_kl": 0.001 * step**2,
        "rollout_corr/chi2_token": np.float64(0.02 * step),
        "training/rollout_probs_diff_mean": 0.003 * step,
        "actor/pg_loss": -0.1 * step,
        "actor/grad_norm": math.nan if step == 3 else 1.0 + step,
        "debug/lengths": np.arange(3),
    }
    return out | (val if step in VALIDATED else {})


@dataclass
class Run:
    rollout: Path
    validation: Path
    metrics: Path


@pytest.fixture
def run(tmp_path: Path) -> Run:
    """verl's rollout_data_dir, validation_data_dir and file logger output of steps 0-5."""
    out = Run(tmp_path / "rollout", tmp_path / "validation", tmp_path / "metrics.jsonl")
    host = verl_dump.trainer()
    logger = verl_dump.file_logger(out.metrics)
    write_validation(host, out.validation, 0)
    logger.log(data=logged(0), step=0)
    for step in range(1, STEPS + 1):
        write_step(host, out.rollout, step)
        if step in VALIDATED:
            write_validation(host, out.validation, step)
        logger.log(data=logged(step), step=step)
    host._shutdown_dump_executor()
    logger.finish()
    return out


def series_of(factory: sessionmaker[Session], run_id: int) -> dict[str, list[Any]]:
    with session_scope(factory) as session:
        return store.metric_series(session, run_id=run_id)


def test_verls_metrics_land_on_the_runs_steps(
    session_factory: sessionmaker[Session], run: Run
) -> None:
    lines = [json.loads(line) for line in run.metrics.read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2, 3, 4, 5]  # verl's own lines
    assert lines[3]["data"]["actor/grad_norm"] is None  # NaN, as verl's logger writes it
    done = import_dumps(
        session_factory,
        VerlDump(run.rollout, validation=run.validation, metrics=run.metrics),
        settle=0,
    )
    assert (done.steps, done.rollouts) == (STEPS, STEPS * N * len(PROMPTS))
    series = series_of(session_factory, done.run_id)
    for key in ("rollout_corr/k3_kl", "rollout_corr/chi2_token", "actor/pg_loss"):
        want = [(s, pytest.approx(float(logged(s)[key]), rel=1e-6)) for s in range(1, STEPS + 1)]
        assert series[f"verl/{key}"] == want, key
    # float32 numbers as orjson wrote them (their shortest repr), each step's own
    assert [v for _, v in series["verl/rollout_corr/log_ppl_abs_diff"]] == pytest.approx(
        [0.01 * s for s in range(1, STEPS + 1)], rel=1e-6
    )
    grad_norm = dict(series["verl/actor/grad_norm"])
    assert grad_norm[3] is None and grad_norm[2] == 3.0  # logged without a finite value
    assert [s for s, _ in series["verl/val-core/openai/gsm8k/acc/mean@1"]] == [2, 4, 5]
    assert "verl/debug/lengths" not in series
    assert [s for s, _ in series["verl/acc"]] == list(range(1, STEPS + 1))  # the dumps' still
    with session_scope(session_factory) as session:
        stored = store.get_run(session, run_id=done.run_id)
        notes = " ".join(stored.notes)
        assert stored.config["verl_metrics_file"] == str(run.metrics.resolve())
    assert f"verl's own metrics from its file logger {run.metrics.resolve()}" in notes
    assert "verl's step 0 (the validation before training) logged 1 metrics" in notes
    assert "not numbers are not charted: debug/lengths" in notes


def test_lines_of_one_step_are_merged(session_factory: sessionmaker[Session], run: Run) -> None:
    """The fully async trainer logs a step in several lines (its timing, then its aggregated
    metrics): they are one step's, a later value of a key over an earlier one."""
    logger = verl_dump.file_logger(run.metrics)  # verl's logger writes the file afresh
    for step in range(1, STEPS + 1):
        logger.log(data={"timing_s/step": 2.0 * step, "actor/pg_loss": 9.0}, step=step)
        logger.log(data={"actor/pg_loss": -0.5 * step}, step=step)
    logger.finish()
    done = import_dumps(session_factory, VerlDump(run.rollout, metrics=run.metrics), settle=0)
    series = series_of(session_factory, done.run_id)
    assert series["verl/timing_s/step"] == [(s, 2.0 * s) for s in range(1, STEPS + 1)]
    assert series["verl/actor/pg_loss"] == [(s, -0.5 * s) for s in range(1, STEPS + 1)]


HOSTILE = {
    "not JSON": (b'{"step": 2, "data": {"a": 1\n', "not valid JSON"),
    "not an object": (b"[2, {}]\n", "a JSON list, not a line of verl's file logger"),
    "no data": (b'{"step": 2}\n', "no data: not a line of verl's file logger"),
    "data not an object": (b'{"step": 2, "data": [1, 2]}\n', "data is a JSON list"),
    "a step in text": (b'{"step": "2", "data": {}}\n', "step '2' is not a step number"),
    "a fractional step": (b'{"step": 2.5, "data": {}}\n', "step '2.5' is not a step number"),
    "a true step": (b'{"step": true, "data": {}}\n', "step 'True' is not a step number"),
    "a negative step": (b'{"step": -1, "data": {}}\n', "step '-1' is not a step number"),
    "a step past int32": (b'{"step": 2147483648, "data": {}}\n', "is not a step number"),
    "NaN": (b'{"step": 2, "data": {"k3": NaN}}\n', "'k3' is nan, not a finite number"),
    "Infinity": (b'{"step": 2, "data": {"k3": -Infinity}}\n', "'k3' is -inf, not a finite"),
    "a long name": (
        b'{"step": 2, "data": {"' + b"k" * 196 + b'": 1}}\n',
        "(196 characters): a name is 1 to 195 characters",
    ),
    "too many names": (
        json.dumps({"step": 2, "data": {f"m{i}": i for i in range(1001)}}).encode() + b"\n",
        "1,001 metrics in one line; a run holds at most 1,000 series",
    ),
    "a huge line": (
        b'{"step": 2, "data": {"a": "' + b"x" * (4 * 2**20) + b'"}}\n',
        "longer than 4,194,304 bytes",
    ),
    "too deep": (b'{"step": 2, "data": {"a": ' + b"[" * 70 + b"]" * 70 + b"}}\n", "nested"),
    "not UTF-8": (b'{"step": 2, "data": {"\xff": 1}}\n', "not UTF-8 text"),
}


@pytest.mark.parametrize("damage", list(HOSTILE))
def test_a_line_that_is_not_verls_is_refused_and_creates_nothing(
    session_factory: sessionmaker[Session], run: Run, damage: str
) -> None:
    line, message = HOSTILE[damage]
    kept = run.metrics.read_bytes().splitlines(keepends=True)
    run.metrics.write_bytes(b"".join([*kept[:3], line, *kept[3:]]))
    with pytest.raises(InvalidInput) as refused:
        import_dumps(session_factory, VerlDump(run.rollout, metrics=run.metrics), settle=0)
    assert f"{run.metrics} line 4: " in str(refused.value)
    assert message in str(refused.value)
    assert run_count(session_factory) == 0


def test_a_missing_file_is_refused(session_factory: sessionmaker[Session], run: Run) -> None:
    with pytest.raises(InvalidInput, match="no such file .*trainer.logger=.'console','file'."):
        import_dumps(
            session_factory, VerlDump(run.rollout, metrics=run.metrics.with_name("x")), settle=0
        )
    assert run_count(session_factory) == 0


def test_follow_waits_for_a_steps_metrics(
    session_factory: sessionmaker[Session],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Following both: verl dumps a step's rollouts during the step and logs its metrics after
    its update, so the newest step waits for its line (half a line is not read); each step is
    recorded with its metrics, and a restarted follower adopts the file from the run."""
    from rollout_lens.cli import main

    use_database(monkeypatch, session_factory, tmp_path)
    folder, metrics = tmp_path / "rollout", tmp_path / "metrics.jsonl"
    folder.mkdir()
    seen: dict[str, Any] = {}
    logger = verl_dump.file_logger(metrics)  # verl's Tracking, made as its trainer starts

    def verl_trains() -> None:
        host = verl_dump.trainer()
        write_step(host, folder, 1)
        logger.log(data=logged(1), step=1)
        write_step(host, folder, 2)  # step 2's rollouts; its metrics not logged yet
        until(lambda: recorded(session_factory) == [1], "step 1")
        line = json.dumps({"step": 2, "data": {"rollout_corr/k3_kl": 0.004}}).encode()
        logger.fp.write(line[:20])  # the logger's file, a line mid-way through its write
        time.sleep(1.2)  # past --settle: step 2 still waits
        seen["waiting"] = recorded(session_factory)
        logger.fp.write(line[20:] + b"\n")
        until(lambda: recorded(session_factory) == [1, 2], "step 2")
        write_step(host, folder, 3)
        logger.log(data=logged(3), step=3)
        host._shutdown_dump_executor()

    args = ["import-verl", str(folder), "--metrics", str(metrics), "--follow"]
    try:
        status = follow_while(verl_trains, lambda: main([*args, "--settle", "0.3", "--idle", "3"]))
    finally:
        logger.finish()
    assert status == 0 and seen["waiting"] == [1]
    run = newest_run(session_factory)
    assert run is not None and run.status == RunStatus.completed
    series = series_of(session_factory, run.id)
    assert series["verl/rollout_corr/k3_kl"] == [(1, 0.001), (2, 0.004), (3, pytest.approx(0.009))]
    capsys.readouterr()
    # resumed without --metrics: the run's file is followed again
    assert main(["import-verl", str(folder), "--follow", "--settle", "0", "--idle", "1"]) == 0
    assert "resuming run 1" in capsys.readouterr().err
    (tmp_path / "other.jsonl").touch()
    assert main([*args, "--metrics", str(tmp_path / "other.jsonl")]) == 2
    assert "--metrics" in capsys.readouterr().err
