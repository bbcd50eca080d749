"""NeMo-RL's training dumps (tests/nemo_rl_dump.py writes them as NeMo-RL's own code does) read
with both sides: the trainer's logprobs into the rollouts, the engine's beside them, the step's
mismatch figures equal to brute force over the same tokens; hostile dumps refused whole."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rollout_lens.server import store
from rollout_lens.server.core import mismatch as mm
from rollout_lens.server.core.errors import InvalidInput
from rollout_lens.server.exchange.dump_files import Incomplete, Unit
from rollout_lens.server.exchange.dump_import import import_dumps
from rollout_lens.server.exchange.nemo_rl_import import NemoRlDump
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.store.models import RunRow, RunSource
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from tests import nemo_rl_dump as nd
from tests.factories import rollout_views, run_count, stored_logprobs_match

G = 4  # num_generations_per_prompt
PROMPTS = [
    [
        nd.Message("system", "You are a helpful assistant.", [1, 2, 3]),
        nd.Message("user", "What is 6 times 7?", [4, 5, 6, 7]),
    ],
    [nd.Message("user", "Call the weather tool for Paris.", [8, 9, 10])],
]


def _batch(seed: int, turns: int) -> tuple[list[nd.Sample], dict[str, Any]]:
    rng = random.Random(seed)
    samples = [
        nd.conversation(rng, prompt, turns=turns, nan_every=3)
        for prompt in PROMPTS
        for _ in range(G)  # repeat_interleave: a prompt's samples are consecutive
    ]
    advantages = nd.grpo_advantages([s.reward for s in samples], G)
    return samples, nd.log_data(samples, advantages)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    for step, turns in ((1, 1), (2, 3)):  # single-turn, then with environment results
        nd.write(tmp_path / "logs", step, _batch(step, turns)[1])
    return tmp_path / "logs"


def _unit(path: Path, step: int) -> Unit:
    from rollout_lens.server.exchange.dump_files import DumpFile

    return Unit(step, (DumpFile(path, step),), followed=False)


def _brute(samples: list[nd.Sample]) -> dict[str, float]:
    """The step's figures by hand: every assistant token the engine scored, in plain loops."""
    log_r, ratios = [], []
    for s in samples:
        mine = [
            s.prev_logprobs[p] - v for p, v in nd._engine_positions(s.messages) if not math.isnan(v)
        ]
        # the dump holds float32: the same rounding as the file
        log_r += mine
        ratios.append(math.exp(math.fsum(mine)))
    return {
        mm.ABS_DIFF_MEAN: sum(abs(x) for x in log_r) / len(log_r),
        mm.ABS_DIFF_MAX: max(abs(x) for x in log_r),
        mm.K3_KL: sum(math.exp(x) - 1 - x for x in log_r) / len(log_r),
        mm.SEQ_RATIO_MEAN: sum(ratios) / len(ratios),
    }


def test_both_sides_are_read(folder: Path) -> None:
    fmt = NemoRlDump(folder)
    checked = [fmt.check(_unit(f.path, f.step)) for f in fmt.scan()]
    plan = fmt.plan(checked)
    assert plan.group_size == G and "detected" in plan.notes[-1]
    samples, data = _batch(2, 3)
    step = fmt.read(_unit(folder / "train_data_step2.jsonl", 2))
    record = step.record
    assert [(r.group, r.index) for r in record.rollouts] == [
        (g, i) for g in (0, 1) for i in range(G)
    ]
    for k, (sample, rollout) in enumerate(zip(samples, record.rollouts, strict=True)):
        prompt_len = sum(
            len(m.token_ids) for m in sample.messages if m.role not in ("assistant", "environment")
        )
        length = data["input_lengths"][k]
        assert rollout.completion_ids.tolist() == data["token_ids"][k][prompt_len:length]
        mask = np.asarray(data["token_loss_mask"][k][prompt_len:length], dtype=bool)
        assert step.masks[k].tolist() == mask.tolist()
        prev = np.asarray(data["prev_logprobs"][k][prompt_len:length])
        assert rollout.token_logprobs.tolist() == np.where(mask, prev, 0.0).tolist()
        generator = step.generator_logprobs[k]
        engine = np.asarray(data["generation_logprobs"][k][prompt_len:length])
        assert np.array_equal(generator[mask], engine[mask], equal_nan=True)
        assert np.isnan(generator[~mask]).all()  # NeMo-RL's zeros there are no engine values
        assert np.isnan(generator).any()  # vLLM's missing ones stay missing
        assert rollout.prompt == "".join(m.content for m in sample.messages[: len(PROMPTS[k // G])])
        assert rollout.completion.startswith("reply 0")
        assert rollout.verifier_reward == sample.reward
    for name, value in _brute(samples).items():
        assert record.metrics[name] == pytest.approx(value, rel=1e-5), name


def test_a_nemo_rl_run_imports(session_factory: sessionmaker[Session], folder: Path) -> None:
    """Through the existing import path: a run of the two steps, the trainer's logprobs as
    its rollouts', the engine's stored beside them (NaN where it gave none and at environment
    results) and the mismatch figures among its series."""
    imported = import_dumps(session_factory, NemoRlDump(folder, name="nemo"), settle=0)
    assert (imported.steps, imported.rollouts) == (2, 2 * len(PROMPTS) * G)
    with session_scope(session_factory) as session:
        run = session.get(RunRow, imported.run_id)
        assert run is not None and run.source == RunSource.nemo_rl_import
        assert set(mm.NAMES) <= set(store.series_names(session, run_id=run.id))
    fmt = NemoRlDump(folder)
    fmt.plan([fmt.check(_unit(f.path, f.step)) for f in fmt.scan()])
    wanted = {}
    for step in (1, 2):
        read = fmt.read(_unit(folder / f"train_data_step{step}.jsonl", step))
        for r, engine, mask in zip(
            read.record.rollouts, read.generator_logprobs, read.masks, strict=True
        ):
            wanted[(step, r.group, r.index)] = np.where(mask, engine, math.nan)
    views = rollout_views(session_factory, imported.run_id)
    assert len(views) == len(wanted)
    for view in views:
        want = wanted[(view.step, view.group, view.index)]
        assert view.generator_logprobs is not None and len(want)
        assert stored_logprobs_match(view.generator_logprobs, want)
        assert np.isnan(view.generator_logprobs).any()  # vLLM's missing ones stay missing


def _hostile(folder: Path, change: Any) -> Path:
    data = _batch(5, 2)[1]
    change(data)
    nd.write(folder, 1, data)
    return folder


def _shorter(data: dict[str, Any]) -> None:
    data["generation_logprobs"][3] = data["generation_logprobs"][3][:-2]


def _none_trainer(data: dict[str, Any]) -> None:
    data["prev_logprobs"][1][5] = None


def _mask_length(data: dict[str, Any]) -> None:
    data["token_loss_mask"][0] = data["token_loss_mask"][0] + [1]


def _mask_value(data: dict[str, Any]) -> None:
    data["token_loss_mask"][0][6] = 2


def _length(data: dict[str, Any]) -> None:
    data["input_lengths"][2] = len(data["token_ids"][2]) + 1


def _old(data: dict[str, Any]) -> None:
    for key in ("token_ids", "token_loss_mask", "advantages", "sample_loss_mask"):
        del data[key]


def _no_reply(data: dict[str, Any]) -> None:
    data["token_loss_mask"][4] = [0] * len(data["token_loss_mask"][4])


def _positive(data: dict[str, Any]) -> None:
    data["generation_logprobs"][0][7] = 3.5


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_shorter, r"line 4: the per-token arrays differ in length \(.*generation_logprobs \d+"),
        (_none_trainer, r"line 2: prev_logprobs\[5\] is None, not a logprob"),
        (_mask_length, r"line 1: the per-token arrays differ in length \(.*token_loss_mask \d+"),
        (_mask_value, "line 1: token_loss_mask is not a list of 0s and 1s"),
        (_length, "line 3: input_lengths .* is not a length within"),
        (_old, "line 1: no sample_loss_mask, token_ids, token_loss_mask, advantages"),
        (_no_reply, "line 5: no assistant token"),
        (_positive, r"line 1: generation_logprobs\[7\] is 3.5, not a logprob"),
    ],
)
def test_hostile_dumps_are_refused_and_create_nothing(
    session_factory: sessionmaker[Session], tmp_path: Path, change: Any, message: str
) -> None:
    folder = _hostile(tmp_path / "logs", change)
    with pytest.raises(InvalidInput, match=message):
        import_dumps(session_factory, NemoRlDump(folder, group_size=G), settle=0)
    assert run_count(session_factory) == 0


def test_a_line_cut_short_is_incomplete(tmp_path: Path) -> None:
    path = nd.write(tmp_path, 1, _batch(1, 1)[1])
    path.write_bytes(path.read_bytes()[:-40])
    fmt = NemoRlDump(tmp_path)
    with pytest.raises(Incomplete, match="ends mid-line"):
        fmt.check(_unit(path, 1))


def test_not_a_microbatch_of_one(tmp_path: Path) -> None:
    path = nd.write(tmp_path, 1, _batch(1, 1)[1])
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[0]["rewards"] = [1.0, 0.0]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(InvalidInput, match="line 1: rewards is not a one-element list"):
        NemoRlDump(tmp_path).check(_unit(path, 1))


def test_the_cli_imports_a_nemo_rl_run(
    session_factory: sessionmaker[Session],
    folder: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from rollout_lens.cli import main
    from tests.follow_support import use_database

    use_database(monkeypatch, session_factory, tmp_path)
    assert main(["import-nemo-rl", str(folder), "--name", "nemo grpo", "--settle", "0"]) == 0
    assert f"from {folder}: 2 steps, {2 * len(PROMPTS) * G} rollouts" in capsys.readouterr().out
    with session_scope(session_factory) as session:
        run = session.scalars(select(RunRow)).one()
        assert (run.name, run.source, run.group_size) == ("nemo grpo", RunSource.nemo_rl_import, G)
        assert set(mm.NAMES) <= set(store.series_names(session, run_id=run.id))
    # Bad input: exit status 2, the reason, nothing more created.
    with pytest.raises(SystemExit) as refused:
        main(["import-nemo-rl", str(folder), "--group-size", "0"])
    assert refused.value.code == 2
    assert "--group-size: a whole number from 1" in capsys.readouterr().err
    assert main(["import-nemo-rl", str(tmp_path / "nowhere")]) == 2
    assert "nowhere" in capsys.readouterr().err
    assert run_count(session_factory) == 1
