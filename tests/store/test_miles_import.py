"""`import-slime` on miles' dumps (tests/miles_dump.py writes them with torch.save as miles' own
code does): its rollout dumps as slime's, its train dumps one a rank joined by sample index (data
parallel shards, tensor-parallel copies, a pipeline stage without the trainer's logprobs), read
without torch, numpy arrays and scalars included; context-parallel slices and hostile pickles
refused."""

from __future__ import annotations

import codecs
import math
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
from rollout_lens.server.exchange.slime_import import SlimeDump
from rollout_lens.server.store.db import session_scope
from sqlalchemy.orm import Session, sessionmaker

from tests import miles_dump as md
from tests import slime_dump as sd
from tests.factories import rollout_views, run_count, stored_logprobs_match

N = 4
PROMPTS = ["What is 6 times 7?", "Name the capital of France."]


def _step(folder: Path, rollout_id: int, *, tool: bool, cp_size: int = 1) -> tuple[Any, Any]:
    rng = random.Random(rollout_id)
    samples = md.rollout(rng, PROMPTS, N, tool)
    md.save_rollout(folder / "rollout_data" / f"{rollout_id}.pt", rollout_id, samples)
    log_probs = sd.trainer_logprobs(rng, samples, noise=0.2)  # type: ignore[arg-type]
    md.save_train(folder / "train_data", rollout_id, samples, log_probs, cp_size=cp_size)
    return samples, log_probs


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """miles' --dump-details folder of two rollouts (the second with tool results), with an
    evaluation dump and the other folders miles writes there (skipped)."""
    dump = tmp_path / "dump"
    _step(dump, 0, tool=False)
    _step(dump, 1, tool=True)
    md.save_rollout(dump / "rollout_data" / "eval_1.pt", 1, [])
    (dump / "trajectory").mkdir()
    (dump / "dashboard_columns").mkdir()
    return dump


def test_both_sides_are_joined_by_sample_index(tmp_path: Path) -> None:
    samples, log_probs = _step(tmp_path, 2, tool=True)
    fmt = SlimeDump(tmp_path)
    (unit,) = sd.step_units(fmt)
    assert unit.step == 3 and len(unit.files) == 5  # the rollout dump and four ranks'
    fmt.plan([fmt.check(unit)])
    step = fmt.read(unit)
    rewards = [s.reward for s in samples]
    log_r = []
    for k, (sample, rollout) in enumerate(zip(samples, step.record.rollouts, strict=True)):
        assert (rollout.group, rollout.index) == divmod(k, N)
        assert rollout.completion_ids.tolist() == sample.tokens[-sample.response_length :]
        trainer = log_probs[k].double().numpy()  # the rank that holds its row, whichever
        mask = np.asarray(sample.loss_mask, dtype=bool)
        assert rollout.token_logprobs.tolist() == np.where(mask, trainer, 0.0).tolist()
        assert step.generator_logprobs[k].tolist() == sample.rollout_log_probs
        assert rollout.advantage == pytest.approx(rewards[k] - sum(rewards) / len(rewards))
        log_r += [
            t - g for t, g, m in zip(trainer, sample.rollout_log_probs, mask, strict=True) if m
        ]
    figures = step.record.metrics
    assert figures[mm.ABS_DIFF_MAX] == pytest.approx(max(abs(x) for x in log_r))
    assert figures[mm.K3_KL] == pytest.approx(sum(math.exp(x) - 1 - x for x in log_r) / len(log_r))


def test_a_miles_run_imports(session_factory: sessionmaker[Session], folder: Path) -> None:
    imported = import_dumps(session_factory, SlimeDump(folder), settle=0)
    assert (imported.steps, imported.rollouts) == (2, 2 * len(PROMPTS) * N)
    with session_scope(session_factory) as session:
        assert set(mm.NAMES) <= set(store.series_names(session, run_id=imported.run_id))
    views = rollout_views(session_factory, imported.run_id)
    step2 = {(v.group, v.index): v for v in views if v.step == 2}
    samples = md.rollout(random.Random(1), PROMPTS, N, True)  # rollout 1's, as _step drew them
    for k, sample in enumerate(samples):
        view = step2[divmod(k, N)]
        want = np.where(sample.loss_mask, sample.rollout_log_probs, math.nan)
        assert stored_logprobs_match(view.generator_logprobs, want)
        assert len(view.token_logprobs) == sample.response_length


def test_context_parallel_dumps_are_refused(
    session_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    _step(tmp_path, 0, tool=False, cp_size=2)
    with pytest.raises(InvalidInput, match=r"0_0\.pt: cp_size 2: context-parallel"):
        import_dumps(session_factory, SlimeDump(tmp_path), settle=0)
    assert run_count(session_factory) == 0


def test_a_row_naming_another_sample_is_refused(
    session_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    samples, _ = _step(tmp_path, 0, tool=False)
    md.save_rollout(tmp_path / "rollout_data" / "0.pt", 0, samples[:-1])  # one sample fewer
    with pytest.raises(InvalidInput, match=r"row \d+: sample index 7 is not a sample of the"):
        import_dumps(session_factory, SlimeDump(tmp_path, group_size=N), settle=0)
    assert run_count(session_factory) == 0


class _Reduced:
    """An object that pickles as the call `reduce` names (what a forged file could hold)."""

    def __init__(self, reduce: tuple[Any, ...]) -> None:
        self.reduce = reduce

    def __reduce__(self) -> tuple[Any, ...]:
        return self.reduce


HOSTILE = {
    # numpy.ndarray called with a shape: it would allocate what the shape says
    "an array made by its class": ((np.ndarray, ((10**9,),)), "does not load"),
    "an object array past the bound": (
        (
            np._core.multiarray._reconstruct,
            (np.ndarray, (0,), b"b"),
            (1, (10**9,), np.dtype("O"), False, [1]),
        ),
        "a numpy array of 1,000,000,000 elements",
    ),
    "an array short of its data": (
        (
            np._core.multiarray._reconstruct,
            (np.ndarray, (0,), b"b"),
            (1, (4,), np.dtype("f8"), False, b"\0" * 8),
        ),
        "data does not fill its shape",
    ),
    "a codec other than latin-1": ((codecs.encode, ("x" * 9, "zlib_codec")), "encoded otherwise"),
    "bytes made by a call": ((bytes, (10**9,)), "bytes made by a call"),
}


@pytest.mark.parametrize("hostile", list(HOSTILE))
def test_hostile_numpy_in_a_pickle_is_refused(tmp_path: Path, hostile: str) -> None:
    import torch

    reduce, message = HOSTILE[hostile]
    torch.save({"rollout_data": {"x": _Reduced(reduce)}}, tmp_path / "0_0.pt")
    with pytest.raises(InvalidInput, match=message):
        torch_file.load(tmp_path / "0_0.pt")


def test_torch_file_reads_numpy_as_numpy_does(tmp_path: Path) -> None:
    import torch

    values = {
        "ints": np.arange(5, dtype=np.int64),
        "floats": np.array([0.5, -1.25], dtype=np.float32),
        "empty": np.zeros((2, 0)),
        "scalar": np.float32(1.5),
        "objects": np.array([1, "x", None], dtype=object),
        "grid": np.arange(6, dtype=np.int32).reshape(2, 3),
    }
    torch.save(values, tmp_path / "v.pt")
    read = torch_file.load(tmp_path / "v.pt")
    for key, value in values.items():
        assert np.asarray(read[key]).tolist() == np.asarray(value).tolist(), key
        assert np.asarray(read[key]).dtype == np.asarray(value).dtype, key
