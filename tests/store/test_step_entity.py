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
from rollout_lens.server.core.step_views import ROLLOUT_KEYS, RolloutJSON, RolloutView
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
    # the generator's side: none (a path without it), or a logprob a token (NaN: none for it)
    generator = draw(st.none() | st.lists(LOGPROB, min_size=n, max_size=n))
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
        generator_logprobs=(
            np.asarray(generator) if as_arrays and generator is not None else generator
        ),
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
        if want.generator_logprobs is None:
            assert got["generator_logprobs"] is None  # none given: null, never zeros
        else:
            wanted = [_logprob(v) for v in want.generator_logprobs]
            assert _same(got["generator_logprobs"], wanted, 1e-12)
        for k, token in enumerate(TOKENS):
            # not measured: zeros at every position, as the store has always read them back
            column = want.control_probs.array[:, k] if want.control_probs.measured else [0.0] * n
            assert _same(got["control_token_probs"][token], [_prob(v) for v in column], 1e-12)
        expected = want.sum_logprob
        if expected is None or math.isnan(expected):
            assert got["sum_logprob"] is None
        else:
            assert got["sum_logprob"] == expected  # a float64 column, summed before quantizing


# --- the read side: typed views, one description ------------------------------------------------


def _read(engine: Engine, run_id: int, *, max_tokens: int | None = None) -> list[RolloutView]:
    from rollout_lens.server.store.serialize import completion_ids, read_rollout

    with session_scope(sessionmaker(engine)) as session:
        pairs = list(store.iter_rollouts(session, run_id=run_id))
        texts = store.token_texts(
            session, run_id=run_id, ids={i for r, _ in pairs for i in completion_ids(r)}
        )
        return [read_rollout(r, p, TOKENS, texts, max_tokens=max_tokens) for r, p in pairs]


@pytest.mark.parametrize("engine", ["sqlite"], indirect=True)
@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_the_read_side_returns_typed_arrays_in_the_one_orientation(
    engine: Engine, session_factory: sessionmaker[Session], data: st.DataObject
) -> None:
    """What the store gives back is a typed view of decoded arrays (ids int64, logprobs float64,
    control-token probabilities [position × token]), whose JSON is ROLLOUT_KEYS
    in their order; a window holds the first positions and says how many there are."""
    step = [data.draw(rollouts(i)) for i in range(data.draw(st.integers(1, 3)))]
    with session_scope(session_factory) as session:
        run_id = store.create_run(
            session, name="views", model="m", total_steps=1, group_size=2, control_tokens=TOKENS
        ).id
    record = StepRecord(step=next(_steps), rollout_step=1, values={}, rollouts=step)
    store.write_batch(
        engine, None, [record], run_id=run_id, control_tokens=TOKENS, price_per_hour=0.0
    )
    window = data.draw(st.integers(0, 8))
    for view, cut, want in zip(
        _read(engine, run_id), _read(engine, run_id, max_tokens=window), step, strict=True
    ):
        n = len(want.completion_ids)
        assert view.completion_ids.dtype == np.int64 and view.token_logprobs.dtype == np.float64
        assert view.completion_ids.tolist() == want.completion_ids.tolist()
        assert isinstance(view.control_token_probs, ControlProbs)
        assert view.control_token_probs.tokens == TOKENS
        # [position × token]; not measured reads as zeros at every position (as it always has)
        assert view.control_token_probs.array.shape == (n, 3)
        for k in range(len(TOKENS)):
            column = view.control_token_probs.array[:, k].tolist()
            wanted = want.control_probs.array[:, k] if want.control_probs.measured else [0.0] * n
            assert _same(column, [_prob(v) for v in wanted], 1e-12)
        as_json = view.data()
        assert tuple(as_json) == ROLLOUT_KEYS and view.tokens_total == n and not view.window
        assert as_json["completion_ids"] == want.completion_ids.tolist()
        # the JSON read back as a view is the same view
        again = RolloutView.from_data(as_json).data()
        assert again.keys() == as_json.keys()
        for key in ROLLOUT_KEYS:
            if key in ("token_logprobs", "generator_logprobs") and as_json[key] is not None:
                assert _same(again[key], as_json[key], 0.0)
            elif key == "control_token_probs":
                assert again[key].keys() == as_json[key].keys()
                for token in TOKENS:
                    assert _same(again[key][token], as_json[key][token], 0.0)
            else:
                assert again[key] == as_json[key], key
        # a window: the first positions of each array, the whole text, how many there are
        assert cut.window and cut.tokens_total == n and cut.completion == view.completion
        assert cut.completion_ids.tolist() == view.completion_ids[:window].tolist()
        if view.generator_logprobs is None:
            assert cut.generator_logprobs is None and want.generator_logprobs is None
        else:
            assert view.generator_logprobs.dtype == np.float64
            assert _same(
                cut.generator_logprobs.tolist(), view.generator_logprobs[:window].tolist(), 0.0
            )
        assert cut.control_token_probs.array.shape[0] == min(
            window, view.control_token_probs.array.shape[0]
        )
        assert cut.data()["tokens_total"] == n


def test_one_description_of_a_rollout_gives_the_export_the_api_and_the_view() -> None:
    """The read view is the one description: its JSON model (RolloutJSON), which the export's
    RolloutLine and the API's GroupRollout extend, is derived from its described fields (every
    one, by name, in order), and the OpenAPI document lists them."""
    from rollout_lens.server.core.config import Settings
    from rollout_lens.server.exchange.schema import RolloutLine
    from rollout_lens.server.webapp.app import create_app
    from rollout_lens.server.webapp.http.api_models import GroupRollout

    fields = tuple(RolloutJSON.model_fields)
    assert fields == ROLLOUT_KEYS
    assert set(fields) <= set(RolloutView.__dataclass_fields__)
    assert issubclass(RolloutLine, RolloutJSON) and issubclass(GroupRollout, RolloutJSON)
    assert set(RolloutLine.model_fields) == {*fields, "kind"}
    assert set(fields) < set(GroupRollout.model_fields)
    app = create_app(Settings(database_url="sqlite://", allowed_hosts="testserver"))
    schemas = app.openapi()["components"]["schemas"]
    listed = schemas["GroupRollout"]["properties"]
    assert set(fields) <= set(listed)
    assert all(listed[name].get("description") for name in fields)
    rollouts = schemas["Group"]["properties"]["rollouts"]
    assert rollouts["items"]["$ref"].endswith("/GroupRollout")
    # the write side's entity carries the description's fields a trainer knows (three under the
    # names the write path has always given them), and one instruction to the store: how its
    # text is rebuilt from its pieces (the wire's text_rule; the store keeps its own)
    from dataclasses import fields as entity_fields

    renamed = {
        "control_probs": "control_token_probs",
        "tokens": "token_pieces",
        "given_sum_logprob": "sum_logprob",
    }
    written = {renamed.get(f.name, f.name) for f in entity_fields(RolloutRecord)}
    assert written - set(fields) == {"text_rule"}
    # the Parquet export's columns: the same fields (control-token probabilities as rows)
    from rollout_lens.server.exchange.export import PARQUET_NAMES, rollout_schema

    columns = set(rollout_schema().names)
    assert columns == {PARQUET_NAMES.get(n, n) for n in fields} - {"tokens_kept"}


def test_the_step_viewer_shows_views_it_never_changes() -> None:
    """The viewer's rollout is built once from the read side's view (frozen), its cells and
    control-token table within the page's budget."""
    from dataclasses import FrozenInstanceError

    from rollout_lens.server.webapp.pages import viewer

    view = RolloutView.from_data(
        {
            "group": 0,
            "index": 0,
            "prompt": "p",
            "completion": "<tool>tool_07</tool>",
            "completion_ids": [5, 107, 6],
            "token_logprobs": [-0.1, -0.2, -0.3],
            "control_token_probs": {"</tool>": [0.0, 0.5, 0.9]},
        }
    )
    (group,) = viewer.group_views([view])
    (shown,) = group["rollouts"]
    assert isinstance(shown, viewer.ShownRollout) and isinstance(shown, RolloutView)
    assert [c["text"] for c in shown.cells] == ["<tool>", "tool_07", "</tool>"]
    assert shown.control_rows[1][0] == "</tool>" and shown.turn_views is None
    assert shown.completion_ids is view.completion_ids  # the view's arrays, not copies
    with pytest.raises(FrozenInstanceError):
        shown.cells = []  # type: ignore[misc]
