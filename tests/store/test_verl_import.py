"""`import-verl`: a run from the rollout dumps verl's own `_dump_generations` writes (verl 0.9's
and the older shape without `gts`), imported in one go or followed while they are written."""

from __future__ import annotations

import json
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from rollout_lens.server import store
from rollout_lens.server.core.errors import InvalidInput
from rollout_lens.server.exchange.dump_import import import_dumps
from rollout_lens.server.exchange.verl_import import VerlDump
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.store.models import RunSource, RunStatus
from rollout_lens.server.store.serialize import rollout_dict
from sqlalchemy.orm import Session, sessionmaker

from tests import verl_dump
from tests.factories import run_count
from tests.follow_support import follow_while, half, newest_run, recorded, use_database
from tests.prompt_lens_support import assert_matches_oracle
from tests.waiting import until

N = 4  # verl's actor_rollout_ref.rollout.n
PROMPTS = [  # as verl decodes them: the chat template applied, special tokens skipped
    "system\nYou are a helpful assistant.\nuser\nNatalia sold 48 clips in April and half as many "
    "in May. How many clips did she sell altogether? Let's think step by step and output the "
    'final answer after "####".\nassistant\n',
    "system\nYou are a helpful assistant.\nuser\nWeng earns $12 an hour for babysitting. "
    "Yesterday, she did 50 minutes of babysitting. How much did she earn?\nassistant\n",
    "system\nYou are a helpful assistant.\nuser\nBetty needs $100 for a wallet and has half of "
    "it. How much more does she need?\nassistant\n",
]
ANSWERS = ["72", "10", "50"]
STEPS = 5
VALIDATED = (0, 2, 4, 5)  # val_before_train at 0, test_freq 2, and the last step

# verl's own dump code (tests/verl_dump.py, with torch) writes these tests' input.


@dataclass
class Dumps:
    rollout: Path
    validation: Path


def batch(step: int) -> dict[str, Any]:
    """One step's batch as verl hands it to `_dump_generations`: each prompt repeated n times,
    interleaved; the reward function's extra info with one value per sample."""
    rng = random.Random(step)
    inputs = [p for p in PROMPTS for _ in range(N)]
    gts = [a for a in ANSWERS for _ in range(N)]
    preds = [a if rng.random() < 0.2 + 0.15 * step else str(rng.randint(1, 99)) for a in gts]
    acc = [p == a for p, a in zip(preds, gts, strict=True)]
    return {
        "inputs": inputs,
        "outputs": [f"She sold 48/2 = 24 clips.\n#### {p}" for p in preds],
        "scores": [1.0 if a else 0.0 for a in acc],
        "extra": {
            "acc": acc,
            "pred": preds,
            "request_id": [f"req-{step}-{i}" for i in range(len(inputs))],
            "batch_mean": [0.5],  # one value for the batch: verl leaves it out
        },
        "gts": gts,
    }


def write_step(host: Any, folder: Path, step: int, *, gts: bool = True) -> Path:
    """verl's own code dumps step `step` into `folder`."""
    b = batch(step)
    return verl_dump.dump(
        host,
        folder,
        step,
        b["inputs"],
        b["outputs"],
        b["scores"],
        b["extra"],
        gts=b["gts"] if gts else None,
    )


def write_validation(host: Any, folder: Path, step: int) -> Path:
    """verl's validation dump: each prompt once (val_kwargs.n = 1), greedy."""
    right = [step >= 2, step >= 4, True]
    return verl_dump.dump(
        host,
        folder,
        step,
        PROMPTS,
        [f"#### {a if ok else 0}" for a, ok in zip(ANSWERS, right, strict=True)],
        [1.0 if ok else 0.0 for ok in right],
        {"acc": right, "reward": [1.0 if ok else 0.0 for ok in right]},
        gts=ANSWERS,
    )


@pytest.fixture
def dumps(tmp_path: Path) -> Dumps:
    """A verl run's rollout_data_dir (steps 1-5) and validation_data_dir (steps 0, 2, 4, 5), in the
    order verl writes them."""
    out = Dumps(tmp_path / "rollout", tmp_path / "validation")
    host = verl_dump.trainer()
    write_validation(host, out.validation, 0)
    for step in range(1, STEPS + 1):
        write_step(host, out.rollout, step)
        if step in VALIDATED:
            write_validation(host, out.validation, step)
    host._shutdown_dump_executor()
    return out


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def rollouts_of(factory: sessionmaker[Session], run_id: int) -> list[dict[str, Any]]:
    with session_scope(factory) as session:
        return [rollout_dict(r, p, []) for r, p in store.iter_rollouts(session, run_id=run_id)]


def test_a_verl_run_becomes_a_run(session_factory: sessionmaker[Session], dumps: Dumps) -> None:
    done = import_dumps(
        session_factory, VerlDump(dumps.rollout, validation=dumps.validation), settle=0
    )
    assert (done.steps, done.rollouts) == (STEPS, STEPS * N * len(PROMPTS))
    written = [
        row for step in range(1, STEPS + 1) for row in lines(dumps.rollout / f"{step}.jsonl")
    ]
    assert set(written[0]) == {
        "input",
        "output",
        "gts",
        "score",
        "step",
        "acc",
        "pred",
        "request_id",
    }
    with session_scope(session_factory) as session:
        run = store.get_run(session, run_id=done.run_id)
        assert (run.source, run.status, run.name) == (
            RunSource.verl_import,
            RunStatus.completed,
            "verl rollout",
        )
        assert (run.group_size, run.prompts_per_step, run.total_steps, run.current_step) == (
            N,
            len(PROMPTS),
            STEPS,
            STEPS,
        )
        assert run.config["true_score_key"] == "acc"
        assert any("n 4: detected" in note for note in run.notes)
        assert any("advantages computed from scores" in note for note in run.notes)
        assert any("no token ids, logprobs or control-token probabilities" in n for n in run.notes)
        steps = {s.step: s for s in store.steps(session, run_id=done.run_id)}
        series = store.metric_series(session, run_id=done.run_id)
    rollouts = rollouts_of(session_factory, done.run_id)

    # Every line, in order: input → prompt, output → completion, gts → target, score → verifier
    # reward, acc → true score, the other keys by name; no token-level data.
    assert [
        (r["step"], r["prompt"], r["completion"], r["target"], r["verifier_reward"])
        for r in rollouts
    ] == [(w["step"], w["input"], w["output"], w["gts"], w["score"]) for w in written]
    assert [r["true_score"] for r in rollouts] == [float(w["acc"]) for w in written]
    assert [r["meta"]["extra"] for r in rollouts] == [
        {"acc": w["acc"], "pred": w["pred"], "request_id": w["request_id"]} for w in written
    ]
    assert all(r["completion_ids"] == [] and r["sum_logprob"] is None for r in rollouts)
    # Groups of n consecutive lines; advantages as verl's own GRPO estimator computes them.
    assert [(r["group"], r["index"]) for r in rollouts[: 2 * N]] == [
        (g, i) for g in (0, 1) for i in range(N)
    ]
    for step in range(1, STEPS + 1):
        mine = [r for r in rollouts if r["step"] == step]
        verl_says = verl_dump.grpo_advantages(
            [r["verifier_reward"] for r in mine], [r["group"] for r in mine]
        )
        assert [r["advantage"] for r in mine] == pytest.approx(verl_says, abs=1e-5)
        assert steps[step].reward_mean == pytest.approx(sum(batch(step)["scores"]) / (3 * N))
        assert steps[step].true_accuracy == steps[step].reward_mean
    # Numeric extra keys as step means; the validation dumps as the evaluation series.
    acc = series["verl/acc"]
    assert [s for s, _ in acc] == list(range(1, STEPS + 1))
    assert "verl/pred" not in series and "verl/request_id" not in series
    assert series["eval/validation"] == [(2, pytest.approx(2 / 3)), (4, 1.0), (5, 1.0)]
    assert [s for s, _ in series["verl/val/score"]] == [2, 4, 5]
    # The validation before training (verl's step 0) is a note: a run's steps start at 1.
    assert min(steps) == 1
    assert len(assert_matches_oracle(session_factory, done.run_id)) == len(PROMPTS)
    assert "validation before training (verl's step 0): mean acc 0.3333 over 3 samples" in " ".join(
        run.notes
    )


def test_the_older_dump_without_gts(session_factory: sessionmaker[Session], tmp_path: Path) -> None:
    old = verl_dump.old_trainer()
    for step in (1, 2):
        write_step(old, tmp_path / "old", step, gts=False)
    assert "gts" not in lines(tmp_path / "old" / "1.jsonl")[0]
    done = import_dumps(session_factory, VerlDump(tmp_path / "old", name="old verl"), settle=0)
    assert (done.steps, done.rollouts) == (2, 2 * N * len(PROMPTS))
    rollouts = rollouts_of(session_factory, done.run_id)
    assert {r["target"] for r in rollouts} == {None}
    assert "gts" not in rollouts[0]["meta"]
    with session_scope(session_factory) as session:
        run = store.get_run(session, run_id=done.run_id)
        assert any("predate verl's `gts`" in note for note in run.notes)
        assert run.group_size == N


def test_n_and_the_true_score_key_can_be_given(
    session_factory: sessionmaker[Session], dumps: Dumps
) -> None:
    done = import_dumps(
        session_factory, VerlDump(dumps.rollout, n=2, true_score_key="acc"), settle=0
    )
    with session_scope(session_factory) as session:
        run = store.get_run(session, run_id=done.run_id)
        assert (run.group_size, run.prompts_per_step) == (2, 2 * len(PROMPTS))
        assert not any("detected" in note for note in run.notes)
    with pytest.raises(InvalidInput, match="not a multiple of n 3"):
        import_dumps(session_factory, VerlDump(dumps.rollout, n=3), settle=0)
    with pytest.raises(InvalidInput, match=r"no numeric key 'pred' in the dumps .*acc"):
        import_dumps(session_factory, VerlDump(dumps.rollout, true_score_key="pred"), settle=0)
    assert run_count(session_factory) == 1


def test_a_long_or_structured_ground_truth_is_kept_whole(
    session_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    host = verl_dump.trainer()
    b = batch(1)
    gts = [{"answer": a, "steps": ["x" * 80]} for a in b["gts"]]
    verl_dump.dump(host, tmp_path / "d", 1, b["inputs"], b["outputs"], b["scores"], gts=gts)
    host._shutdown_dump_executor()
    done = import_dumps(session_factory, VerlDump(tmp_path / "d"), settle=0)
    first = rollouts_of(session_factory, done.run_id)[0]
    assert first["meta"]["gts"] == gts[0]
    assert len(first["target"]) == 64 and first["target"].endswith("…")
    assert first["true_score"] is None  # no acc in this dump


def _damage(folder: Path, damage: str) -> str:
    """Damage a dump folder; the message the import must give."""
    second = folder / "2.jsonl"
    rows = second.read_text(encoding="utf-8").splitlines(keepends=True)
    if damage == "missing folder":
        shutil.rmtree(folder)
        return f"{folder}: no such directory"
    if damage == "no dumps":
        for f in folder.glob("*.jsonl"):
            f.rename(f.with_suffix(".json"))
        return "no {step}.jsonl files (verl writes them with trainer.rollout_data_dir="
    if damage == "not verl's format":
        second.write_text(json.dumps({"prompt": "p", "completion": "c", "step": 2}) + "\n")
        return f"{second} line 1: no input, output, score: not one of verl's dump lines"
    if damage == "malformed line":
        rows[2] = '{"input": "cut", "output": \n'
        second.write_text("".join(rows), encoding="utf-8")
        return f"{second} line 3: not valid JSON"
    if damage == "a score that is no number":
        row = json.loads(rows[1]) | {"score": "high"}
        rows[1] = json.dumps(row) + "\n"
        second.write_text("".join(rows), encoding="utf-8")
        return f"{second} line 2: score is 'high', not a finite number"
    if damage == "a file cut short":  # the next step's file exists: this one is done, and broken
        second.write_text("".join(rows)[:-40], encoding="utf-8")
        return f"{second} line {len(rows)}: ends mid-line"
    raise AssertionError(damage)


DAMAGES = [
    "missing folder",
    "no dumps",
    "not verl's format",
    "malformed line",
    "a score that is no number",
    "a file cut short",
]


@pytest.mark.parametrize("damage", DAMAGES)
def test_bad_input_is_refused_and_creates_nothing(
    session_factory: sessionmaker[Session], dumps: Dumps, damage: str
) -> None:
    message = _damage(dumps.rollout, damage)
    with pytest.raises(InvalidInput) as refused:
        import_dumps(session_factory, VerlDump(dumps.rollout), settle=0)
    assert message in str(refused.value)
    assert run_count(session_factory) == 0


def test_the_cli_imports_a_verl_run(
    session_factory: sessionmaker[Session],
    dumps: Dumps,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from rollout_lens.cli import main

    use_database(monkeypatch, session_factory, tmp_path)
    args = ["import-verl", str(dumps.rollout), "--validation", str(dumps.validation)]
    assert (
        main([*args, "--name", "gsm8k grpo", "--model", "Qwen/Qwen2.5-0.5B", "--settle", "0"]) == 0
    )
    out = capsys.readouterr().out
    assert f"from {dumps.rollout}: {STEPS} steps, {STEPS * 12} rollouts" in out
    assert "run_id=1" in out
    with session_scope(session_factory) as session:
        run = store.get_run(session, run_id=1)
        assert (run.name, run.model) == ("gsm8k grpo", "Qwen/Qwen2.5-0.5B")
    # Bad input: exit status 2 and the message naming the file and line, nothing more created.
    message = _damage(dumps.rollout, "malformed line")
    assert main(args) == 2
    assert message in capsys.readouterr().err
    assert main(["import-verl", str(tmp_path / "nowhere")]) == 2
    assert "nowhere: no such directory" in capsys.readouterr().err
    assert main(["import-verl", str(dumps.validation), "--idle", "3"]) == 2
    assert "--idle and --new go with --follow" in capsys.readouterr().err
    assert run_count(session_factory) == 1


# --- following a folder while verl writes it ----------------------------------------------------


def follow_args(folder: Path, *more: str) -> list[str]:
    return ["import-verl", str(folder), "--follow", "--settle", "0.3", *more]


def test_follow_records_steps_as_verl_writes_them(
    session_factory: sessionmaker[Session],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The follower in this thread (the CLI in-process), verl's dump code in another: steps are
    recorded as they appear, a half-written file is not read until whole, the run is running
    with its heartbeat and live series meanwhile, and --idle ends it as completed."""
    from rollout_lens.cli import main
    from tests.web_support import client_for

    use_database(monkeypatch, session_factory, tmp_path)
    folder = tmp_path / "rollout"
    folder.mkdir()
    scratch = verl_dump.trainer()  # writes step 3 elsewhere, for its bytes
    full = write_step(scratch, tmp_path / "scratch", 3).read_bytes()
    seen: dict[str, Any] = {}

    def verl_trains() -> None:
        host = verl_dump.trainer()
        for step in (1, 2):
            write_step(host, folder, step)
        until(lambda: recorded(session_factory) == [1, 2], "steps 1 and 2")
        run = newest_run(session_factory)
        assert run is not None
        seen["live"] = (run.status, run.heartbeat_at, run.worker_host, run.total_steps)
        seen["lens"] = assert_matches_oracle(session_factory, run.id)  # live, mid-run
        with client_for(session_factory) as client:
            seen["page"] = client.get(f"/runs/{run.id}").text
            seen["progress"] = client.get(f"/api/runs/{run.id}/progress").json()
            seen["series"] = client.get(f"/api/runs/{run.id}/series", params={"since": 1}).json()
        # verl's writer mid-way through step 3's file: settled past --settle, not whole.
        (folder / "3.jsonl").write_bytes(half(full))
        time.sleep(1.2)
        seen["half"] = recorded(session_factory)
        before = newest_run(session_factory)
        assert before is not None and before.heartbeat_at is not None
        seen["beats"] = (run.heartbeat_at, before.heartbeat_at)
        (folder / "3.jsonl").write_bytes(full)
        until(lambda: 3 in recorded(session_factory), "step 3")
        for step in (4, 5):
            write_step(host, folder, step)
        host._shutdown_dump_executor()

    status = follow_while(
        verl_trains, lambda: main(follow_args(folder, "--idle", "3", "--total-steps", "8"))
    )
    assert status == 0
    out, err = capsys.readouterr()
    assert "completed (no new step for 3 s)" in out
    assert "created run 1 (verl rollout)" in err and "recorded step 3 (12 rollouts)" in err

    assert seen["live"][0] == RunStatus.running and seen["live"][2]
    assert seen["live"][3] == 8  # --total-steps: progress and ETA while following
    assert 'data-status="running"' in seen["page"]
    assert seen["progress"]["can_cancel"] is True
    assert seen["series"]["series"]["reward_mean"]["x"] == [2]
    assert seen["half"] == [1, 2]  # the half-written file was not read
    assert seen["beats"][1] > seen["beats"][0]  # the heartbeat went on while waiting
    run = newest_run(session_factory)
    assert run is not None
    assert (run.status, run.current_step, run.total_steps) == (RunStatus.completed, 5, 8)
    assert run.finished_at is not None
    rollouts = rollouts_of(session_factory, run.id)
    assert recorded(session_factory) == [1, 2, 3, 4, 5]
    step3 = [r["completion"] for r in rollouts if r["step"] == 3]
    assert step3 == [row["output"] for row in lines(tmp_path / "scratch" / "3.jsonl")]
    assert len(rollouts) == 5 * N * len(PROMPTS)
    assert {g["step"] for p in seen["lens"].values() for g in p["history"]} == {1, 2}
    assert_matches_oracle(session_factory, run.id)


def test_a_restart_resumes_after_the_last_recorded_step(
    session_factory: sessionmaker[Session],
    dumps: Dumps,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from rollout_lens.server.exchange import follow

    from rollout_lens.cli import main

    use_database(monkeypatch, session_factory, tmp_path)
    monkeypatch.setattr(follow, "STEPS_PER_WRITE", 1)  # a resumed catch-up, step by step
    later = tmp_path / "later"  # steps 4 and 5 arrive after the first follower stopped
    later.mkdir()
    for step in (4, 5):
        shutil.move(dumps.rollout / f"{step}.jsonl", later / f"{step}.jsonl")
        shutil.move(dumps.validation / f"{step}.jsonl", later / f"val-{step}.jsonl")
    args = follow_args(dumps.rollout, "--validation", str(dumps.validation), "--idle", "0.5")
    assert main(args) == 0
    assert recorded(session_factory) == [1, 2, 3]
    run = newest_run(session_factory)
    assert run is not None and run.status == RunStatus.completed
    notes = list(run.notes)
    for step in (4, 5):
        shutil.move(later / f"{step}.jsonl", dumps.rollout / f"{step}.jsonl")
        shutil.move(later / f"val-{step}.jsonl", dumps.validation / f"{step}.jsonl")
    # Options given again must agree with the run's; left out, the run's own are taken.
    assert main([*args, "--n", "2"]) == 2
    assert "with --n 4, not 2" in capsys.readouterr().err
    assert main(follow_args(dumps.rollout, "--idle", "0.5")) == 0
    err = capsys.readouterr().err
    assert f"resuming run {run.id} (verl rollout) after step 3" in err
    assert "recorded step 4 (12 rollouts)" in err and "recorded step 5 (12 rollouts)" in err
    assert recorded(session_factory) == [1, 2, 3, 4, 5]
    again = newest_run(session_factory)
    assert again is not None
    assert (again.id, again.status, again.notes, again.current_step) == (
        run.id,
        RunStatus.completed,
        notes,
        5,
    )
    rollouts = rollouts_of(session_factory, run.id)
    assert len(rollouts) == 5 * N * len(PROMPTS)
    assert len({(r["step"], r["group"], r["index"]) for r in rollouts}) == len(rollouts)
    with session_scope(session_factory) as session:
        series = store.metric_series(session, run_id=run.id)
    assert [s for s, _ in series["eval/validation"]] == [2, 4, 5]


def test_a_run_followed_elsewhere_is_not_taken_over(
    session_factory: sessionmaker[Session],
    dumps: Dumps,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from rollout_lens.cli import main

    use_database(monkeypatch, session_factory, tmp_path)
    assert main(follow_args(dumps.rollout, "--idle", "0.3")) == 0
    run = newest_run(session_factory)
    assert run is not None
    with session_scope(session_factory) as session:
        store.mark_following(session, run_id=run.id, worker_host="another-host")
    assert main(follow_args(dumps.rollout, "--idle", "0.3")) == 2
    assert "is being followed already" in capsys.readouterr().err


def test_cancel_in_the_dashboard_stops_the_follower(
    session_factory: sessionmaker[Session],
    dumps: Dumps,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import threading

    from rollout_lens.cli import main
    from tests.web_support import client_for

    use_database(monkeypatch, session_factory, tmp_path)

    def press_cancel() -> None:
        run = until(lambda: newest_run(session_factory), "the run")
        with client_for(session_factory) as client:
            client.post(f"/api/runs/{run.id}/cancel").raise_for_status()

    thread = threading.Thread(target=press_cancel)
    thread.start()
    try:
        # Only the cancel ends it (the --idle is a safety net should the cancel not come).
        assert main(follow_args(dumps.rollout, "--idle", "30")) == 0
    finally:
        thread.join(timeout=30)
    assert "cancelled (cancelled in the dashboard)" in capsys.readouterr().out
    run = newest_run(session_factory)
    assert run is not None and run.status == RunStatus.cancelled


def test_bad_input_when_following_creates_nothing(
    session_factory: sessionmaker[Session],
    dumps: Dumps,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from rollout_lens.cli import main

    use_database(monkeypatch, session_factory, tmp_path)
    message = _damage(dumps.rollout, "malformed line")
    assert main(follow_args(dumps.rollout, "--idle", "5")) == 2
    assert message in capsys.readouterr().err
    assert run_count(session_factory) == 0


def test_ctrl_c_ends_the_followed_run_cleanly(
    session_factory: sessionmaker[Session],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CLI as a process: Ctrl-C (SIGINT) cancels the run it follows and exits 130; a second
    follower resumes it."""
    import os
    import signal
    import subprocess
    import sys

    from rollout_lens.cli import main

    folder = tmp_path / "rollout"
    host = verl_dump.trainer()
    for step in (1, 2):
        write_step(host, folder, step)
    url = session_factory.kw["bind"].url.render_as_string(hide_password=False)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_LENS_")} | {
        "ROLLOUT_LENS_DATABASE_URL": url,
        "ROLLOUT_LENS_DATA_DIR": str(tmp_path / "data"),
        "ROLLOUT_LENS_HEARTBEAT_SECONDS": "0.2",
    }
    with subprocess.Popen(
        [sys.executable, "-m", "rollout_lens", *follow_args(folder)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            until(lambda: recorded(session_factory) == [1, 2] or proc.poll(), "steps 1, 2")
            write_step(host, folder, 3)
            until(lambda: 3 in recorded(session_factory) or proc.poll(), "step 3")
            run = newest_run(session_factory)
            assert run is not None and run.status == RunStatus.running
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 130, err
    assert "cancelled (interrupted; follow the folder again (without --new) to resume)" in out
    assert "Traceback" not in err
    run = newest_run(session_factory)
    assert run is not None
    assert (run.status, run.current_step) == (RunStatus.cancelled, 3)
    assert run.finished_at is not None

    for step in (4, 5):
        write_step(host, folder, step)
    host._shutdown_dump_executor()
    use_database(monkeypatch, session_factory, tmp_path)
    assert main(follow_args(folder, "--idle", "0.5")) == 0
    again = newest_run(session_factory)
    assert again is not None and (again.id, again.status) == (run.id, RunStatus.completed)
    assert recorded(session_factory) == [1, 2, 3, 4, 5]


def test_a_trainer_starting_over_in_the_folder_is_a_new_run(
    session_factory: sessionmaker[Session],
    dumps: Dumps,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """verl run again with the same rollout_data_dir writes step 1 anew: resuming the old run
    would record nothing of it, so the follower refuses and --new starts a new run."""
    import os

    from rollout_lens.cli import main

    use_database(monkeypatch, session_factory, tmp_path)
    assert main(follow_args(dumps.rollout, "--idle", "0.3")) == 0
    host = verl_dump.trainer()
    first = write_step(host, dumps.rollout, 1)
    host._shutdown_dump_executor()
    later = time.time() + 120  # written again two minutes after the follower recorded it
    os.utime(first, (later, later))
    assert main(follow_args(dumps.rollout, "--idle", "0.3")) == 2
    assert "the trainer started over in this folder. Pass --new" in capsys.readouterr().err
    assert main(follow_args(dumps.rollout, "--idle", "0.3", "--new")) == 0
    assert run_count(session_factory) == 2 and recorded(session_factory) == [1, 2, 3, 4, 5]
