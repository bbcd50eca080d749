"""slime's debug dumps (tests/slime_dump.py writes them with torch.save as slime's own code does)
read without torch: the engine's logprobs from the rollout dump, the trainer's from the train
dump, joined by rollout_position; hostile files refused whole, a pickle that names anything but
plain values and tensors never loaded."""

from __future__ import annotations

import math
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rollout_lens.server import store
from rollout_lens.server.core import mismatch as mm
from rollout_lens.server.core.errors import InvalidInput
from rollout_lens.server.exchange import torch_file
from rollout_lens.server.exchange.dump_import import import_dumps
from rollout_lens.server.exchange.slime_import import SlimeDump, read_step
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.store.models import RunRow, RunSource
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from tests import slime_dump as sd
from tests.factories import rollout_views, run_count, stored_logprobs_match

N = 4  # --n-samples-per-prompt
PROMPTS = ["What is 6 times 7?", "Name the capital of France."]


def _step(folder: Path, rollout_id: int, *, tool: bool, train: bool = True) -> tuple[Any, Any]:
    rng = random.Random(rollout_id)
    samples = sd.rollout(rng, PROMPTS, N, tool)
    sd.save_rollout(folder / "rollout_data" / f"{rollout_id}.pt", rollout_id, samples)
    log_probs = sd.trainer_logprobs(rng, samples, noise=0.2)
    if train:
        sd.save_train(folder / "train_data" / f"{rollout_id}.pt", rollout_id, samples, log_probs)
    return samples, log_probs


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    _step(tmp_path / "dump", 0, tool=False)
    _step(tmp_path / "dump", 1, tool=True)
    sd.save_rollout(tmp_path / "dump" / "rollout_data" / "eval_1.pt", 1, [])  # skipped
    return tmp_path / "dump"


def test_both_sides_are_read(tmp_path: Path) -> None:
    samples, log_probs = _step(tmp_path, 3, tool=True)
    fmt = SlimeDump(tmp_path)
    units = sd.step_units(fmt)
    assert [u.step for u in units] == [4]  # rollout_id 3 is the fourth step
    assert fmt.plan([fmt.check(u) for u in units]).group_size == N
    step = fmt.read(units[0])
    log_r, ratios = [], []
    for k, (sample, rollout) in enumerate(zip(samples, step.record.rollouts, strict=True)):
        n = sample.response_length
        assert (rollout.group, rollout.index) == divmod(k, N)
        assert rollout.completion_ids.tolist() == sample.tokens[-n:]
        assert step.masks[k].tolist() == [bool(v) for v in sample.loss_mask]
        assert step.generator_logprobs[k].tolist() == sample.rollout_log_probs
        trainer = log_probs[k].double().numpy()
        assert rollout.token_logprobs.tolist() == np.where(step.masks[k], trainer, 0.0).tolist()
        assert rollout.target == str(sample.group_index)
        mine = [
            float(t) - g
            for t, g, m in zip(trainer, sample.rollout_log_probs, sample.loss_mask, strict=True)
            if m
        ]
        log_r += mine
        ratios.append(math.exp(math.fsum(mine)))
    figures = step.record.metrics
    assert figures[mm.ABS_DIFF_MAX] == pytest.approx(max(abs(x) for x in log_r))
    assert figures[mm.K3_KL] == pytest.approx(sum(math.exp(x) - 1 - x for x in log_r) / len(log_r))
    assert figures[mm.SEQ_RATIO_MAX] == pytest.approx(max(ratios))


def test_a_slime_run_imports(session_factory: sessionmaker[Session], folder: Path) -> None:
    imported = import_dumps(session_factory, SlimeDump(folder), settle=0)
    assert (imported.steps, imported.rollouts) == (2, 2 * len(PROMPTS) * N)
    with session_scope(session_factory) as session:
        run = session.get(RunRow, imported.run_id)
        assert run is not None and run.source == RunSource.slime_import
        assert set(mm.NAMES) <= set(store.series_names(session, run_id=run.id))
    # the engine's logprobs stored beside the trainer's (NaN where the loss mask is off)
    fmt = SlimeDump(folder)
    units = sd.step_units(fmt)
    fmt.plan([fmt.check(u) for u in units])
    wanted = {}
    for unit in units:
        read = fmt.read(unit)
        for r, engine, mask in zip(
            read.record.rollouts, read.generator_logprobs, read.masks, strict=True
        ):
            wanted[(unit.step, r.group, r.index)] = np.where(mask, engine, math.nan)
    views = rollout_views(session_factory, imported.run_id)
    assert len(views) == len(wanted)
    for view in views:
        want = wanted[(view.step, view.group, view.index)]
        assert view.generator_logprobs is not None and len(want)
        assert stored_logprobs_match(view.generator_logprobs, want)
    assert any(np.isnan(v.generator_logprobs).any() for v in views)  # the tool step's mask


def test_rollout_dumps_alone_have_no_trainer_side(tmp_path: Path) -> None:
    _step(tmp_path, 0, tool=False, train=False)
    samples = read_step(tmp_path / "rollout_data" / "0.pt")
    assert not any(s.trained for s in samples)
    fmt = SlimeDump(tmp_path / "rollout_data")  # --save-debug-rollout-data's folder
    units = sd.step_units(fmt)
    fmt.plan([fmt.check(u) for u in units])
    record = fmt.read(units[0]).record
    assert record.metrics == {}  # nothing to compare: no figures, not zeros
    assert all(len(r.token_logprobs) == 0 for r in record.rollouts)


class _Runs:
    """Pickles as a call to os.system: what a hostile .pt file would hold."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_that_runs_code_is_refused_unrun(tmp_path: Path) -> None:
    import torch

    marker = tmp_path / "ran"
    torch.save({"rollout_id": 0, "samples": [{"x": _Runs(marker)}]}, tmp_path / "0.pt")
    with pytest.raises(InvalidInput, match=r"pickles posix\.system.*refused"):
        torch_file.load(tmp_path / "0.pt")
    assert not marker.exists()


def _ragged(samples: list[Any], log_probs: list[Any]) -> None:
    samples[2].rollout_log_probs = samples[2].rollout_log_probs[:-1]


def _mask(samples: list[Any], log_probs: list[Any]) -> None:
    samples[1].loss_mask = samples[1].loss_mask + [1]


def _nan_trainer(samples: list[Any], log_probs: list[Any]) -> None:
    log_probs[0][1] = float("nan")


def _short_trainer(samples: list[Any], log_probs: list[Any]) -> None:
    log_probs[5] = log_probs[5][:-2]


def _reward_dict(samples: list[Any], log_probs: list[Any]) -> None:
    samples[0].reward = {"acc": 1.0, "format": 0.5}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_ragged, r"0\.pt sample 2: .*differ in length .*rollout_log_probs \d+"),
        (_mask, r"0\.pt sample 1: .*differ in length .*loss_mask \d+"),
        (_nan_trainer, r"log_probs\[1\] is nan, not a logprob"),
        (_short_trainer, r"sample for 5: .*differ in length .*log_probs \d+"),
        (_reward_dict, "sample 0: reward is dict .* --reward-key"),
    ],
)
def test_hostile_dumps_are_refused_and_create_nothing(
    session_factory: sessionmaker[Session], tmp_path: Path, change: Any, message: str
) -> None:
    rng = random.Random(9)
    samples = sd.rollout(rng, PROMPTS, N, tool=True)
    log_probs = sd.trainer_logprobs(rng, samples, noise=0.2)
    change(samples, log_probs)
    sd.save_rollout(tmp_path / "rollout_data" / "0.pt", 0, samples)
    sd.save_train(tmp_path / "train_data" / "0.pt", 0, samples, log_probs)
    with pytest.raises(InvalidInput, match=message):
        import_dumps(session_factory, SlimeDump(tmp_path), settle=0)
    assert run_count(session_factory) == 0


def test_not_a_torch_file(tmp_path: Path) -> None:
    (tmp_path / "0.pt").write_text("samples")
    with pytest.raises(InvalidInput, match="not a file torch.save wrote"):
        torch_file.load(tmp_path / "0.pt")


def test_a_train_dump_naming_another_sample_is_refused(tmp_path: Path) -> None:
    rng = random.Random(2)
    samples = sd.rollout(rng, PROMPTS, N, tool=False)
    sd.save_rollout(tmp_path / "r.pt", 0, samples)
    sd.save_train(
        tmp_path / "t.pt",
        0,
        samples + samples[:1],
        sd.trainer_logprobs(rng, samples + samples[:1], 0.1),
    )
    with pytest.raises(InvalidInput, match="rollout_position 8 does not name one sample of the 8"):
        read_step(tmp_path / "r.pt", [tmp_path / "t.pt"])


@pytest.mark.parametrize(
    "dtype",
    ["float32", "float64", "float16", "bfloat16", "int64", "int32", "bool"],
)
def test_torch_file_reads_tensors_as_torch_does(tmp_path: Path, dtype: str) -> None:
    """Every dtype a slime dump holds, a view at an offset in its storage, nested in plain
    values: equal to what torch.load gives."""
    import torch

    base = torch.arange(12).reshape(3, 4).to(getattr(torch, dtype))
    saved = {"samples": [{"t": base, "view": base[1:], "row": base[2], "x": [1, "a", None]}]}
    torch.save(saved, tmp_path / "x.pt")
    loaded = torch_file.load(tmp_path / "x.pt")
    theirs = torch.load(tmp_path / "x.pt", weights_only=True)["samples"][0]
    for key in ("t", "view", "row"):
        assert loaded["samples"][0][key].tolist() == theirs[key].tolist(), key
    assert loaded["samples"][0]["x"] == [1, "a", None]


def test_a_transposed_tensor_is_refused(tmp_path: Path) -> None:
    import torch

    torch.save({"t": torch.arange(6).reshape(2, 3).T}, tmp_path / "x.pt")
    with pytest.raises(InvalidInput, match="not contiguous"):
        torch_file.load(tmp_path / "x.pt")


def test_a_reward_dict_is_read_by_its_key(tmp_path: Path) -> None:
    """slime's --reward-key: a reward model returning several rewards names the one trained on."""
    rng = random.Random(4)
    samples = sd.rollout(rng, PROMPTS, N, tool=False)
    for s in samples:
        s.reward = {"acc": s.reward, "format": 0.5}
    sd.save_rollout(tmp_path / "rollout_data" / "0.pt", 0, samples)
    sd.save_train(
        tmp_path / "train_data" / "0.pt", 0, samples, sd.trainer_logprobs(rng, samples, 0.1)
    )
    fmt = SlimeDump(tmp_path, reward_key="acc", group_size=N)
    units = sd.step_units(fmt)
    fmt.plan([fmt.check(u) for u in units])
    record = fmt.read(units[0]).record
    assert [r.verifier_reward for r in record.rollouts] == [s.reward["acc"] for s in samples]
    with pytest.raises(InvalidInput, match="reward has no key 'score'"):
        SlimeDump(tmp_path, reward_key="score").check(units[0])


def test_the_cli_imports_a_slime_run(
    session_factory: sessionmaker[Session],
    folder: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from rollout_lens.cli import main
    from tests.follow_support import use_database

    use_database(monkeypatch, session_factory, tmp_path)
    assert main(["import-slime", str(folder), "--settle", "0"]) == 0
    assert f"from {folder}: 2 steps, {2 * len(PROMPTS) * N} rollouts" in capsys.readouterr().out
    with session_scope(session_factory) as session:
        run = session.scalars(select(RunRow)).one()
        assert (run.name, run.source, run.group_size) == (
            f"slime {folder.name}",
            RunSource.slime_import,
            N,
        )
    assert main(["import-slime", str(tmp_path / "nowhere"), "--reward-key", "score"]) == 2
    assert "nowhere" in capsys.readouterr().err
    assert run_count(session_factory) == 1
