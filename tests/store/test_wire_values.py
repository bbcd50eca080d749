"""Numbers no page can show (NaN, ±Infinity) in what a recorder sends or a trainer records:
refused at the wire with a 422 naming the field, never sent by our own recorder (it sends null),
never written by the store as JSON that no reader parses (SQLite's json_extract and PostgreSQL's
json type refuse `Infinity`); and a hypothesis pass: any body the wire accepts leaves every page of
its run, and its JSON twin, answering 200. On SQLite and PostgreSQL."""

from __future__ import annotations

import itertools
import json
import math
import random
from typing import Any

import numpy as np
import pyarrow as pa
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from rollout_lens.server import store
from rollout_lens.server.core.records import RolloutRecord, StepRecord
from rollout_lens.server.core.vocab import STEP_SERIES
from rollout_lens.server.exchange import wire
from rollout_lens.server.store.db import session_scope
from sqlalchemy.orm import Session, sessionmaker

from tests.factories import make_rollouts, make_run, record_step, rollouts_per_step
from tests.wire_support import body, record_run, run_pages, with_rollout_columns

CONTROL = ("<tool>", "</tool>", "</assistant>")  # as tests.factories' rollouts measure them
INF, NAN = math.inf, math.nan


def _record(step: int = 1) -> StepRecord:
    return StepRecord(
        step=step,
        rollout_step=step,
        values={"reward_mean": 0.5},
        rollouts=make_rollouts(random.Random(step)),
        metrics={},
    )


def _texts(text: str) -> Any:
    return lambda n: pa.array([text] * n, pa.large_string())


def _floats(value: float | None) -> Any:
    return lambda n: pa.array([value] * n, pa.float64())


def _not_ok(statuses: dict[str, int]) -> dict[str, int]:
    return {path: status for path, status in statuses.items() if status != 200}


def test_numbers_no_page_can_show_are_refused_naming_the_field(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    other = make_run(session_factory, steps=1)
    run_id = record_run(client, "values-key-0001", CONTROL)
    path = f"/api/record/runs/{run_id}/steps"
    at = "steps[0].rollouts[0]"
    cases: dict[str, tuple[dict[str, Any], str]] = {
        "Infinity in meta": ({"meta": _texts('{"score": Infinity}')}, f"{at}.meta.score"),
        "-Infinity deep in meta": (
            {"meta": _texts('{"probe": {"p": [0.5, -Infinity]}}')},
            f"{at}.meta.probe.p[1]",
        ),
        "NaN under an odd key": ({"meta": _texts('{"a b": NaN}')}, f'{at}.meta["a b"]'),
        "a literal past float's range": ({"meta": _texts('{"x": 1e999}')}, f"{at}.meta.x"),
        "an infinite reward": ({"verifier_reward": _floats(INF)}, f"{at}.verifier_reward"),
        "an infinite advantage": ({"advantage": _floats(-INF)}, f"{at}.advantage"),
        "an infinite true score": ({"true_score": _floats(INF)}, f"{at}.true_score"),
        "a NaN Σ logprob": ({"sum_logprob": _floats(NAN)}, f"{at}.sum_logprob"),
        "a +Infinity Σ logprob": ({"sum_logprob": _floats(INF)}, f"{at}.sum_logprob"),
    }
    for what, (columns, field) in cases.items():
        answer = client.post(
            path, content=body(with_rollout_columns(_record(), CONTROL, **columns))
        )
        assert answer.status_code == 422, (what, answer.status_code, answer.text)
        assert answer.json()["field"] == field, (what, answer.json())
        assert field in answer.json()["detail"]
    assert rollouts_per_step(session_factory, run_id) == {}  # nothing of any of them written
    # Σ logprob's -Infinity is a number the store keeps (a token the policy gave no mass)
    frame = with_rollout_columns(_record(), CONTROL, sum_logprob=_floats(-INF))
    answer = client.post(path, content=body(frame))
    assert answer.status_code == 200, answer.text
    assert _not_ok(run_pages(client, run_id, {1: [0]}, other=other)) == {}


def test_our_recorder_sends_what_no_page_can_show_as_null(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    """What the server refuses, the recorder's own encoding never sends: NaN and infinities in
    meta, a true score and a Σ logprob become null (as the store writes them locally)."""
    other = make_run(session_factory, steps=1)
    record = _record()
    for r in record.rollouts:
        r.meta = r.meta | {"score": INF, "probe": {"p": [0.5, -INF, NAN]}, "ok": 1.5}
        r.true_score = INF
        r.token_logprobs = [NAN, -0.5, -0.25, -0.125]
    frame = wire.encode_step(record, CONTROL, np.zeros(0, np.int64)).frame
    (received,) = wire.decode_body(wire.body([frame]), control_tokens=CONTROL)
    sent = received.record.rollouts[0]
    assert sent.meta["score"] is None and sent.meta["probe"] == {"p": [0.5, None, None]}
    assert sent.meta["ok"] == 1.5 and sent.true_score is None
    assert sent.sum_logprob is not None and math.isnan(sent.sum_logprob)  # unknown: stored NULL
    run_id = record_run(client, "values-key-0002", CONTROL)
    answer = client.post(f"/api/record/runs/{run_id}/steps", content=wire.body([frame]))
    assert answer.status_code == 200, answer.text
    assert _not_ok(run_pages(client, run_id, {1: [0]}, other=other)) == {}


def test_unshowable_numbers_recorded_locally_leave_every_page_readable(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    """The local path (the callback's writer, every import) writes through the store: a group's
    shared meta (its facts row), a rollout's own meta and a run's config keep NaN and
    infinities as null, the JSON every reader parses."""
    with session_scope(session_factory) as session:
        run_id = store.create_run(
            session,
            name="local",
            model="m",
            total_steps=1,
            group_size=8,
            config={"lr": INF, "betas": [0.9, NAN], "nested": {"x": -INF}},
            control_tokens=CONTROL,
        ).id
    rollouts = make_rollouts(random.Random(3))
    for i, r in enumerate(rollouts):
        # shared by the group (its facts), and each one's own (a NaN equals no other)
        r.meta = r.meta | {"score": INF, "own": NAN, "np": np.float64(-INF), "i": i}
    record_step(
        session_factory,
        run_id,
        1,
        values={"reward_mean": INF, "loss": NAN},
        rollouts=rollouts,
        metrics={"trl/x": -INF},
    )
    other = make_run(session_factory, steps=1)
    assert _not_ok(run_pages(client, run_id, {1: [0]}, other=other)) == {}
    export = client.get(f"/api/runs/{run_id}/export").text
    lines = [json.loads(line) for line in export.splitlines()]  # strict JSON: no NaN tokens
    metas = [line["meta"] for line in lines if line.get("kind") == "rollout"]
    assert metas and all(m["score"] is None and m["own"] is None for m in metas)
    assert "Infinity" not in export and "NaN" not in export


# --- any body the wire accepts: every page of its run answers ----------------------------------

_EDGES = [INF, -INF, NAN]
_FINITE = st.floats(allow_nan=False, allow_infinity=False)
_ANY_FLOAT = st.one_of(_FINITE, st.sampled_from(_EDGES))
_TEXT = st.text(max_size=12)
_JSON = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.sampled_from([2**63, -(2**64), 10**30]),
        _FINITE,
        _TEXT,
    ),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(_TEXT, inner, max_size=3)),
    max_leaves=8,
)


@st.composite
def _rollout(
    draw: st.DrawFn, group: int, index: int, vocab: dict[int, str], odd: bool
) -> dict[str, Any]:
    """A rollout; `odd`: its numbers may be NaN or infinite (else all are finite)."""
    number = st.one_of(_FINITE, st.sampled_from(_EDGES)) if odd else _FINITE
    meta = st.dictionaries(_TEXT, st.one_of(_JSON, number) if odd else _JSON, max_size=4)
    ids = draw(st.lists(st.sampled_from(sorted(vocab)), max_size=6))
    with_tokens = draw(st.booleans())
    measured = draw(st.booleans())
    rollout = RolloutRecord(
        group=group,
        index=index,
        prompt=draw(st.sampled_from(["", "<user>q</user>", "<user>é ✓ \x00 𝄞</user>"])),
        completion="".join(vocab[i] for i in ids) if with_tokens else draw(_TEXT),
        completion_ids=ids,
        token_logprobs=[
            draw(st.one_of(st.floats(-40, 0), st.sampled_from([-INF, NAN]))) for _ in ids
        ]
        if measured
        else [],
        control_probs={t: [draw(st.floats(0, 1)) for _ in ids] for t in CONTROL}
        if measured
        else {},
        vote=draw(st.one_of(st.none(), _TEXT)),
        target=draw(st.one_of(st.none(), _TEXT)),
        verifier_reward=draw(number),
        true_score=draw(st.one_of(st.none(), number)),
        advantage=draw(number),
        format_valid=draw(st.one_of(st.none(), st.booleans())),
        format_state=draw(st.one_of(st.none(), st.text(max_size=32))),
        tokens=[vocab[i] for i in ids] if with_tokens else None,
    )
    return {
        "record": rollout,
        "meta": draw(meta),
        "sum_logprob": draw(st.one_of(st.none(), number, st.just(-INF))),
    }


@st.composite
def _steps(draw: st.DrawFn) -> list[tuple[StepRecord, dict[str, list[Any]]]]:
    """One or two steps of one or two groups, each value drawn as a sender might send it
    (meta, a true score and a Σ logprob sent raw: NaN and infinities too)."""
    vocab = draw(st.dictionaries(st.integers(0, 40), st.text(min_size=1, max_size=4), min_size=1))
    odd = draw(st.integers(0, 3)) == 0  # a body in four may hold what the wire refuses
    out = []
    for step in range(1, draw(st.integers(1, 2)) + 1):
        drawn = [
            draw(_rollout(group, index, vocab, odd))
            for group in range(draw(st.integers(1, 2)))
            for index in range(draw(st.integers(1, 3)))
        ]
        record = StepRecord(
            step=step,
            rollout_step=step,
            values=draw(st.dictionaries(st.sampled_from(STEP_SERIES), _ANY_FLOAT, max_size=3)),
            rollouts=[d["record"] for d in drawn],
            metrics=draw(st.dictionaries(st.text(min_size=1, max_size=20), _ANY_FLOAT, max_size=3)),
        )
        raw = {
            "meta": [json.dumps(d["meta"]) if d["meta"] else None for d in drawn],
            "true_score": [d["record"].true_score for d in drawn],
            "sum_logprob": [d["sum_logprob"] for d in drawn],
        }
        out.append((record, raw))
    return out


def _unshowable(record: StepRecord, raw: dict[str, list[Any]]) -> bool:
    """Whether a step holds a number the wire refuses (the oracle of the pass below)."""

    def bad(value: Any) -> bool:
        if isinstance(value, float):
            return not math.isfinite(value)
        if isinstance(value, dict):
            return any(bad(v) for v in value.values())
        if isinstance(value, list):
            return any(bad(v) for v in value)
        return False

    rewards = [v for r in record.rollouts for v in (r.verifier_reward, r.advantage)]
    metas = [json.loads(m) for m in raw["meta"] if m is not None]
    sums = [s for s in raw["sum_logprob"] if s is not None and s != -INF]
    return bad(rewards) or bad(raw["true_score"]) or bad(metas) or bad(sums)


_KEYS = itertools.count()


@settings(
    max_examples=12,  # each a run recorded and its ~30 pages read: 3 to 10 s a database
    deadline=None,
    derandomize=True,  # the same examples every run: CI and a laptop see one pass
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(steps=_steps())
def test_any_body_the_wire_accepts_leaves_every_page_of_its_run_answering_200(
    client: TestClient,
    session_factory: sessionmaker[Session],
    steps: list[tuple[StepRecord, dict[str, list[Any]]]],
) -> None:
    run_id = record_run(client, f"values-pass-{next(_KEYS):06d}", CONTROL)
    frames = [
        with_rollout_columns(
            record,
            CONTROL,
            meta=lambda _n, raw=raw: pa.array(raw["meta"], pa.large_string()),
            true_score=lambda _n, raw=raw: pa.array(raw["true_score"], pa.float64()),
            sum_logprob=lambda _n, raw=raw: pa.array(raw["sum_logprob"], pa.float64()),
        )
        for record, raw in steps
    ]
    answer = client.post(f"/api/record/runs/{run_id}/steps", content=body(*frames))
    refused = any(_unshowable(record, raw) for record, raw in steps)
    event("refused" if refused else "accepted")
    if refused:
        assert answer.status_code == 422, answer.text
        assert rollouts_per_step(session_factory, run_id) == {}
        return
    assert answer.status_code == 200, answer.text
    groups = {record.step: sorted({r.group for r in record.rollouts}) for record, _ in steps}
    other = record_run(client, f"values-other-{next(_KEYS):06d}", CONTROL)
    assert _not_ok(run_pages(client, run_id, groups, other=other)) == {}


def test_rewards_at_the_edge_of_float_leave_every_page_readable(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    """Finite numbers the wire takes (±1.7e308) whose spread is past float's range: a group's
    reward std was an OverflowError (a power of a difference) on the step and group pages."""
    other = make_run(session_factory, steps=1)
    run_id = record_run(client, "values-key-0003", CONTROL)
    record = _record()
    for r in record.rollouts:
        r.verifier_reward = r.advantage = 1.7e308 if r.index % 2 else -1.7e308
        r.true_score = 1e300
    frame = wire.encode_step(record, CONTROL, np.zeros(0, np.int64)).frame
    answer = client.post(f"/api/record/runs/{run_id}/steps", content=wire.body([frame]))
    assert answer.status_code == 200, answer.text
    assert _not_ok(run_pages(client, run_id, {1: [0]}, other=other)) == {}


def test_the_migration_repairs_values_stored_before(sqlite_url: str) -> None:
    """Rows an older store wrote with NaN and Infinity tokens (SQLite took them as text): the
    step page was a 500 until migration 0018 made them null."""
    from rollout_lens.server.store.db import make_engine, make_session_factory
    from rollout_lens.server.store.migrate import downgrade, upgrade
    from sqlalchemy import text

    from tests.web_support import client_for

    engine = make_engine(sqlite_url)
    upgrade(engine)  # today's store records the run, then the schema goes back to before 0018
    factory = make_session_factory(engine)
    run_id = make_run(factory, steps=1)
    downgrade(engine, "0017")
    with engine.begin() as conn:  # as the older serializer wrote them
        conn.execute(text("""UPDATE facts SET data = '{"query": "q", "score": Infinity}'"""))
        conn.execute(text(f"""UPDATE runs SET config = '{{"lr": NaN}}' WHERE id = {run_id}"""))
    assert client_for(factory).get(f"/runs/{run_id}/steps/1").status_code == 500
    upgrade(engine)
    client = client_for(factory)
    assert client.get(f"/runs/{run_id}/steps/1").status_code == 200
    assert client.get(f"/api/runs/{run_id}").json()["run"]["config"] == {"lr": None}
    with engine.connect() as conn:
        assert conn.execute(text("SELECT data FROM facts")).scalar() == (
            '{"query": "q", "score": null}'
        )
    engine.dispose()
