"""The step entity's round trip (issue 27): a RolloutRecord built the way the capture builds it
(numpy arrays, control-token probabilities [position × token]) or as lists, written by the one
writer and read back by the read side, over ragged shapes, NaN and −inf, empty and one-token
completions. What comes back is what the storage format promises (store/arrays.py): ids exact,
logprobs to 1/LOGPROB_SCALE nat down to LOGPROB_FLOOR with NaN and −inf kept, control-token
probabilities to 1/32768 where at least CONTROL_FLOOR (0.0 below it), NaN kept, Σ logprob exact."""

from __future__ import annotations

import math
from itertools import count

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rollout_lens.server import store
from rollout_lens.server.core.records import ControlProbs, RolloutRecord, StepRecord
from rollout_lens.server.store import arrays
from rollout_lens.server.store.db import session_scope
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from tests.factories import load_run

TOKENS = ("<tool>", "</tool>", "</assistant>")
LOGPROB = st.one_of(
    st.floats(min_value=-40.0, max_value=0.0),
    st.sampled_from([-math.inf, math.nan, 0.0, -1e-9, arrays.LOGPROB_FLOOR]),
)
PROB = st.one_of(
    st.floats(min_value=0.0, max_value=1.0),
    st.sampled_from([math.nan, 0.0, 1.0, arrays.CONTROL_FLOOR, arrays.CONTROL_FLOOR / 2]),
)


@st.composite
def rollouts(draw: st.DrawFn, index: int) -> RolloutRecord:
    n = draw(st.sampled_from([0, 1, 1, 2, 7]) | st.integers(0, 300))
    ids = draw(st.lists(st.integers(0, 200_000), min_size=n, max_size=n))
    # a generation path without logprobs or control-token probabilities measures none
    logprobs = draw(st.lists(LOGPROB, min_size=n, max_size=n)) if draw(st.booleans()) else []
    rows = n if draw(st.booleans()) else 0
    control = np.array(
        draw(st.lists(st.lists(PROB, min_size=3, max_size=3), min_size=rows, max_size=rows)),
        dtype=np.float64,
    ).reshape(rows, 3)
    as_arrays = draw(st.booleans())  # the capture's arrays, or an import's lists
    return RolloutRecord(
        group=index // 2,
        index=index % 2,
        prompt="<user>p</user>",
        completion=" ".join(f"w{i}" for i in ids),
        completion_ids=np.asarray(ids, dtype=np.int64) if as_arrays else ids,
        token_logprobs=np.asarray(logprobs) if as_arrays else logprobs,
        control_probs=(
            ControlProbs(TOKENS, control)
            if as_arrays
            else {t: control[:, k].tolist() for k, t in enumerate(TOKENS)}
        ),
        vote=None,
        target=None,
        verifier_reward=0.5,
        true_score=None,
        advantage=0.0,
        format_valid=None,
    )


def _logprob(value: float) -> float:
    """What the store gives back for a logprob."""
    if math.isnan(value) or value == -math.inf:
        return value
    return -round(min(-value, -arrays.LOGPROB_FLOOR) * arrays.LOGPROB_SCALE) / arrays.LOGPROB_SCALE


def _prob(value: float) -> float:
    if math.isnan(value):
        return value
    return 0.0 if value < arrays.CONTROL_FLOOR else round(min(value, 1.0) * 32768) / 32768


def _same(got: list[float], want: list[float], tolerance: float) -> bool:
    return len(got) == len(want) and all(
        (math.isnan(a) and math.isnan(b)) or a == b or abs(a - b) <= tolerance
        for a, b in zip(got, want, strict=True)
    )


_steps = count(1)


@pytest.mark.parametrize("engine", ["sqlite"], indirect=True)
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_a_step_reads_back_as_it_was_captured(
    engine: Engine, session_factory: sessionmaker[Session], data: st.DataObject
) -> None:
    step = [data.draw(rollouts(i)) for i in range(data.draw(st.integers(1, 4)))]
    with session_scope(session_factory) as session:
        run_id = store.create_run(
            session, name="entity", model="m", total_steps=1, group_size=2, control_tokens=TOKENS
        ).id
    record = StepRecord(step=next(_steps), rollout_step=1, values={}, rollouts=step)
    store.write_batch(
        engine, None, [record], run_id=run_id, control_tokens=TOKENS, price_per_hour=0.0
    )
    _, rows, _, _ = load_run(engine.url.render_as_string(hide_password=False), run_id)
    assert len(rows) == len(step)
    for got, want in zip(rows, step, strict=True):
        n = len(want.completion_ids)
        assert got["completion_ids"] == want.completion_ids.tolist()
        assert got["completion"] == want.completion
        assert _same(got["token_logprobs"], [_logprob(v) for v in want.token_logprobs], 1e-12)
        for k, token in enumerate(TOKENS):
            # not measured: zeros at every position, as the store has always read them back
            column = want.control_probs.array[:, k] if want.control_probs.measured else [0.0] * n
            assert _same(got["control_token_probs"][token], [_prob(v) for v in column], 1e-12)
        expected = want.sum_logprob
        if expected is None or math.isnan(expected):
            assert got["sum_logprob"] is None
        else:
            assert got["sum_logprob"] == expected  # a float64 column, summed before quantizing
