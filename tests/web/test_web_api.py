"""The JSON API (every page's twin) on a real SQLite file and on PostgreSQL."""

from __future__ import annotations

import random

import pytest
from rollout_lens.server import store
from rollout_lens.server.core.vocab import STEP_SERIES
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.store.models import RunStatus
from sqlalchemy.orm import Session, sessionmaker

from tests.factories import CONTROL_TOKENS, make_groups, make_rollouts, make_run, record_step


def _record(factory: sessionmaker[Session], run_id: int, step: int, **values: float) -> None:
    rollouts = make_rollouts(random.Random(step))
    metrics: dict[str, float | None] = {"ctrl/</assistant>/max": 0.5}
    record_step(factory, run_id, step, values=dict(values), rollouts=rollouts, metrics=metrics)


def test_runs_api_filters_narrows_and_sorts(session_factory, client) -> None:
    a = make_run(session_factory, steps=3, seed=1, name="alpha")
    b = make_run(session_factory, steps=2, seed=2, name="beta")
    with session_scope(session_factory) as session:
        store.mark_finished(session, run_id=a, status=RunStatus.completed)
    runs = client.get("/api/runs").json()["runs"]
    assert [r["id"] for r in runs] == [b, a]
    assert runs[1]["status"] == "completed" and runs[1]["current_step"] == 3
    assert {"recent_true_accuracy", "recent_reward", "device_minutes", "cost", "config"} <= set(
        runs[0]
    )
    assert [r["name"] for r in client.get("/api/runs?sort=name&order=asc").json()["runs"]] == [
        "alpha",
        "beta",
    ]
    assert [r["id"] for r in client.get("/api/runs?q=bet").json()["runs"]] == [b]
    # What a live runs page polls: the runs it follows, plus any newer than the newest it shows.
    c = make_run(session_factory, steps=1, seed=3, name="gamma")
    polled = client.get(f"/api/runs?ids={a}&after={b}").json()
    assert {r["id"] for r in polled["runs"]} == {a, c} and polled["newest"] == c
    assert client.get("/api/runs?sort=nope").status_code == 400
    assert client.get("/api/runs?ids=x").status_code == 400


def test_run_api_names_its_series(session_factory, client) -> None:
    run_id = make_run(session_factory, steps=4)
    data = client.get(f"/api/runs/{run_id}").json()
    assert data["run"]["id"] == run_id and data["run"]["control_tokens"] == list(CONTROL_TOKENS)
    assert (data["first_step"], data["last_step"]) == (1, 4)
    assert data["series_names"] == [*STEP_SERIES, "ctrl/</assistant>/max"]


def test_series_with_a_cursor_returns_only_new_steps(session_factory, client) -> None:
    run_id = make_run(session_factory, steps=30)
    full = client.get(f"/api/runs/{run_id}/series").json()
    assert full["bucket"] == 1 and full["cursor"] == 30
    reward = full["series"]["reward_mean"]
    assert reward["x"] == list(range(1, 31)) and "lo" not in reward
    assert full["series"]["ctrl/</assistant>/max"]["x"] == list(range(1, 31))
    assert "kl" not in full["series"]  # never recorded: left out rather than sent as nulls
    assert full["run"]["current_step"] == 30 and full["run"]["active"] is True
    assert full["buckets"]["start"] == [1, 26] and full["buckets"]["n"] == [25, 5]
    with session_scope(session_factory) as session:
        steps = store.steps(session, run_id=run_id)
    mean = sum(s.true_accuracy for s in steps[:25]) / 25
    assert full["buckets"]["true_accuracy"][0] == pytest.approx(mean)

    names = "reward_mean,ctrl/</assistant>/max"
    assert client.get(f"/api/runs/{run_id}/series?names={names}&since=30").json()["series"] == {}
    _record(session_factory, run_id, 31, reward_mean=0.25, true_accuracy=1.0)
    _record(session_factory, run_id, 32, reward_mean=0.75, true_accuracy=0.0)
    update = client.get(f"/api/runs/{run_id}/series?names={names}&since=30").json()
    assert update["cursor"] == 32
    assert update["series"]["reward_mean"] == {"x": [31, 32], "y": [0.25, 0.75]}
    assert set(update["series"]) == {"reward_mean", "ctrl/</assistant>/max"}
    # The bucket the new steps fall in comes back whole, so the page can replace it.
    assert update["buckets"]["start"] == [26] and update["buckets"]["n"] == [7]
    window = client.get(f"/api/runs/{run_id}/series?names=reward_mean&since=10&until=12").json()
    assert window["series"]["reward_mean"]["x"] == [11, 12]


def test_long_series_are_downsampled_keeping_spikes(session_factory, client) -> None:
    run_id = make_run(session_factory, steps=3)
    spike_at = 47
    for step in range(4, 121):
        loss = 9.0 if step == spike_at else 0.1 + (step % 7) / 100
        _record(session_factory, run_id, step, loss=loss, reward_mean=step / 120)
    data = client.get(
        f"/api/runs/{run_id}/series?names=loss,reward_mean,ctrl/</assistant>/max&max_points=20"
    ).json()
    assert data["bucket"] == 10  # the 1-2-5 width that cuts 120 steps into ≤ 20 points
    loss = data["series"]["loss"]
    assert loss["x"][:3] == [1, 11, 21] and len(loss["x"]) == 12
    assert max(loss["hi"]) == 9.0  # the one-step spike survives as its bucket's max
    assert loss["x"][loss["hi"].index(9.0)] == 41  # in the bucket of steps 41–50
    assert all(lo <= y <= hi for lo, y, hi in zip(loss["lo"], loss["y"], loss["hi"], strict=True))
    ctrl = data["series"]["ctrl/</assistant>/max"]
    assert len(ctrl["x"]) == 12 and {"lo", "hi"} <= set(ctrl)
    assert "min" in data["method"] and "max" in data["method"]
    full = client.get(f"/api/runs/{run_id}/series?names=loss&max_points=20&full=1").json()
    assert full["bucket"] == 1 and len(full["series"]["loss"]["x"]) == 120
    assert full["series"]["loss"]["y"][spike_at - 1] == 9.0


def test_series_etag_and_memory_cache(session_factory, client) -> None:
    run_id = make_run(session_factory, steps=5)
    url = f"/api/runs/{run_id}/series?names=reward_mean"
    first = client.get(url)
    etag = first.headers["etag"]
    assert first.headers["cache-control"] == "no-cache"
    again = client.get(url, headers={"If-None-Match": etag})
    assert again.status_code == 304 and not again.content
    assert client.get(url).content == first.content
    _record(session_factory, run_id, 6, reward_mean=0.5)
    changed = client.get(url, headers={"If-None-Match": etag})
    assert changed.status_code == 200 and changed.headers["etag"] != etag
    assert changed.json()["cursor"] == 6
    assert client.get(f"/api/runs/{run_id + 1}/series").status_code == 404


def test_step_api_has_groups_votes_and_arrays(session_factory, client) -> None:
    run_id = make_run(session_factory, steps=3, seed=4)
    data = client.get(f"/api/runs/{run_id}/steps/2").json()
    assert data["step"]["step"] == 2 and data["nav"] == {
        "first": 1,
        "prev": 1,
        "next": 3,
        "last": 3,
    }
    assert data["metrics"] == {
        "ctrl/</assistant>/max": pytest.approx(data["metrics"]["ctrl/</assistant>/max"])
    }
    (summary,) = data["groups"]
    assert summary["label"] == "17 * 38" and summary["size"] == 8
    assert sum(v["count"] for v in summary["votes"]) == 8
    group = client.get(f"/api/runs/{run_id}/steps/2/groups/0").json()
    assert group["header"]["query"] == "17 * 38" and group["header"]["size"] == 8
    assert group["summary"] == summary | {"label": ""}  # a group alone is not labelled
    assert sorted(i for v in group["header"]["votes"] for i in v["rollouts"]) == list(range(8))
    rollout = group["rollouts"][0]
    assert len(rollout["completion_ids"]) == len(rollout["token_logprobs"]) == 4
    assert rollout["tokens_total"] == 4 and rollout["sampled"] is None
    assert set(rollout["control_token_probs"]) == set(CONTROL_TOKENS)
    assert all(len(p) == 4 for p in rollout["control_token_probs"].values())
    assert client.get(f"/api/runs/{run_id}/steps/9").status_code == 404


def test_a_steps_rollouts_stream_whole_in_group_order(session_factory, client) -> None:
    """/steps/{step}/rollouts.jsonl: a line a rollout, each the group JSON's rollout with every
    position (no cut), in group order; a step that reused an earlier generation streams the
    rollouts it trained on; a step that kept none streams nothing; an unknown step is a 404."""
    import json

    run_id = make_run(session_factory, steps=0)
    rng = random.Random(3)
    rollouts = make_groups(rng, groups=3, group_size=4, tokens=400)
    rollouts.reverse()  # recorded out of order: answered in group and index order
    record_step(session_factory, run_id, 1, values={"reward_mean": 0.5}, rollouts=rollouts)
    record_step(session_factory, run_id, 2, values={"reward_mean": 0.6}, rollout_step=1)
    record_step(session_factory, run_id, 3, values={"reward_mean": 0.7})
    answer = client.get(f"/api/runs/{run_id}/steps/1/rollouts.jsonl")
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in answer.text.splitlines()]
    assert [(r["group"], r["index"]) for r in lines] == sorted((r.group, r.index) for r in rollouts)
    grouped = client.get(
        f"/api/runs/{run_id}/steps/1/groups/1", params={"max_tokens": 400, "limit": 1}
    ).json()
    first = next(r for r in lines if r["group"] == 1)
    assert {k: grouped["rollouts"][0][k] for k in first} == first
    assert len(first["completion_ids"]) == len(first["token_logprobs"]) == 400  # whole
    reused = client.get(f"/api/runs/{run_id}/steps/2/rollouts.jsonl").text
    assert reused == answer.text
    assert client.get(f"/api/runs/{run_id}/steps/3/rollouts.jsonl").text == ""
    missing = client.get(f"/api/runs/{run_id}/steps/9/rollouts.jsonl")
    assert missing.status_code == 404 and "9" in missing.json()["detail"]


def test_compare_api(session_factory, client) -> None:
    a = make_run(session_factory, steps=30, seed=1, name="a")
    b = make_run(session_factory, steps=30, seed=2, name="b", listed=64)
    data = client.get(f"/api/compare?runs={a},{b}").json()
    assert [r["id"] for r in data["runs"]] == [a, b]
    assert set(data["series"]) == {str(a), str(b)}
    assert "true_accuracy" in data["series"][str(a)]["series"]
    summary = {s["run_id"]: s for s in data["summary"]}
    with session_scope(session_factory) as session:
        acc = [s.true_accuracy for s in store.steps(session, run_id=a)]
    assert summary[a]["final_accuracy"] == pytest.approx(sum(acc[-25:]) / 25)
    assert {"converged_at", "stability", "final_reward", "device_minutes", "cost"} <= set(
        summary[a]
    )
    assert {r["key"] for r in data["config_diff"]["rows"]} == {"k", "seed", "variant"}
    assert data["step"] == 30 and [s["run_id"] for s in data["side_by_side"]] == [a, b]
    assert client.get(f"/api/compare?runs={a}").status_code == 400


def test_alerts_api(session_factory, client) -> None:
    # four groups a step: one step holds enough groups for the collapse rule to judge it
    run_id = make_run(session_factory, steps=2, prompts_per_step=4)
    for step in range(3, 31):
        collapse = 0.8 if step >= 20 else 0.0
        record_step(
            session_factory,
            run_id,
            step,
            values={"reward_mean": 0.5},
            rollouts=make_rollouts(random.Random(step)),
            metrics={"state/collapse": collapse},
        )
    alerts = client.get(f"/api/runs/{run_id}/alerts").json()
    assert [(a["kind"], a["step"]) for a in alerts] == [("collapse", 20)]
    assert "20" in alerts[0]["message"] and alerts[0]["severity"] == "warning"
    # A page polling with its cursor hears of an episode once.
    assert client.get(f"/api/runs/{run_id}/alerts?since=19").json() == alerts
    assert client.get(f"/api/runs/{run_id}/alerts?since=25").json() == []


def test_openapi_documents_the_api(client) -> None:
    spec = client.get("/openapi.json").json()
    paths = set(spec["paths"])
    assert {
        "/api/runs",
        "/api/runs/{run_id}",
        "/api/runs/{run_id}/series",
        "/api/runs/{run_id}/alerts",
        "/api/runs/{run_id}/steps/{step}",
        "/api/runs/{run_id}/steps/{step}/groups/{group}",
        "/api/compare",
    } <= paths
    assert not any(
        p == "/" or p.startswith("/runs") for p in paths
    )  # pages stay out of the API docs
    params = {p["name"]: p for p in spec["paths"]["/api/runs/{run_id}/series"]["get"]["parameters"]}
    assert {"names", "since", "until", "full", "max_points"} <= set(params)
    assert params["since"]["description"]


def test_openapi_describes_the_422_bodies_sent(client) -> None:
    """Regression (schemathesis): the schema published FastAPI's default 422 (`detail` a list)
    while every 422 is `{"detail": message, "errors": [...]}`."""
    spec = client.get("/openapi.json").json()
    shape = spec["components"]["schemas"]["HTTPValidationError"]
    assert shape["properties"]["detail"]["type"] == "string"
    assert shape["properties"]["errors"]["type"] == "array"
    body = client.get("/api/runs/0").json()
    assert set(body) == {"detail", "errors"} and isinstance(body["detail"], str)
    assert body["errors"][0]["loc"] == ["path", "run_id"]
