"""A user's script's steps are judged in the training process (the user's functions, lambdas
included, stay there) and read in the writer's own process (trainer/recorder/reading.py): the
reading holds no GIL of the training process, and that process loads no torch. Where the reader
cannot reach it, the steps are read in the training process as before; a step that cannot be
read is dropped alone; one the budget lightens keeps its mean reward. A launched run's steps are
judged on the training thread (the task's judge) and read in its writer's process (or on its
writer's thread, where it writes from one)."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rollout_lens.server.core.records import ControlProbs, RolloutRecord
from rollout_lens.trainer.recorder.judging import Judgement
from rollout_lens.trainer.recorder.reading import JudgedStep, Sample, StepReader, Verdict
from rollout_lens.trainer.recorder.sink_process import ProcessSink
from transformers import TrainerCallback

from tests import user_script as us
from tests.factories import load_run, script_writer
from tests.waiting import until

pytestmark = pytest.mark.slow


class _Reads:
    """Counts StepReader.complete's calls on judged steps in this (the training) process, and
    the threads they ran on."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.judged = 0
        self.threads: set[str] = set()
        complete = StepReader.complete

        def counted(reader: StepReader, step: Any) -> Any:
            if isinstance(step, JudgedStep):
                self.judged += 1
                self.threads.add(threading.current_thread().name)
            return complete(reader, step)

        monkeypatch.setattr(StepReader, "complete", counted)


class _ChildMaps(TrainerCallback):
    """At the last step: the writer's child process, once it has written a step, and its maps."""

    def __init__(self, recorder: Any) -> None:
        self.recorder = recorder
        self.pid: int | None = None
        self.maps = ""

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if state.global_step != state.max_steps:
            return
        writer = self.recorder.sink
        until(lambda: writer.written_steps >= 1, "a step written", timeout=60)
        sink = writer.sink
        assert isinstance(sink, ProcessSink) and sink._child is not None  # noqa: SLF001
        self.pid = sink._child.pid  # noqa: SLF001
        self.maps = Path(f"/proc/{self.pid}/maps").read_text()


def _record(model_dir: Path, tmp_path: Path, **recorder: Any) -> tuple[Any, _ChildMaps, str]:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from rollout_lens import RolloutLensCallback

    url = f"sqlite:///{tmp_path / 'lens.db'}"
    callback = RolloutLensCallback(project="reading", database_url=url, **recorder)
    maps = _ChildMaps(callback)
    trainer = GRPOTrainer(
        model=str(model_dir),
        reward_funcs=[us.says_the_color],
        args=GRPOConfig(
            output_dir=str(tmp_path / "out"),
            max_completion_length=8,
            num_generations=4,
            per_device_train_batch_size=8,
            max_steps=3,
            report_to="none",
            use_cpu=True,
            save_strategy="no",
            disable_tqdm=True,
        ),
        train_dataset=Dataset.from_list(us.questions(32)),
        callbacks=[callback, maps],
    )
    trainer.train()
    return trainer, maps, url


def _assert_read(url: str, model_dir: Path) -> list[dict[str, Any]]:
    """The run as a reading of its steps makes it: each rollout's pieces the tokenizer's own,
    its place in its group, the votes of the user's function, the step's mean reward."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    run, rows, steps, _ = load_run(url, 1)
    assert run.status == "completed" and [s.step for s in steps] == [1, 2, 3]
    assert len(rows) == 3 * 8
    for r in rows:
        assert r["tokens"] == tokenizer.convert_ids_to_tokens(r["completion_ids"])
        assert r["vote"] == next((c for c in us.COLORS if c in r["completion"]), None)
        assert r["meta"]["rewards"]["says_the_color"] == r["verifier_reward"]
    for s in steps:
        mine = [r["verifier_reward"] for r in rows if r["step"] == s.step]
        assert s.reward_mean == pytest.approx(sum(mine) / len(mine))
        assert sorted((r["group"], r["index"]) for r in rows if r["step"] == s.step) == [
            (g, i) for g in range(2) for i in range(4)
        ]
    return rows


def test_a_scripts_steps_are_read_in_the_writer_process_and_judged_in_the_script(
    user_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = _Reads(monkeypatch)
    # a lambda of the script: it never leaves the training process (it would not pickle)
    vote = lambda text, row: next((c for c in us.COLORS if c in text), None)  # noqa: E731
    _, maps, url = _record(user_model_dir, tmp_path, vote=vote)
    assert reads.judged == 0  # no step was read here
    assert maps.pid is not None and maps.pid != os.getpid()
    assert "libtorch" not in maps.maps  # the child that read them loaded no torch
    _assert_read(url, user_model_dir)


def test_a_reader_that_cannot_reach_the_writer_process_reads_in_the_script(
    user_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="rollout_lens")
    reads = _Reads(monkeypatch)

    def no_pickle(self: StepReader) -> None:
        raise TypeError("cannot pickle this tokenizer")

    monkeypatch.setattr(StepReader, "__getstate__", no_pickle)
    vote = lambda text, row: next((c for c in us.COLORS if c in text), None)  # noqa: E731
    _, _, url = _record(user_model_dir, tmp_path, vote=vote)
    assert reads.judged == 3  # each step read here, on the writer's thread
    assert "steps are read in the training process" in caplog.text
    assert "cannot pickle this tokenizer" in caplog.text
    _assert_read(url, user_model_dir)


def _judged(reader: StepReader, step: int, rewards: list[float]) -> JudgedStep:
    """A judged step of one group (`rewards` a rollout), as StepPreparer.judged hands it over."""
    samples, verdicts = [], []
    for i, reward in enumerate(rewards):
        ids = np.array([5 + i, 6, 7])
        record = RolloutRecord.captured(
            completion_ids=ids,
            token_logprobs=np.full(3, -0.5),
            control_probs=ControlProbs(reader.control_tokens, np.zeros((0, 0))),
            verifier_reward=reward,
            advantage=0.0,
        )
        samples.append(Sample(record, "a prompt", "red", {}, [reward], {}))
        verdicts.append(Verdict("red", False, Judgement(vote="red"), None))
    return JudgedStep(
        step=step,
        rollout_step=step,
        values={},
        rollouts=[s.record for s in samples],
        samples=samples,
        verdicts=verdicts,
        raw={"wall_time": 0.1, "logs": {"loss": 0.25}},
        kept={"reward_mean": sum(rewards) / len(rewards)},
    )


def _reader(model_dir: Path) -> StepReader:
    from transformers import AutoTokenizer

    return StepReader(
        AutoTokenizer.from_pretrained(model_dir),
        group_size=4,
        reward_names=["says_the_color"],
        template_kwargs={},
        scored=False,
        tool_calling=False,
        unjudged=False,
        vote_given=True,
        formats=[],
        end_tokens=[],
        control_tokens=[],
        watched=[],
    )


def test_a_step_that_cannot_be_read_is_dropped_alone(
    user_model_dir: Path, sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="rollout_lens")
    reader = _reader(user_model_dir)
    broken = _judged(reader, 2, [1.0, 0.0, 1.0, 0.0])
    broken.verdicts = broken.verdicts[:3]  # a verdict short: the child's reading raises
    writer = script_writer(sqlite_url, "unread", total_steps=3, process=True, reader=reader)
    for step in (_judged(reader, 1, [1.0, 1.0, 0.0, 0.0]), broken, _judged(reader, 3, [0.0] * 4)):
        writer.put(step)
    assert writer.close() is True
    run, rows, steps, _ = load_run(sqlite_url, writer.run_id)
    assert [s.step for s in steps] == [1, 3] and run.dropped_steps == 1
    assert [s.reward_mean for s in steps] == [0.5, 0.0] and [s.loss for s in steps] == [0.25] * 2
    assert sorted(r["tokens"][0] for r in rows if r["step"] == 1) == sorted(
        reader.tokenizer.convert_ids_to_tokens([5, 6, 7, 8])
    )
    assert "could not prepare step 2" in caplog.text


def test_a_judged_step_the_budget_lightens_keeps_its_mean_reward(user_model_dir: Path) -> None:
    reader = _reader(user_model_dir)
    step = _judged(reader, 4, [1.0, 0.0, 0.0, 0.0])
    step.rollouts = []  # as the writer's budget takes them: the Samples go with them
    assert step.samples == [] and step.verdicts == [] and step.text_bytes == 0
    record = reader.complete(step)
    assert record.rollouts == [] and record.values["reward_mean"] == 0.25
    assert record.values["loss"] == 0.25 and record.values["wall_time"] == 0.1


def test_a_launched_runs_steps_are_read_in_its_writers_process(
    train_settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollout_lens.server.core.records import StepRecord
    from rollout_lens.server.core.runconfig import RunConfig
    from rollout_lens.trainer.worker.run import train

    reads = _Reads(monkeypatch)
    handed: list[Any] = []  # what the worker's on_step (the CLI's progress bar) is handed
    run_id = train(
        RunConfig(steps=3, group_size=8, seed=1), settings=train_settings, on_step=handed.append
    )
    assert reads.judged == 0, reads.threads  # none read in the training process
    # the progress bar gets each step as written: its number and values, read in the writer's
    # process (its rollouts stay there)
    assert [type(r) for r in handed] == [StepRecord] * 3 and [r.step for r in handed] == [1, 2, 3]
    assert all(r.values["reward_mean"] is not None and not r.rollouts for r in handed)
    run, rows, steps, _ = load_run(train_settings.database_url, run_id)
    assert run.status == "completed" and [s.step for s in steps] == [1, 2, 3]
    assert all(r["tokens"] and r["format_state"] for r in rows) and len(rows) == 24
    for s, r in zip(steps, handed, strict=True):
        assert s.reward_mean == pytest.approx(r.values["reward_mean"])


def test_a_launched_run_writing_from_a_thread_reads_its_steps_there(
    train_settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollout_lens.server.core.runconfig import RunConfig
    from rollout_lens.trainer.worker.run import train

    reads = _Reads(monkeypatch)
    handed: list[Any] = []
    settings = train_settings.model_copy(update={"writer_process": False})
    run_id = train(
        RunConfig(steps=2, group_size=8, seed=1), settings=settings, on_step=handed.append
    )
    assert reads.judged == 2 and all(n.startswith("rollout-lens-writer") for n in reads.threads)
    assert [r.step for r in handed] == [1, 2] and all(len(r.rollouts) == 8 for r in handed)
    _, rows, steps, _ = load_run(train_settings.database_url, run_id)
    assert [s.step for s in steps] == [1, 2] and len(rows) == 16
