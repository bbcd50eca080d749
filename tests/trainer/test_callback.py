"""RolloutLensCallback on an unmodified TRL GRPOTrainer: the user's model, rewards and settings.

The oracle is what the user's own reward function saw, in call order: every generated rollout
must be recorded exactly once, in its group, at its step.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from rollout_lens.server.core.config import Settings
from transformers import AutoTokenizer, TrainerCallback

from bench.tcp_proxy import TcpProxy, database_proxy
from tests import user_script as us
from tests.factories import load_run
from tests.prompt_lens_support import assert_lens_matches
from tests.waiting import until

pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent


class Seen:
    """A reward function that remembers every (prompt, completion) it scored, in order."""

    __name__ = "says_the_color"

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, prompts: list[Any], completions: list[Any], answer: list[str], **_: Any):
        rewards = us.says_the_color(completions, answer)
        for p, c, r in zip(prompts, completions, rewards, strict=True):
            self.calls.append({"prompt": p, "completion": us._text(c), "reward": r})
        return rewards


def _train(
    model_dir: Path,
    out: Path,
    *,
    callbacks: list[Any],
    rewards: list[Any],
    conversational: bool = False,
    **config: Any,
):  # type: ignore[no-untyped-def]
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    rows = us.questions(64)
    args = GRPOConfig(
        output_dir=str(out),
        max_completion_length=8,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        **config,
    )
    trainer = GRPOTrainer(
        model=str(model_dir),
        reward_funcs=rewards,
        args=args,
        train_dataset=Dataset.from_list(us.conversational(rows) if conversational else rows),
        callbacks=callbacks,
    )
    trainer.train()
    return trainer


def _run_id(url: str) -> int:
    from rollout_lens.server import store
    from rollout_lens.server.store.db import make_engine, make_session_factory, session_scope

    engine = make_engine(url)
    with session_scope(make_session_factory(engine)) as session:
        runs = store.list_runs(session)
    engine.dispose()
    assert len(runs) == 1
    return runs[0].id


def _assert_matches_oracle(rows: list[dict], seen: list[dict], group_size: int) -> None:
    """Recorded rollouts, in (step, group, index) order, are exactly what the rewards saw."""
    ordered = sorted(rows, key=lambda r: (r["step"], r["group"], r["index"]))
    assert [r["completion"] for r in ordered] == [s["completion"] for s in seen]
    assert len({(r["step"], r["group"], r["index"]) for r in rows}) == len(rows)
    for r, s in zip(ordered, seen, strict=True):
        assert r["meta"]["rewards"]["says_the_color"] == s["reward"]
    groups: dict[tuple[int, int], list[dict]] = {}
    for r in ordered:
        groups.setdefault((r["step"], r["group"]), []).append(r)
    for members in groups.values():
        assert [m["index"] for m in members] == list(range(group_size))
        assert len({m["prompt"] for m in members}) == 1  # a group is one prompt


def test_one_line_records_every_rollout_once(user_model_dir: Path, tmp_path: Path) -> None:
    from rollout_lens import RolloutLensCallback

    url = f"sqlite:///{tmp_path / 'lens.db'}"
    seen = Seen()
    trainer = _train(
        user_model_dir,
        tmp_path / "out",
        callbacks=[
            RolloutLensCallback(
                project="colors",
                database_url=url,
                true_score=lambda text, row: float(row["answer"] in text),
                vote=lambda text, row: next((c for c in us.COLORS if c in text), None),
            )
        ],
        rewards=[seen],
        conversational=True,
        num_generations=4,
        per_device_train_batch_size=8,
        logging_steps=2,
        num_iterations=2,
        max_steps=6,
    )
    run, rows, steps, series = load_run(url, _run_id(url))

    assert run.source == "callback" and run.status == "completed" and run.name == "colors/out"
    assert run.group_size == 4 and run.total_steps == 6 and run.current_step == 6
    # the GRPOConfig as given (its own `project` too); the callback's facts beside it
    assert run.config["num_iterations"] == 2 and run.config["project"] != "colors"
    assert run.config["rollout_lens"]["project"] == "colors"
    assert run.control_tokens == ["<|im_end|>"]
    assert [s.step for s in steps] == [1, 2, 3, 4, 5, 6]
    # num_iterations=2: a generation every other step, reused (not re-recorded) by the next one
    assert [s.rollout_step for s in steps] == [1, 1, 3, 3, 5, 5]
    assert sorted({r["step"] for r in rows}) == [1, 3, 5]
    assert len(rows) == len(seen.calls) == 3 * 8
    _assert_matches_oracle(rows, seen.calls, group_size=4)
    # logging_steps=2: TRL's loss lands on the steps it was logged at, nothing is lost between
    assert [s.loss is not None for s in steps] == [False, True] * 3
    assert [step for step, _ in series["trl/reward"]] == [2, 4, 6]
    tokenizer = AutoTokenizer.from_pretrained(user_model_dir)
    for r in rows:
        n = len(r["completion_ids"])
        # each token's piece as the tokenizer names it (read from the preparer's table of pieces)
        assert r["token_pieces"] == tokenizer.convert_ids_to_tokens(r["completion_ids"])
        assert r["prompt"].startswith("<|im_start|>user\nsay the color")  # chat template applied
        assert len(r["token_logprobs"]) == n and all(lp <= 0 for lp in r["token_logprobs"])
        assert r["sum_logprob"] == pytest.approx(
            sum(r["token_logprobs"]), rel=1e-3, abs=2e-3
        )  # float16 tokens
        probs = r["control_token_probs"]["<|im_end|>"]
        assert len(probs) == n and all(0.0 <= p <= 1.0 for p in probs)
        assert r["true_score"] == float(r["meta"]["row"]["answer"] in r["completion"])
        assert r["verifier_reward"] == r["meta"]["rewards"]["says_the_color"]
    for step in (1, 3, 5):
        group_rows = [r for r in rows if r["step"] == step]
        accuracy = sum(r["true_score"] for r in group_rows) / len(group_rows)
        assert steps[step - 1].true_accuracy == pytest.approx(accuracy)
        assert steps[step].true_accuracy == steps[step - 1].true_accuracy  # the reused step
    assert trainer.state.global_step == 6
    assert_lens_matches(url, run.id)  # the prompt lens of a callback's run: the oracle's


def test_second_reward_and_gradient_accumulation(user_model_dir: Path, tmp_path: Path) -> None:
    from rollout_lens import RolloutLensCallback

    url = f"sqlite:///{tmp_path / 'lens.db'}"
    seen = Seen()
    _train(
        user_model_dir,
        tmp_path / "out",
        callbacks=[RolloutLensCallback(project="colors", database_url=url)],
        rewards=[seen, us.is_short],
        num_generations=4,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=3,
    )
    run, rows, steps, _ = load_run(url, _run_id(url))

    assert [s.step for s in steps] == [1, 2, 3] and [s.rollout_step for s in steps] == [1, 2, 3]
    assert len(rows) == len(seen.calls) == 3 * 8  # 2 micro-batches of 4 per optimizer step
    _assert_matches_oracle(rows, seen.calls, group_size=4)
    for r in rows:
        assert set(r["meta"]["rewards"]) == {"says_the_color", "is_short"}
        assert r["verifier_reward"] == pytest.approx(sum(r["meta"]["rewards"].values()))
        assert r["true_score"] is None  # no true_score function: not known, not guessed
    assert all(s.true_accuracy is None and s.vote_agreement is None for s in steps)
    assert "no true_score function given" in " ".join(run.notes)


class _Outage(TrainerCallback):
    """Takes the database away and back at chosen steps (listed before the recorder)."""

    def __init__(self, proxy: TcpProxy, url: str, *, up_at: set[int], down_at: set[int]) -> None:
        self.proxy, self.url, self.up_at, self.down_at = proxy, url, up_at, down_at
        self.written_before_down: list[int] = []
        self.turned_away = 0  # the proxy's count when it last went down
        self.before_back: Callable[[], bool] = lambda: True  # what must be true before the end

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if state.global_step in self.up_at:
            # back once the recorder has found it away (its writer process may take longer to
            # start than the steps before this one: a database back first was never away)
            until(
                lambda: self.proxy.counts.turned_away > self.turned_away,
                "the recorder turned away by the database that is down",
                timeout=60,
            )
            self.proxy.start()
        if state.global_step in self.down_at:
            self.written_before_down = self._wait_for_steps()
            self.turned_away = self.proxy.counts.turned_away
            self.proxy.stop()

    def on_train_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if not self.proxy.up:
            until(self.before_back, "every step handed over to wait in the budget", timeout=60)
            self.proxy.start()

    def _wait_for_steps(self) -> list[int]:
        """The database came back mid-run: wait until the recorder has caught up on it."""
        import time

        from sqlalchemy import create_engine, text

        engine = create_engine(self.url)
        deadline = time.monotonic() + 60
        try:
            while time.monotonic() < deadline:
                try:
                    with engine.connect() as conn:
                        steps = [s for (s,) in conn.execute(text("SELECT step FROM steps"))]
                    if steps:
                        return sorted(steps)
                except Exception:  # noqa: BLE001 - not there yet
                    pass
                time.sleep(0.2)
            return []
        finally:
            engine.dispose()


# Cutting the database's connections under the driver (the point of these tests) can leave a
# half-open psycopg connection for the garbage collector, which warns about it.
_CUT_CONNECTIONS = pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnraisableExceptionWarning", "ignore::ResourceWarning"
)


@_CUT_CONNECTIONS
@pytest.mark.postgres
def test_database_down_at_start_and_mid_run(
    user_model_dir: Path, tmp_path: Path, pg_database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    from rollout_lens.server.store.db import make_engine
    from rollout_lens.server.store.migrate import upgrade

    from rollout_lens import RolloutLensCallback

    upgrade(make_engine(pg_database_url))  # the session's database, emptied below
    proxy, via_proxy = database_proxy(pg_database_url)
    _empty(pg_database_url)
    outage = _Outage(proxy, via_proxy, up_at={3, 6}, down_at={4})
    seen = Seen()
    caplog.set_level(logging.WARNING, logger="rollout_lens")
    try:
        trainer = _train(
            user_model_dir,
            tmp_path / "out",
            callbacks=[outage, RolloutLensCallback(project="outage", database_url=via_proxy)],
            rewards=[seen],
            num_generations=4,
            per_device_train_batch_size=8,
            max_steps=8,
        )
    finally:
        proxy.close()
    assert trainer.state.global_step == 8  # training never stopped

    run, rows, steps, _ = load_run(pg_database_url, _run_id(pg_database_url))
    assert outage.written_before_down  # the database came back mid-run and got the kept steps
    assert [s.step for s in steps] == list(range(1, 9))  # nothing lost ...
    assert len(rows) == len(seen.calls) == 8 * 8  # ... nothing twice
    _assert_matches_oracle(rows, seen.calls, group_size=4)
    assert run.status == "completed" and run.dropped_steps == 0 and run.dropped_rollouts == 0
    said = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
    assert 1 <= len(said) <= 2  # once per outage, not once per step
    assert "training goes on" in said[0]


@_CUT_CONNECTIONS
@pytest.mark.postgres
# In both of the writer's places: a thread of the training process, and its child (the default).
@pytest.mark.parametrize("process", [False, True], ids=["thread", "child"])
def test_bounded_buffer_drops_rollouts_first_and_counts_them(
    user_model_dir: Path,
    tmp_path: Path,
    pg_database_url: str,
    caplog: pytest.LogCaptureFixture,
    process: bool,
) -> None:
    from rollout_lens.server.core.config import get_settings

    from rollout_lens import RolloutLensCallback

    caplog.set_level(logging.INFO, logger="rollout_lens")
    settings = get_settings().model_copy(update={"writer_process": process})

    proxy, via_proxy = database_proxy(pg_database_url)
    _empty(pg_database_url)
    outage = _Outage(proxy, via_proxy, up_at=set(), down_at=set())  # back only at the end
    recorder = RolloutLensCallback(
        project="tight", database_url=via_proxy, buffer_mb=0.02, settings=settings
    )
    # The database comes back only once every step handed over waits in the budget: training (a
    # second) can end before the writer's first try, as when its child process is slow to start.
    # Back before that, step 1 (taken before the child's start) was written whole, then steps 2-6
    # came out of the inbox together, and the budget dropped 2-5's rollouts: CI's [1, 6].
    outage.before_back = lambda: recorder.sink is None or not recorder.sink.backlog.inbox
    seen = Seen()
    try:
        _train(
            user_model_dir,
            tmp_path / "out",
            callbacks=[outage, recorder],
            rewards=[seen],
            num_generations=4,
            per_device_train_batch_size=8,
            max_steps=6,
        )
    finally:
        proxy.close()
    run, rows, steps, _ = load_run(pg_database_url, _run_id(pg_database_url))

    said = [r.getMessage() for r in caplog.records if r.name == "rollout_lens"]
    # every step's values were kept
    assert [s.step for s in steps] == list(range(1, 7)), (run.dropped_steps, said)
    assert all(s.reward_mean is not None for s in steps)
    assert 0 < run.dropped_rollouts < len(seen.calls)
    assert len(rows) == len(seen.calls) - run.dropped_rollouts
    kept_steps = sorted({r["step"] for r in rows})
    assert kept_steps == list(range(kept_steps[0], 7))  # the oldest steps lost theirs first


class _Hang(TrainerCallback):
    """Holds the database's link (bench/tcp_proxy.py: nothing reset, nothing answered) once
    step 1 is written, until the end of training (listed before the recorder, which hands a
    step over at the next one's end: step 1 at step 2's, so the hold comes at step 3's)."""

    def __init__(self, proxy: TcpProxy, recorder: Any) -> None:
        self.proxy, self.recorder = proxy, recorder
        self.during: tuple[int, int, int] | None = None  # written, dropped rollouts, steps

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if state.global_step == 3:
            # the writer's own count: step 1's row can be in the database while its answer
            # (and its search index, a second transaction) is still on the way (CI5)
            until(lambda: self.recorder.sink.written_steps >= 1, "step 1 written", timeout=60)
            self.proxy.hold()

    def on_train_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        sink = self.recorder.sink
        self.during = (sink.written_steps, sink.dropped_rollouts, sink.dropped_steps)
        self.proxy.release()


@_CUT_CONNECTIONS
@pytest.mark.postgres
def test_a_hung_database_link_keeps_the_budget_and_every_steps_reward(
    user_model_dir: Path, tmp_path: Path, pg_database_url: str
) -> None:
    """The writer's child waits on a write that never returns while training goes on: the
    steps handed over meanwhile lose their rollouts past the budget at `put` (the callback's
    `lighten`), keeping their mean reward and TRL's logs; once the link is back every step is
    written, and what was dropped is counted on the run."""
    from rollout_lens import RolloutLensCallback

    proxy, via_proxy = database_proxy(pg_database_url)
    proxy.start()
    _empty(pg_database_url)
    # 12 KB: under three of these steps as the writer holds them (judged: about 4.8 KB each), so
    # that the steps handed over during the hang lose rollouts; over five lightened ones (2 KB
    # each), so that none goes whole, whether the writer took step 2 before the hold or not
    recorder = RolloutLensCallback(project="hung", database_url=via_proxy, buffer_mb=0.012)
    hang = _Hang(proxy, recorder)
    seen = Seen()
    try:
        _train(
            user_model_dir,
            tmp_path / "out",
            callbacks=[hang, recorder],
            rewards=[seen, us.is_short],
            num_generations=4,
            per_device_train_batch_size=8,
            max_steps=6,
        )
    finally:
        proxy.close()
    run, rows, steps, _ = load_run(pg_database_url, _run_id(pg_database_url))

    # during the hang: step 1 written, steps 3-5 handed over while step 2's write waited (or 2-5
    # while it waited to be taken), the oldest of them lightened at `put`
    assert hang.during is not None
    written, dropped, whole = hang.during
    assert written == 1 and dropped >= 8 and whole == 0, hang.during
    assert [s.step for s in steps] == list(range(1, 7))
    assert run.dropped_steps == 0 and 0 < run.dropped_rollouts < len(seen.calls)
    assert run.dropped_rollouts % 8 == 0  # whole steps' rollouts
    assert len(rows) == len(seen.calls) - run.dropped_rollouts
    for s in steps:  # the mean reward of every step, lightened or not: the rewards' own
        calls = seen.calls[8 * (s.step - 1) : 8 * s.step]
        short = us.is_short([c["completion"] for c in calls])
        oracle = sum(c["reward"] + b for c, b in zip(calls, short, strict=True)) / 8
        assert s.reward_mean == pytest.approx(oracle), s.step


def _empty(url: str) -> None:
    from rollout_lens.server.store.db import make_engine
    from rollout_lens.server.store.migrate import upgrade
    from sqlalchemy import text

    engine = make_engine(url)
    upgrade(engine)
    with engine.begin() as conn:
        conn.execute(
            text(
                "TRUNCATE runs, steps, rollouts, prompts, facts, run_tokens, rollups, alerts RESTART IDENTITY CASCADE"
            )
        )
    engine.dispose()


def _user_folder(tmp_path: Path) -> Path:
    return us.project_folder(tmp_path / "project")


def _script_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_LENS_")}
    env.pop("PYTHONPATH", None)
    return env


def test_a_script_that_dies_keeps_what_it_recorded(user_model_dir: Path, tmp_path: Path) -> None:
    folder = _user_folder(tmp_path)
    url = f"sqlite:///{tmp_path / 'lens.db'}"
    out = tmp_path / "out"
    out.mkdir()
    done = subprocess.run(
        [sys.executable, "user_grpo.py", "--model", str(user_model_dir), "--out", str(out)]
        + ["--db", url, "--steps", "6", "--crash-at", "3"],
        cwd=folder,
        env=_script_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode != 0 and "broke at step 3" in done.stderr
    run, rows, steps, _ = load_run(url, _run_id(url))
    assert run.status == "failed" and "stopped before the end of training" in (run.error or "")
    assert [s.step for s in steps] == [1, 2, 3] and len(rows) == 3 * 8
    # Run as a user runs it, from their project folder, whose own trainer.py and server.py
    # (user_script.project_folder) would end the script if they shadowed ours: what the script's
    # rewards saw, every step it finished.
    seen = [json.loads(line) for line in (out / "seen-0.jsonl").read_text().splitlines()]
    _assert_matches_oracle(rows, seen, group_size=4)


def test_accelerate_two_processes_recorded_once_by_the_main_one(
    user_model_dir: Path, tmp_path: Path
) -> None:
    """Data-parallel GRPO on the gloo backend: each process generates half of every step; the
    main process records all of it once, with TRL's groups (which may span processes)."""
    folder = _user_folder(tmp_path)
    url = f"sqlite:///{tmp_path / 'lens.db'}"
    out = tmp_path / "out"
    out.mkdir()
    accelerate = Path(sys.executable).parent / "accelerate"
    result = subprocess.run(
        [str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1"]
        + ["--mixed_precision", "no", "--dynamo_backend", "no"]
        + ["--main_process_port", str(_free_port())]
        + ["user_grpo.py", "--model", str(user_model_dir), "--out", str(out), "--db", url]
        + ["--steps", "3", "--batch", "2"],
        cwd=folder,
        env=_script_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run, rows, steps, _ = load_run(url, _run_id(url))
    per_rank = [
        [json.loads(line) for line in (out / f"seen-{rank}.jsonl").read_text().splitlines()]
        for rank in (0, 1)
    ]
    assert run.prompts_per_step == 1 and run.device.startswith("cpu")
    assert [s.step for s in steps] == [1, 2, 3]
    assert len(rows) == sum(len(s) for s in per_rank) == 3 * 4  # once, not once per process
    # batch 2 per process, groups of 4: each group spans both processes, rank 0's half first
    by_step = [per_rank[0][2 * i : 2 * i + 2] + per_rank[1][2 * i : 2 * i + 2] for i in range(3)]
    _assert_matches_oracle(rows, [s for step in by_step for s in step], group_size=4)
    assert all(not math.isnan(r["advantage"]) for r in rows)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    from rollout_lens import RolloutLensCallback

    monkeypatch.setenv("ROLLOUT_LENS_DATA_DIR", str(tmp_path))
    callback = RolloutLensCallback(project="p")
    assert callback.database_url == Settings(data_dir=tmp_path).database_url
    assert callback.database_url.endswith(str(tmp_path / "rollout-lens.db"))
