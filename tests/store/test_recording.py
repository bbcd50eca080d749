"""The write path's encodings, retention and step-by-step alerts, on SQLite and PostgreSQL."""

from __future__ import annotations

import math
import random

import pytest
from fastapi.testclient import TestClient
from rollout_lens.server import store
from rollout_lens.server.core.records import RolloutRecord
from rollout_lens.server.core.vocab import (
    COLLAPSED,
    DROP_PROBES,
    SOLVED_GROUPS,
    SPIKE_PROBES,
    STUCK_GROUPS,
)
from rollout_lens.server.store import arrays
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.store.models import RolloutDataRow, RolloutRow, StepRow
from rollout_lens.server.store.serialize import rollout_dict
from rollout_lens.server.webapp import queries
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from tests.factories import (
    CONTROL_TOKENS,
    make_rollouts,
    make_run,
    record_step,
    record_steps,
    step_record,
)
from tests.web_support import parse


def _rollout(index: int, ids: list[int], logprobs: list[float], text: str) -> RolloutRecord:
    return RolloutRecord(
        group=0,
        index=index,
        prompt="<user>p</user>",
        completion=text,
        completion_ids=ids,
        token_logprobs=logprobs,
        control_probs={t: [0.25] * len(ids) for t in CONTROL_TOKENS},
        vote=None,
        target=None,
        verifier_reward=0.0,
        true_score=None,
        advantage=0.0,
        format_valid=False,
        tokens=[f"t{i}" for i in ids],
        meta={"probes": {"open_first": float(index)}, "query": "q"},
    )


def test_every_encoding_round_trips(session_factory: sessionmaker[Session]) -> None:
    long_ids = list(range(4096))
    long_logprobs = [-(i % 50) / 7 for i in long_ids]
    special = [math.nan, -math.inf, -1e9, -0.5]  # -1e9 is below the stored floor: it reads -15
    rollouts = [
        _rollout(0, [], [], ""),
        _rollout(1, long_ids, long_logprobs, "x" * 4096),
        _rollout(2, [7, 8, 9, 10], special, "abcd"),
    ]
    run_id = make_run(session_factory, steps=0)
    record_step(session_factory, run_id, 1, rollouts=rollouts, values={"loss": math.nan})
    with session_scope(session_factory) as session:
        pairs = store.step_rollouts(session, run_id=run_id, step=1)
        texts = store.token_texts(session, run_id=run_id)
        got = [rollout_dict(r, p, CONTROL_TOKENS, texts) for r, p in pairs]
        assert store.steps(session, run_id=run_id)[0].loss is None
    empty, long, odd = got
    assert (empty["completion"], empty["completion_ids"], empty["token_logprobs"]) == ("", [], [])
    assert empty["tokens"] is None and empty["control_token_probs"] == {
        t: [] for t in CONTROL_TOKENS
    }
    assert long["completion_ids"] == long_ids and long["tokens"] == [f"t{i}" for i in long_ids]
    assert long["token_logprobs"] == pytest.approx(long_logprobs, rel=1e-3, abs=1e-3)
    assert long["sum_logprob"] == pytest.approx(sum(long_logprobs))  # float64, not float16
    assert long["control_token_probs"]["<tool>"] == [0.25] * 4096
    assert math.isnan(odd["token_logprobs"][0]) and odd["token_logprobs"][1] == -math.inf
    assert odd["token_logprobs"][2:] == [arrays.LOGPROB_FLOOR, -0.5]
    assert odd["sum_logprob"] is None  # a NaN sum is no number: stored as NULL, not guessed
    infinite = _rollout(0, [1, 2], [-0.5, -math.inf], "ab")
    record_step(session_factory, run_id, 2, rollouts=[infinite])
    with session_scope(session_factory) as session:
        ((row, _),) = store.step_rollouts(session, run_id=run_id, step=2)
        assert row.sum_logprob == -math.inf  # a token given no mass is kept as such
    # meta: the group's shared facts stored once, each rollout's own keys beside them
    assert [r["meta"] for r in got] == [
        {"query": "q", "probes": {"open_first": float(i)}} for i in range(3)
    ]


def test_retention_keeps_every_nth_first_last_and_alert_steps(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    # four groups a step: one step's collapse is enough groups to alert on
    run_id = make_run(session_factory, steps=0, keep_tokens_every=5, prompts_per_step=4)
    rng = random.Random(1)
    for step in range(1, 13):
        collapsed = 0.9 if step == 7 else 0.0  # a collapse alert fires at step 7
        rollouts = make_rollouts(rng)
        for r in rollouts:  # the generator's side too: dropped with the other arrays
            r.generator_logprobs = [-rng.random() for _ in r.completion_ids]
        record_step(
            session_factory,
            run_id,
            step,
            rollouts=rollouts,
            values={"true_accuracy": 0.5},
            metrics={COLLAPSED: collapsed},
        )
    with session_scope(session_factory) as session:
        kept = session.scalars(
            select(StepRow.step)
            .where(StepRow.run_id == run_id, StepRow.tokens_kept)
            .order_by(StepRow.step)
        ).all()
        with_arrays = session.scalars(
            select(RolloutRow.step)
            .join(RolloutDataRow, RolloutDataRow.rollout_id == RolloutRow.id)
            .where(RolloutRow.run_id == run_id, RolloutDataRow.logprobs.is_not(None))
            .distinct()
            .order_by(RolloutRow.step)
        ).all()
        with_generator = session.scalars(
            select(RolloutRow.step)
            .join(RolloutDataRow, RolloutDataRow.rollout_id == RolloutRow.id)
            .where(RolloutRow.run_id == run_id, RolloutDataRow.generator_logprobs.is_not(None))
            .distinct()
            .order_by(RolloutRow.step)
        ).all()
        assert [a["step"] for a in queries.alerts(session, run_id=run_id)] == [7]
    assert list(kept) == list(with_arrays) == list(with_generator) == [1, 5, 7, 10, 12]

    page = parse(client.get(f"/runs/{run_id}/steps/4").text)
    assert "every 5 steps" in page.find(id="tokens-not-kept").text
    assert "token probabilities not kept at this step" in page.text
    assert page.find(id="nearest-kept").attrs["href"].endswith(f"/runs/{run_id}/steps/5")
    three = parse(client.get(f"/runs/{run_id}/steps/3").text).find(id="nearest-kept")
    assert three.attrs["href"].endswith("/steps/1")  # equally near 1 and 5: the earlier
    assert 'id="tokens-not-kept"' not in client.get(f"/runs/{run_id}/steps/5").text
    detail = client.get(f"/api/runs/{run_id}/steps/3").json()
    assert detail["tokens_kept"] is False and detail["nearest_kept"] == 1
    # what was not kept is said, not faked: completions, their ids (they are the text) and
    # rewards are there, probabilities are empty
    assert detail["groups"][0]["size"] == 8  # the overview reads no arrays
    group = client.get(f"/api/runs/{run_id}/steps/3/groups/0").json()
    assert group["tokens_kept"] is False and group["nearest_kept"] == 1
    rollout = group["rollouts"][0]
    assert rollout["completion"] and rollout["completion_ids"]
    assert rollout["token_logprobs"] == [] and not any(rollout["control_token_probs"].values())
    assert rollout["tokens_kept"] is False and rollout["generator_logprobs"] is None
    kept_rollout = client.get(f"/api/runs/{run_id}/steps/5/groups/0").json()["rollouts"][0]
    assert len(kept_rollout["generator_logprobs"]) == len(kept_rollout["completion_ids"])


SPIKE, DROP = SPIKE_PROBES[0], DROP_PROBES[0]


def _scenario(name: str, step: int, rng: random.Random) -> tuple[dict, dict]:
    """(step columns, metrics) of one step of a scenario that trips one rule or none."""
    values: dict = {"reward_mean": 0.5, "true_accuracy": 0.5, "zero_std_share": 0.2}
    metrics: dict = {SPIKE: rng.uniform(0, 0.02), DROP: rng.uniform(0.95, 1.0), COLLAPSED: 0.0}
    if name.startswith("every_position") or name in ("solved", "stuck", "solved_dips"):
        metrics |= {p: rng.uniform(0, 0.02) for p in SPIKE_PROBES}
        metrics |= {p: rng.uniform(0.95, 1.0) for p in DROP_PROBES}
        metrics |= {SOLVED_GROUPS: 0.1, STUCK_GROUPS: 0.1}
    if name == "every_position_rise":  # each misplaced probe spikes at its own steps
        for i, p in enumerate(SPIKE_PROBES):
            if step in (20 + 15 * i, 21 + 15 * i):
                metrics[p] = 0.7
    if name == "every_position_fall":  # each probe where a token belongs falls in turn
        for i, p in enumerate(DROP_PROBES):
            if 25 + 20 * i <= step < 30 + 20 * i:
                metrics[p] = 0.2
    if name == "spike" and step in (30, 31, 55):
        metrics[SPIKE] = 0.8
    if name == "drop" and 40 <= step < 48:
        metrics[DROP] = 0.1
    if name.startswith("collapse") and (20 <= step < 26 or step == 70):
        metrics[COLLAPSED] = 0.75
    if name == "one_bad_group" and step in (20, 50, 51 + 5):  # isolated bad groups
        metrics[COLLAPSED] = 1.0
    if name == "hacking":
        values["reward_mean"] = min(1.0, 0.2 + step / 60)
    if name == "signal_loss" and 30 <= step < 60:  # recorded without the solved/stuck split
        values["zero_std_share"] = 1.0
    if name == "solved" and step >= 30:  # all 8 right in every group
        values |= {"reward_mean": 1.0, "true_accuracy": 1.0, "zero_std_share": 1.0}
        metrics |= {SOLVED_GROUPS: 1.0, STUCK_GROUPS: 0.0}
    if name == "solved_dips" and step >= 10:  # converged, with a dip: solved again (25 quiet)
        metrics |= {SOLVED_GROUPS: 0.0 if 40 <= step <= 50 else 1.0, STUCK_GROUPS: 0.0}
    if name == "stuck" and 30 <= step < 60:  # all 8 wrong
        values |= {"reward_mean": 0.0, "true_accuracy": 0.0, "zero_std_share": 1.0}
        metrics |= {SOLVED_GROUPS: 0.0, STUCK_GROUPS: 1.0}
    if name == "sparse_probes":
        if step % 3:
            del metrics[SPIKE], metrics[DROP]  # logged every third step only
        elif step in (45, 90):
            metrics[SPIKE] = 0.9
    if name == "gaps" and step % 7 == 0:
        values["true_accuracy"] = None
    return values, metrics


RESTART_EVERY = 7  # steps between a step-by-step alert test's recorder rebuilds


@pytest.mark.parametrize(
    ("scenario", "fires", "prompts_per_step"),
    [
        ("healthy", set(), 1),
        ("spike", {"control_token_spike"}, 1),
        ("drop", {"control_token_spike"}, 1),
        ("every_position_rise", {"control_token_spike"}, 1),
        ("every_position_fall", {"control_token_spike"}, 1),
        ("collapse", {"collapse"}, 1),
        ("collapse_wide", {"collapse"}, 2),
        ("collapse_8", {"collapse"}, 8),
        ("one_bad_group", set(), 1),
        ("hacking", {"reward_hacking"}, 1),
        ("signal_loss", {"signal_loss"}, 1),
        ("stuck", {"signal_loss"}, 3),
        ("solved", {"solved"}, 1),
        ("solved_dips", {"solved"}, 2),
        ("sparse_probes", {"control_token_spike"}, 1),
        ("gaps", set(), 1),
    ],
)
def test_step_by_step_alerts_equal_a_from_scratch_evaluation(
    session_factory: sessionmaker[Session], scenario: str, fires: set[str], prompts_per_step: int
) -> None:
    run_id = make_run(session_factory, steps=0, prompts_per_step=prompts_per_step)
    rng = random.Random(scenario)
    records = []
    for step in range(1, 101):
        values, metrics = _scenario(scenario, step, rng)
        records.append(step_record(step, values=values, metrics=metrics))
    # Each RESTART_EVERY steps by a recorder rebuilt from the database (as after a restart: its
    # alert windows reloaded from the steps before), the steps between by the one kept (as a
    # trainer's writer): both paths, the rebuilds falling at every place in the scenarios' windows
    for start in range(0, len(records), RESTART_EVERY):
        record_steps(session_factory, run_id, records[start : start + RESTART_EVERY])
    with session_scope(session_factory) as session:
        stored = queries.alerts(session, run_id=run_id)
        scratch = [a.as_dict() for a in queries.evaluate_alerts(session, run_id=run_id, after=0)]
        assert store.get_run(session, run_id=run_id).alerts_through == 100
        assert stored == scratch
        assert {a["kind"] for a in stored} == fires
        if scenario == "every_position_rise":  # each misplaced probe, once
            assert sorted(a["series"] for a in stored) == sorted(SPIKE_PROBES)
        if scenario == "every_position_fall":
            assert sorted(a["series"] for a in stored) == sorted(DROP_PROBES)
        if scenario.startswith("collapse"):  # step 70's lone bad step is one only with 8 groups
            assert [a["step"] for a in stored] == {
                "collapse": [22],
                "collapse_wide": [21],
                "collapse_8": [20, 70],
            }[scenario]
        if scenario == "solved_dips":  # the 25-step mean is under 80% for steps 45-69
            assert [a["step"] for a in stored] == [29, 70]
        assert all(
            a["severity"] == ("info" if a["kind"] == "solved" else "warning") for a in stored
        )
        assert queries.alerts(session, run_id=run_id, since=50) == [
            a for a in scratch if a["step"] > 50
        ]


def test_retention_is_a_launch_setting() -> None:
    from rollout_lens.server.core.runconfig import RunConfig
    from rollout_lens.server.webapp.pages.launch_fields import defaults, parse_form

    _, raw = parse_form(defaults())  # the form as it first appears: the field left empty
    assert raw["keep_tokens_every"] is None
    assert RunConfig.model_validate(raw).run_columns()["keep_tokens_every"] is None
    _, raw = parse_form(defaults() | {"keep_tokens_every": "50"})
    assert RunConfig.model_validate(raw).run_columns()["keep_tokens_every"] == 50
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        RunConfig.model_validate(parse_form(defaults() | {"keep_tokens_every": "0"})[1])
