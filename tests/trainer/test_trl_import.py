"""`import-trl`: a run from the completions parquet files a real TRL GRPOTrainer wrote (trained
here: this layer's), on both databases as the store layer's tests are."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from rollout_lens.server import store
from rollout_lens.server.core.errors import InvalidInput
from rollout_lens.server.exchange.dump_import import import_dumps
from rollout_lens.server.exchange.trl_import import TrlDump
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.store.models import RunRow, RunSource, RunStatus
from rollout_lens.server.store.serialize import rollout_dict
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from tests import user_script as us
from tests.prompt_lens_support import assert_matches_oracle

pytestmark = pytest.mark.slow

REWARDS = ["says_the_color", "is_short"]
# The trainer layer runs on SQLite alone unless a test names the databases (tests/conftest.py).
BOTH_DATABASES = pytest.mark.parametrize(
    "engine", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)


@pytest.fixture(scope="module")
def trl_output(user_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output_dir of a real 4-step GRPO run with log_completions=True (about 8 s on CPU)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    out = tmp_path_factory.mktemp("trl") / "out"
    args = GRPOConfig(
        output_dir=str(out),
        num_generations=4,
        per_device_train_batch_size=8,
        max_steps=4,
        logging_steps=1,
        max_completion_length=8,
        report_to="none",
        log_completions=True,
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        # As trainer/worker/run.py: GRPOConfig's default gradient checkpointing goes through names
        # transformers 5 deprecates (FutureWarnings, errors under pytest), and buys nothing here.
        activation_checkpointing=False,
    )
    GRPOTrainer(
        model=str(user_model_dir),
        reward_funcs=[us.says_the_color, us.is_short],
        args=args,
        train_dataset=Dataset.from_list(us.questions(64)),
    ).train()
    return out


def _rows(output: Path) -> list[dict]:
    """Every row TRL wrote, in file order."""
    files = sorted((output / "completions").glob("completions_*.parquet"))
    return [row for f in files for row in pq.read_table(f).to_pylist()]


def _runs(factory: sessionmaker[Session]) -> int:
    with session_scope(factory) as session:
        return int(session.scalar(select(func.count()).select_from(RunRow)) or 0)


@BOTH_DATABASES
def test_a_real_trl_run_becomes_a_run(
    session_factory: sessionmaker[Session], trl_output: Path
) -> None:
    written = _rows(trl_output)
    done = import_dumps(session_factory, TrlDump(trl_output, name="my trl run"), settle=0)
    assert (done.steps, done.rollouts) == (4, len(written))
    with session_scope(session_factory) as session:
        run = store.get_run(session, run_id=done.run_id)
        assert (run.source, run.status, run.name) == (
            RunSource.trl_import,
            RunStatus.completed,
            "my trl run",
        )
        assert (run.group_size, run.total_steps, run.current_step) == (4, 4, 4)
        assert run.prompts_per_step == 2  # 8 rows a step: what the alert rules' windows use
        assert run.config["reward_columns"] == REWARDS
        assert any("num_generations 4: detected" in note for note in run.notes)
        steps = store.steps(session, run_id=done.run_id)
        assert [s.step for s in steps] == sorted({r["step"] for r in written})
        rollouts = [
            rollout_dict(r, p, []) for r, p in store.iter_rollouts(session, run_id=done.run_id)
        ]
        series = store.metric_series(session, run_id=done.run_id)

    # Every row kept, in order, with its rewards by name, their sum and its advantage.
    assert [(r["prompt"], r["completion"], r["advantage"]) for r in rollouts] == [
        (w["prompt"], w["completion"], w["advantage"]) for w in written
    ]
    assert [r["meta"]["rewards"] for r in rollouts] == [
        {name: w[name] for name in REWARDS} for w in written
    ]
    assert all(
        r["verifier_reward"] == pytest.approx(sum(r["meta"]["rewards"].values())) for r in rollouts
    )
    # Groups of num_generations identical prompts.
    groups: dict[tuple[int, int], list[dict]] = {}
    for r in rollouts:
        groups.setdefault((r["step"], r["group"]), []).append(r)
    assert all(len(g) == 4 and len({r["prompt"] for r in g}) == 1 for g in groups.values())
    assert [r["index"] for r in rollouts[:8]] == [0, 1, 2, 3, 0, 1, 2, 3]
    # Per-step series from the rows: mean reward and each reward function's mean.
    first = [r for r in rollouts if r["step"] == steps[0].step]
    assert steps[0].reward_mean == pytest.approx(
        sum(r["verifier_reward"] for r in first) / len(first)
    )
    assert set(series) == {f"rewards/{name}/mean" for name in REWARDS}
    lens = assert_matches_oracle(session_factory, done.run_id)
    assert len(lens) == len({r["prompt"] for r in rollouts})


@BOTH_DATABASES
def test_num_generations_can_be_given_and_must_fit(
    session_factory: sessionmaker[Session], trl_output: Path
) -> None:
    done = import_dumps(session_factory, TrlDump(trl_output, num_generations=2), settle=0)
    with session_scope(session_factory) as session:
        assert store.get_run(session, run_id=done.run_id).group_size == 2
        groups = {(r.step, r.group) for r, _ in store.iter_rollouts(session, run_id=done.run_id)}
    assert len(groups) == done.rollouts // 2
    with pytest.raises(InvalidInput, match="not a multiple of num_generations 3"):
        import_dumps(session_factory, TrlDump(trl_output, num_generations=3), settle=0)
    assert _runs(session_factory) == 1


def _copy(trl_output: Path, into: Path) -> Path:
    shutil.copytree(trl_output / "completions", into / "completions")
    return into


@BOTH_DATABASES
@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("no files", "no completions/completions_NNNNN.parquet files"),
        ("a file without advantages", "no column advantage"),
        ("a corrupt file", "not a readable Parquet file"),
        ("a file of two steps", "one step per file expected"),
    ],
)
def test_a_damaged_output_dir_creates_nothing(
    session_factory: sessionmaker[Session],
    trl_output: Path,
    tmp_path: Path,
    damage: str,
    message: str,
) -> None:
    out = _copy(trl_output, tmp_path / "out")
    files = sorted((out / "completions").glob("*.parquet"))
    last = files[-1]
    if damage == "no files":
        for f in files:
            f.unlink()
    elif damage == "a file without advantages":
        pq.write_table(pq.read_table(last).drop_columns(["advantage"]), last)
    elif damage == "a corrupt file":
        last.write_bytes(last.read_bytes()[:200])
    else:
        table = pq.read_table(last)
        steps = table.column("step").to_pylist()
        steps[-1] += 1
        pq.write_table(table.set_column(0, "step", [steps]), last)
    # settle=0, as in every import here but the followed one: the files are whole, and the
    # default waits 2 s for a file written a moment ago to keep its size (2 s a test).
    with pytest.raises(InvalidInput, match=message):
        import_dumps(session_factory, TrlDump(out), settle=0)
    assert _runs(session_factory) == 0


def test_the_cli_imports_a_trl_output_dir(
    trl_output: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:  # type: ignore[no-untyped-def]
    from rollout_lens.cli import main

    monkeypatch.setenv("ROLLOUT_LENS_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("ROLLOUT_LENS_DATABASE_URL", raising=False)
    assert main(["import-trl", str(trl_output), "--reward", "says_the_color"]) == 0
    assert "4 logged steps" in capsys.readouterr().out
    assert main(["import-trl", str(tmp_path)]) == 2
    assert "no completions/completions_NNNNN.parquet files" in capsys.readouterr().err


@BOTH_DATABASES
def test_the_imported_run_shows_in_the_dashboard(
    session_factory: sessionmaker[Session], trl_output: Path
) -> None:
    from tests.web_support import client_for

    done = import_dumps(session_factory, TrlDump(trl_output, name="from TRL"), settle=0)
    with client_for(session_factory) as client:
        page = client.get(f"/runs/{done.run_id}")
        assert page.status_code == 200 and "from TRL" in page.text
        assert f"/api/runs/{done.run_id}/export?format=parquet" in page.text
        step = client.get(f"/runs/{done.run_id}/steps/1")
        assert step.status_code == 200 and "say the color" in step.text
        series = client.get(f"/api/runs/{done.run_id}/series", params={"full": 1}).json()
    assert series["series"]["reward_mean"]["x"] == [1, 2, 3, 4]
    assert set(series["series"]) >= {f"rewards/{name}/mean" for name in REWARDS}


@BOTH_DATABASES
def test_follow_a_trl_output_dir_while_it_is_written(
    session_factory: sessionmaker[Session],
    trl_output: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`import-trl --follow`: TRL's files appear one by one (one half-written for a while, as
    pandas leaves a Parquet file before its footer), the run is live, --idle completes it."""
    import time

    from rollout_lens.cli import main
    from tests.follow_support import follow_while, half, newest_run, recorded, use_database
    from tests.waiting import until

    use_database(monkeypatch, session_factory, tmp_path)
    files = sorted((trl_output / "completions").glob("completions_*.parquet"))
    out = tmp_path / "out"
    (out / "completions").mkdir(parents=True)
    seen: dict[str, object] = {}

    def trl_trains() -> None:
        for f in files[:2]:
            shutil.copy(f, out / "completions" / f.name)
        until(lambda: len(recorded(session_factory)) == 2, "two steps")
        run = newest_run(session_factory)
        seen["status"] = run.status if run else None
        third = out / "completions" / files[2].name
        third.write_bytes(half(files[2].read_bytes()))
        time.sleep(1.2)
        seen["half"] = len(recorded(session_factory))
        third.write_bytes(files[2].read_bytes())
        shutil.copy(files[3], out / "completions" / files[3].name)

    status = follow_while(
        trl_trains,
        lambda: main(["import-trl", str(out), "--follow", "--idle", "1.5", "--settle", "0.3"]),
    )
    assert status == 0 and "completed (no new step for 1.5 s)" in capsys.readouterr().out
    assert (seen["status"], seen["half"]) == (RunStatus.running, 2)
    run = newest_run(session_factory)
    assert run is not None and (run.status, run.source) == (
        RunStatus.completed,
        RunSource.trl_import,
    )
    assert recorded(session_factory) == sorted({r["step"] for r in _rows(trl_output)})
    with session_scope(session_factory) as session:
        count = sum(1 for _ in store.iter_rollouts(session, run_id=run.id))
    assert count == len(_rows(trl_output))
    assert_matches_oracle(session_factory, run.id)
    # Again on the same folder: the run is resumed after its last step, nothing recorded twice.
    again = ["import-trl", str(out), "--follow", "--idle", "0.3", "--settle", "0.3"]
    assert main([*again, "--num-generations", "2"]) == 2
    assert "with --num-generations 4, not 2" in capsys.readouterr().err
    assert main(again) == 0
    assert f"resuming run {run.id}" in capsys.readouterr().err
    assert recorded(session_factory) == sorted({r["step"] for r in _rows(trl_output)})
    resumed = newest_run(session_factory)
    assert resumed is not None and (resumed.id, resumed.status) == (run.id, RunStatus.completed)
