"""Launching, cancelling and resuming from the dashboard: the form, POST /api/runs, presets,
validation through RunConfig, a broker that is down, and live state (no worker here: the embedded
broker keeps the messages as files in the test's folder)."""

from __future__ import annotations

import dataclasses
import json
import random
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from fastapi.testclient import TestClient
from rollout_lens.server import store
from rollout_lens.server.core.config import Settings
from rollout_lens.server.core.errors import BrokerUnavailable
from rollout_lens.server.core.presets import PRESET_GROUPS
from rollout_lens.server.core.runconfig import RunConfig
from rollout_lens.server.core.task_vocab import REAL
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.store.models import RunRow, RunStatus, utcnow
from rollout_lens.server.webapp import control
from rollout_lens.server.webapp.app import create_app
from rollout_lens.server.webapp.pages import launch_fields
from rollout_lens.trainer.worker.modelref import unusable
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from tests.factories import make_rollouts, make_run, record_step, run_count
from tests.waiting import returns
from tests.web_support import client_for, parse

BROKER_DOWN = "redis://127.0.0.1:1/0"

# One bad value per RunConfig field: (field, JSON value, form text, words of the message).
# test_every_field_has_a_validation_case keeps it complete as RunConfig grows.
BAD_VALUES: list[tuple[str, Any, str, str]] = [
    ("name", "x" * 201, "x" * 201, "at most 200 characters"),
    ("turns", "many", "many", "'single' or 'multi'"),
    ("variant", "medium", "medium", "'leaky' or 'patched'"),
    ("episodes", "triple", "triple", "'single', 'chain' or 'mixed'"),
    ("max_calls", 17, "17", "at most 16"),
    ("k", 65, "65", "at most 64"),
    # Whether a model folder exists is the worker's to check (test_worker); the web app knows
    # only that a model must be named.
    ("model", "", "", "at least 1 character"),
    ("steps", 100_001, "100001", "at most 100000"),
    ("group_size", 1, "1", "at least 2"),
    ("prompts_per_step", 0, "0", "at least 1"),
    ("learning_rate", -0.001, "-1e-3", "greater than 0"),
    ("temperature", 0, "0", "greater than 0"),
    ("max_completion_tokens", 0, "0", "at least 1"),
    ("kl_coef", -1, "-1", "at least 0"),
    ("num_iterations", 17, "17", "at most 16"),
    ("verifier", "lenient", "lenient", "unknown verifier 'lenient'"),
    ("verifier_noise", 1.5, "1.5", "at most 1"),
    ("seed", -1, "-1", "at least 0"),
    ("supervision", "magic", "magic", "'offpolicy'"),
    ("supervised_per_group", 64, "64", "at most 63"),
    ("sft_every", 0, "0", "at least 1"),
    ("sft_steps", 0, "0", "at least 1"),
    ("sft_learning_rate", 0, "0", "greater than 0"),
    ("eval_every", -5, "-5", "at least 0"),
    ("keep_tokens_every", 0, "0", "at least 1"),
    ("control_tokens", "<tool>", None, "must be a list"),
]
# Values that are fine alone but not together: the message goes next to the field it names.
BAD_COMBINATIONS = [
    (
        {"supervision": "hint", "supervised_per_group": 8},
        "supervised_per_group",
        "smaller than Group size G",
    ),
    (
        {"supervision": "offpolicy", "group_size": 4, "supervised_per_group": 4},
        "supervised_per_group",
        "smaller than Group size G",
    ),
    ({"steps": "many"}, "steps", "Steps must be a whole number"),
    (
        {"turns": "multi", "max_completion_tokens": 16},
        "max_completion_tokens",
        "at least 32 for a multi-turn run",
    ),
    (
        {"turns": "multi", "max_completion_tokens": 128, "supervision": "offpolicy"},
        "supervision",
        "single-turn only",
    ),
    ({"learning_rate": "fast"}, "learning_rate", "Learning rate must be a number"),
]


@pytest.fixture
def down_client(session_factory: sessionmaker[Session], tmp_path: Path) -> TestClient:
    return client_for(session_factory, data_dir=tmp_path, broker_url=BROKER_DOWN)


def messages(tmp_path: Path) -> int:
    """Task messages waiting in the embedded broker's folder."""
    folder = tmp_path / "broker" / "queue"
    return len(list(folder.iterdir())) if folder.is_dir() else 0


def form_data(**changes: str) -> dict[str, str]:
    """What the browser submits: every field's text, as the form shows it, with `changes`."""
    return launch_fields.defaults() | changes


def failed_run(factory: sessionmaker[Session], *, error: str, **columns: Any) -> int:
    """A recorded run that ended `failed` with `error`, as the worker leaves one."""
    run_id = make_run(factory, status=RunStatus.running, **columns)
    with session_scope(factory) as session:
        store.mark_finished(session, run_id=run_id, status=RunStatus.failed, error=error)
    return run_id


def get_run(factory: sessionmaker[Session], run_id: int) -> RunRow:
    with session_scope(factory) as session:
        return store.get_run(session, run_id=run_id)


# --- validation ---------------------------------------------------------------------------------


def test_every_field_has_a_validation_case() -> None:
    assert {case[0] for case in BAD_VALUES} == set(RunConfig.model_fields)


@pytest.mark.parametrize(
    ("field", "value", "text", "words"), BAD_VALUES, ids=[c[0] for c in BAD_VALUES]
)
def test_api_rejects_a_bad_value_and_creates_nothing(
    client: TestClient,
    session_factory: sessionmaker[Session],
    tmp_path: Path,
    field: str,
    value: Any,
    text: str,
    words: str,
) -> None:
    response = client.post("/api/runs", json={field: value})
    assert response.status_code == 422
    errors = response.json()["errors"]
    assert [e["loc"] for e in errors] == [["body", field]]
    assert words in errors[0]["msg"]
    assert field in response.json()["detail"]
    assert run_count(session_factory) == 0 and messages(tmp_path) == 0


@pytest.mark.parametrize(
    ("field", "value"),
    [("name", "a\x00b"), ("model", "tiny\x00"), ("control_tokens", ["<tool>", "\x00"])],
)
def test_api_rejects_a_nul_character_in_text_and_creates_nothing(
    client: TestClient,
    session_factory: sessionmaker[Session],
    tmp_path: Path,
    field: str,
    value: Any,
) -> None:
    """Regression: a NUL in a run's name was stored on SQLite and a 500 on PostgreSQL (which
    stores no NUL in text)."""
    response = client.post("/api/runs", json={field: value})
    assert response.status_code == 422, response.text
    errors = response.json()["errors"]
    assert [e["loc"] for e in errors] == [["body", field]]
    assert "NUL" in errors[0]["msg"]
    assert run_count(session_factory) == 0 and messages(tmp_path) == 0


@pytest.mark.parametrize(("values", "field", "words"), BAD_COMBINATIONS)
def test_api_puts_a_cross_field_error_on_the_field_it_names(
    client: TestClient,
    session_factory: sessionmaker[Session],
    tmp_path: Path,
    values: dict[str, Any],
    field: str,
    words: str,
) -> None:
    response = client.post("/api/runs", json=values)
    assert response.status_code == 422
    errors = {e["loc"][-1]: e["msg"] for e in response.json()["errors"]}
    assert words in errors[field]
    assert run_count(session_factory) == 0 and messages(tmp_path) == 0


def test_api_rejects_unknown_settings_and_presets(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    response = client.post("/api/runs", json={"stepz": 5})
    assert response.status_code == 422
    assert response.json()["errors"][0]["msg"] == "stepz is not a setting of a run"
    response = client.post("/api/runs", json={"preset": "leaky_vs_sideways"})
    assert response.status_code == 422 and "leaky_vs_patched" in response.json()["errors"][0]["msg"]
    # A sweep sets its own learning rates: overriding them would launch three equal runs.
    response = client.post("/api/runs", json={"preset": "lr_sweep", "learning_rate": 0.01})
    assert response.status_code == 422
    assert response.json()["errors"][0]["loc"] == ["body", "learning_rate"]
    assert run_count(session_factory) == 0


@pytest.mark.parametrize(
    ("field", "value", "text", "words"),
    [c for c in BAD_VALUES if c[2] is not None],
    ids=[c[0] for c in BAD_VALUES if c[2] is not None],
)
def test_form_shows_the_message_next_to_the_field_and_keeps_the_values(
    client: TestClient,
    session_factory: sessionmaker[Session],
    tmp_path: Path,
    field: str,
    value: Any,
    text: str,
    words: str,
) -> None:
    other = "seed" if field != "seed" else "steps"
    typed = form_data(**{other: "42", field: text})  # `other`: typed too, must survive the error
    response = client.post("/runs/new", data=typed, follow_redirects=False)
    assert response.status_code == 422
    page = parse(response.text)
    box = page.by_id(f"f-{field}").attrs
    assert box["aria-invalid"] == "true" and f"err-{field}" in box["aria-describedby"]
    assert words in page.by_id(f"err-{field}").text
    field_div = next(d for d in page.find_all("div", cls="field") if d.find_all(id=f"f-{field}"))
    assert "invalid" in field_div.classes
    assert [d for d in page.find_all("div", cls="invalid")] == [field_div]  # only that field
    for name, value_typed in typed.items():
        control = page.by_id(f"f-{name}")
        shown = (
            next(o for o in control.find_all("option") if "selected" in o.attrs).attrs["value"]
            if control.tag == "select"
            else control.attrs.get("value", "")
        )
        assert shown == value_typed, name
    assert "nothing was launched" in page.by_id("form-errors").text
    assert run_count(session_factory) == 0 and messages(tmp_path) == 0


def test_form_puts_the_group_size_message_next_to_supervised_per_group(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    response = client.post(
        "/runs/new", data=form_data(supervision="offpolicy", supervised_per_group="8")
    )
    assert response.status_code == 422
    page = parse(response.text)
    assert "smaller than Group size G" in page.by_id("err-supervised_per_group").text
    assert run_count(session_factory) == 0


def test_the_form_has_every_field_with_its_default_and_help(client: TestClient) -> None:
    page = parse(client.get("/runs/new").text)
    for name, info in RunConfig.model_fields.items():
        control = page.by_id(f"f-{name}")
        assert control.attrs.get("name") == name
        assert info.description and info.description in page.by_id(f"help-{name}").text
    assert page.by_id("f-steps").attrs["value"] == str(RunConfig().steps)
    assert page.by_id("f-learning_rate").attrs["value"] == "0.0003"
    groups = [g.find("legend").text for g in page.find_all("fieldset")]
    assert groups == ["Task", "Model", "GRPO", "Supervision", "Evaluation and storage"]
    presets = {a.attrs["data-preset"] for a in page.find_all("a", cls="preset")}
    assert presets == set(launch_fields.PRESETS)
    assert (
        "novalidate" in page.by_id("launch-form").attrs
    )  # the server's messages, not the browser's


def test_presets_fill_the_form(client: TestClient) -> None:
    page = parse(client.get("/runs/new?preset=leaky").text)
    assert page.find("option", value="leaky").attrs.get("selected") is not None
    page = parse(client.get("/runs/new?preset=hint").text)
    values = {n: page.by_id(f"f-{n}") for n in ("learning_rate", "steps", "supervised_per_group")}
    assert values["learning_rate"].attrs["value"] == "0.001"
    assert values["steps"].attrs["value"] == "300"
    assert page.find("option", value="hint").attrs.get("selected") is not None
    page = parse(client.get("/runs/new?preset=lr_sweep").text)
    assert page.by_id("f-learning_rate").attrs.get("disabled") is not None
    assert "per run: lr 1e-04, lr 3e-04, lr 1e-03" in page.by_id("f-learning_rate").attrs["value"]
    assert page.find("input", type="hidden", name="preset").attrs["value"] == "lr_sweep"
    assert page.by_id("launch-button").text == "Launch 3 runs"
    assert client.get("/runs/new?preset=nope").status_code == 400


def test_presets_api_lists_presets_and_every_field(client: TestClient) -> None:
    data = client.get("/api/presets").json()
    assert [p["name"] for p in data["presets"]] == list(launch_fields.PRESETS)
    fields = {f["name"]: f for f in data["fields"]}
    assert set(fields) == set(RunConfig.model_fields)
    assert fields["k"]["min"] == 1 and fields["k"]["max"] == 64 and fields["k"]["default"] == "4"
    assert fields["supervision"]["options"] == [
        "none",
        "offpolicy",
        "hint",
        "interleaved_sft",
        "sft_then_rl",
        "format_warmup",
    ]


# --- launching ----------------------------------------------------------------------------------


def test_api_launches_a_run_and_queues_it_once(
    client: TestClient, session_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    response = client.post("/api/runs", json={"variant": "leaky", "steps": 12, "seed": 4})
    assert response.status_code == 201
    body = response.json()
    (run,) = body["runs"]
    assert body["url"] == f"/runs/{run['id']}"
    assert run["status"] == "queued" and run["queue_position"] == 1
    assert (run["variant"], run["k"], run["total_steps"], run["seed"]) == ("leaky", None, 12, 4)
    expected = RunConfig(variant="leaky", steps=12, seed=4).model_dump(mode="json")
    assert get_run(session_factory, run["id"]).config == expected
    assert run_count(session_factory) == 1 and messages(tmp_path) == 1


def test_api_launches_a_preset_with_overrides(
    client: TestClient, session_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    body = client.post(
        "/api/runs", json={"preset": "leaky_vs_patched", "steps": 8, "seed": 3}
    ).json()
    leaky, patched = body["runs"]
    assert body["url"] == f"/compare?runs={leaky['id']},{patched['id']}"
    assert (leaky["variant"], patched["variant"], patched["k"]) == ("leaky", "patched", 4)
    configs = [get_run(session_factory, r["id"]).config for r in (leaky, patched)]
    same = {k for k in configs[0] if configs[0][k] == configs[1][k]}
    assert set(configs[0]) - same == {"variant", "name"}  # same seed and recipe otherwise
    assert configs[0]["seed"] == 3 and configs[0]["steps"] == 8
    sweep = client.post("/api/runs", json={"preset": "lr_sweep", "steps": 8}).json()["runs"]
    assert [get_run(session_factory, r["id"]).config["learning_rate"] for r in sweep] == [
        1e-4,
        3e-4,
        1e-3,
    ]
    assert len({r["name"] for r in sweep}) == 3 and len({r["seed"] for r in sweep}) == 1
    assert [r["queue_position"] for r in sweep] == [3, 4, 5]
    assert messages(tmp_path) == 5


def test_a_pretrained_model_launches_the_pair_on_its_own_defaults(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    """The seed's pair on a model other than the tiny one takes a pretrained model's budget and
    learning rates (the API answers with the effective values); a value given is kept."""
    model = "/models/smollm2-135m-instruct"  # checked where it trains, not here
    body = client.post("/api/runs", json={"preset": "leaky_vs_patched", "model": model}).json()
    configs = [get_run(session_factory, r["id"]).config for r in body["runs"]]
    for config in configs:
        assert config["model"] == model
        assert (config["max_completion_tokens"], config["learning_rate"]) == (32, 1e-5)
        assert config["sft_learning_rate"] == 1e-5
    (given,) = client.post("/api/runs", json={"model": model, "learning_rate": 3e-6}).json()["runs"]
    assert get_run(session_factory, given["id"]).config["learning_rate"] == 3e-6
    fields = {f["name"]: f for f in client.get("/api/presets").json()["fields"]}
    assert fields["learning_rate"]["default_by_recipe"]["pretrained/single"] == "1e-05"
    assert fields["max_completion_tokens"]["default_by_recipe"]["tiny/multi"] == "128"


@pytest.mark.parametrize("name", [n for n, p in launch_fields.PRESETS.items() if not p.compares])
def test_each_single_run_preset_launches_what_it_says(
    client: TestClient, session_factory: sessionmaker[Session], name: str
) -> None:
    preset = launch_fields.PRESETS[name]
    (run,) = client.post("/api/runs", json={"preset": name}).json()["runs"]
    config = get_run(session_factory, run["id"]).config
    assert {k: config[k] for k in preset.base} == dict(preset.base)
    collapse_study = next(names for title, _, names in PRESET_GROUPS if title == "Collapse study")
    if name in collapse_study:  # bench/collapse.py's recipe
        assert config["learning_rate"] == 1e-3 and config["steps"] == 300
    if name.startswith("multi_"):  # the tool loop, with room for calls, results and an answer
        assert config["turns"] == "multi" and config["max_completion_tokens"] >= 32
    if name in ("multi_collapse", "multi_sft_then_rl", "multi_interleaved_sft"):  # the study
        assert config["learning_rate"] == 3e-3 and config["steps"] == 200
    if name in ("leaky", "patched", "multi_leaky", "multi_patched", "real_patched"):
        assert config["verifier"] == "judge" and config["verifier_noise"] == 0.12  # the seed's
    if name == "real_patched":  # the real model by name, on the format warm-up
        assert config["model"] == REAL and config["supervision"] == "format_warmup"


def test_the_real_pair_launches_both_variants_on_the_real_model(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    """real_leaky_vs_patched: two queued runs of the real model on the same recipe and seed,
    leaky and patched, opened side by side like every pair."""
    body = client.post("/api/runs", json={"preset": "real_leaky_vs_patched"}).json()
    configs = [get_run(session_factory, r["id"]).config for r in body["runs"]]
    assert [c["variant"] for c in configs] == ["leaky", "patched"]
    assert body["url"].startswith("/compare?runs=")
    same = {k: v for k, v in configs[0].items() if k not in ("variant", "name")}
    assert same == {k: v for k, v in configs[1].items() if k not in ("variant", "name")}
    assert same["model"] == REAL and same["supervision"] == "format_warmup"


def test_form_launches_a_run_and_opens_it(
    client: TestClient, session_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    response = client.post(
        "/runs/new", data=form_data(steps="9", seed="5", control_tokens=""), follow_redirects=False
    )
    assert response.status_code == 303
    (run_id,) = [r.id for r in _runs(session_factory)]
    assert response.headers["location"] == f"/runs/{run_id}"
    config = get_run(session_factory, run_id).config
    # The form starts on the presets' verifier (judge), not RunConfig's exact.
    assert config == RunConfig(steps=9, seed=5, **launch_fields.FORM_DEFAULTS).model_dump(
        mode="json"
    )
    assert config["verifier"] == "judge"
    assert messages(tmp_path) == 1


def test_form_launches_leaky_vs_patched_and_opens_the_comparison(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    data = form_data(steps="6", seed="2")
    del data["variant"]  # disabled on the form: the preset sets it per run
    response = client.post(
        "/runs/new", data=data | {"preset": "leaky_vs_patched"}, follow_redirects=False
    )
    ids = [r.id for r in _runs(session_factory)]
    assert (
        response.status_code == 303
        and response.headers["location"] == f"/compare?runs={ids[0]},{ids[1]}"
    )
    runs = _runs(session_factory)
    assert [(r.variant, r.seed, r.total_steps) for r in runs] == [
        ("leaky", 2, 6),
        ("patched", 2, 6),
    ]
    compare = client.get(response.headers["location"])
    assert compare.status_code == 200


def _runs(factory: sessionmaker[Session]) -> list[RunRow]:
    with session_scope(factory) as session:
        return list(session.scalars(select(RunRow).order_by(RunRow.id)))


def test_clone_fills_the_form_with_a_runs_config(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    (named,) = client.post(
        "/api/runs",
        json={"name": "my lr test", "learning_rate": 0.001, "supervision": "hint", "k": 6},
    ).json()["runs"]
    page = parse(client.get(f"/runs/new?clone={named['id']}").text)
    assert page.by_id("f-name").attrs["value"] == "my lr test"
    assert page.by_id("f-learning_rate").attrs["value"] == "0.001"
    assert page.by_id("f-k").attrs["value"] == "6"
    assert page.find("option", value="hint").attrs.get("selected") is not None
    assert f"#{named['id']}" in page.by_id("clone-note").text
    (derived,) = client.post("/api/runs", json={"variant": "leaky"}).json()["runs"]
    page = parse(client.get(f"/runs/new?clone={derived['id']}").text)
    assert page.by_id("f-name").attrs["value"] == ""  # derived again from what the user changes
    # A run recorded from a user's own script has no launch config: its columns fill the form.
    scripted = make_run(session_factory, steps=2, seed=9, config={})
    page = parse(client.get(f"/runs/new?clone={scripted}").text)
    assert (
        page.by_id("f-seed").attrs["value"] == "9" and "own script" in page.by_id("clone-note").text
    )
    # A callback run's config is its GRPOConfig, not ours: its columns fill the form too.
    external = make_run(
        session_factory,
        steps=2,
        seed=7,
        source="callback",
        config={"learning_rate": 0.5, "num_generations": 4, "judged": {"vote": False}},
    )
    page = parse(client.get(f"/runs/new?clone={external}").text)
    assert page.by_id("f-seed").attrs["value"] == "7"
    assert page.by_id("f-learning_rate").attrs["value"] != "0.5"
    assert "not launched here" in page.by_id("clone-note").text
    assert client.get("/runs/new?clone=999").status_code == 404
    run_page = parse(client.get(f"/runs/{named['id']}").text)
    assert run_page.by_id("clone-link").attrs["href"] == f"/runs/new?clone={named['id']}"


# --- the broker is down -------------------------------------------------------------------------


def test_broker_down_is_a_503_and_nothing_is_created(
    down_client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    # Each refusal waits on the broker's short connect timeout (about a second in all here); a
    # default retry loop would hang: `returns` fails that.
    response = returns(lambda: down_client.post("/api/runs", json={"steps": 5}), "the API's launch")
    assert response.status_code == 503
    assert (
        "task queue" in response.json()["detail"]
        and "cannot be reached" in response.json()["detail"]
    )
    assert run_count(session_factory) == 0
    response = returns(
        lambda: down_client.post("/runs/new", data=form_data(steps="33", seed="8")), "the form's"
    )
    assert response.status_code == 503
    page = parse(response.text)
    assert "nothing was launched" in page.by_id("broker-error").text
    assert (
        page.by_id("f-steps").attrs["value"] == "33" and page.by_id("f-seed").attrs["value"] == "8"
    )
    assert run_count(session_factory) == 0


def test_an_enqueue_that_fails_midway_leaves_no_runs(
    client: TestClient, session_factory: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The broker accepted the check, then went away before the second message: the one thing
    # here that cannot be made to happen for real on cue.
    sent: list[int] = []

    def flaky_enqueue(app: Celery, *, run_id: int, timeout: float = 3.0) -> str:
        if sent:
            raise BrokerUnavailable("the task queue at redis://… cannot be reached: gone")
        sent.append(run_id)
        return "task"

    monkeypatch.setattr(control, "enqueue_run", flaky_enqueue)
    response = client.post("/api/runs", json={"preset": "leaky_vs_patched"})
    assert response.status_code == 503 and len(sent) == 1
    assert run_count(session_factory) == 0  # the first run's message finds no run: skipped


def test_resume_with_the_broker_down_changes_nothing(
    down_client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    run_id = failed_run(session_factory, steps=3, error="OOM at step 3")
    assert down_client.post(f"/api/runs/{run_id}/resume").status_code == 503
    run = get_run(session_factory, run_id)
    assert (run.status, run.error) == ("failed", "OOM at step 3")
    response = down_client.post(f"/runs/{run_id}/resume", follow_redirects=False)
    assert response.status_code == 303 and response.headers["location"] == f"/runs/{run_id}"
    page = parse(down_client.get(response.headers["location"]).text)
    assert "Not resumed" in page.by_id("notice").text
    assert "cannot be reached" in page.by_id("notice").text


# --- cancel, resume, live state -----------------------------------------------------------------


def test_cancel_and_resume_through_the_api(
    client: TestClient, session_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    (run,) = client.post("/api/runs", json={"steps": 5}).json()["runs"]
    run_id = run["id"]
    response = client.post(f"/api/runs/{run_id}/cancel")
    assert response.status_code == 200
    live = response.json()
    assert live["status"] == "cancelled" and live["can_resume"] and not live["can_cancel"]
    again = client.post(f"/api/runs/{run_id}/cancel")
    assert again.status_code == 409 and "only queued or running" in again.json()["detail"]
    live = client.post(f"/api/runs/{run_id}/resume").json()
    assert live["status"] == "queued" and live["queue_position"] == 1 and live["can_cancel"]
    assert messages(tmp_path) == 2  # launched, then resumed
    assert client.post(f"/api/runs/{run_id}/resume").status_code == 409
    assert client.post("/api/runs/999/cancel").status_code == 404


def test_cancelling_a_running_run_asks_it_to_stop(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    run_id = make_run(session_factory, steps=3, status=RunStatus.running, total_steps=50)
    live = client.post(f"/api/runs/{run_id}/cancel").json()
    assert live["status"] == "running" and live["cancel_requested"] and not live["can_cancel"]
    assert "stopping (cancel requested)" in live["summary"]
    assert get_run(session_factory, run_id).cancel_requested is True


def test_run_page_buttons_post_and_come_back(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    (run,) = client.post("/api/runs", json={"steps": 5}).json()["runs"]
    page = parse(client.get(f"/runs/{run['id']}").text)
    assert (
        "hidden" not in page.by_id("cancel-form").attrs
        and "hidden" in page.by_id("resume-form").attrs
    )
    assert page.by_id("cancel-form").attrs["action"] == f"/runs/{run['id']}/cancel"
    assert page.by_id("run-live").text == "Queued, 1st in line: waiting for a worker"
    response = client.post(f"/runs/{run['id']}/cancel", follow_redirects=False)
    assert response.status_code == 303 and response.headers["location"] == f"/runs/{run['id']}"
    page = parse(client.get(f"/runs/{run['id']}").text)
    assert (
        "hidden" in page.by_id("cancel-form").attrs
        and "hidden" not in page.by_id("resume-form").attrs
    )
    response = client.post(f"/runs/{run['id']}/cancel", follow_redirects=False)  # already cancelled
    page = parse(client.get(response.headers["location"]).text)
    assert "only queued or running runs can be cancelled" in page.by_id("notice").text
    response = client.post(f"/runs/{run['id']}/resume", follow_redirects=False)
    assert response.headers["location"] == f"/runs/{run['id']}"
    assert get_run(session_factory, run["id"]).status == "queued"


def test_a_failed_run_shows_its_error_and_can_be_resumed(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    run_id = failed_run(
        session_factory, steps=4, total_steps=10, error="RuntimeError: CUDA out of memory"
    )
    page = parse(client.get(f"/runs/{run_id}").text)
    box = page.by_id("run-error-box")
    assert "hidden" not in box.attrs and box.find("h2").text == "Why it stopped"
    assert page.by_id("run-error").text == "RuntimeError: CUDA out of memory"
    assert "hidden" not in page.by_id("resume-form").attrs
    assert page.by_id("run-live").text == "Failed at step 4 of 10"


def test_progress_has_queue_places_speed_and_eta(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    ids = [r["id"] for r in client.post("/api/runs", json={"preset": "lr_sweep"}).json()["runs"]]
    assert [client.get(f"/api/runs/{i}/progress").json()["queue_position"] for i in ids] == [
        1,
        2,
        3,
    ]
    listed = {r["id"]: r["queue_position"] for r in client.get("/api/runs").json()["runs"]}
    assert listed == dict(zip(ids, [1, 2, 3], strict=True))
    runs_page = parse(client.get("/").text)
    assert (
        runs_page.find("tr", data_run_id=str(ids[1])).find(cls="queue-note").text == "#2 in queue"
    )
    with session_scope(session_factory) as session:
        store.claim_run(session, run_id=ids[0], task_id="t")
        store.mark_running(session, run_id=ids[0], worker_host="h", device="cpu", control_tokens=[])
    for step in (1, 2, 3):
        time.sleep(0.02)
        record_step(session_factory, ids[0], step, rollouts=make_rollouts(random.Random(step)))
    live = client.get(f"/api/runs/{ids[0]}/progress").json()
    assert (
        live["status"] == "running" and live["current_step"] == 3 and live["queue_position"] is None
    )
    assert live["steps_per_second"] > 0
    assert live["eta_seconds"] == pytest.approx((150 - 3) / live["steps_per_second"])
    assert "steps/s · ETA" in live["summary"]
    assert client.get(f"/api/runs/{ids[1]}/progress").json()["queue_position"] == 1


def test_runs_page_links_to_the_form(client: TestClient) -> None:
    page = parse(client.get("/").text)
    assert any(a.attrs.get("href") == "/runs/new" for a in page.find_all("a", cls="btn"))


def test_the_app_marks_silent_runs_lost(
    session_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    run_id = make_run(session_factory, steps=2, status=RunStatus.running)
    fresh = make_run(session_factory, steps=2, seed=1, status=RunStatus.running)
    with session_scope(session_factory) as session:
        store.heartbeat(session, run_id=run_id, at=utcnow() - timedelta(seconds=30))
    url = session_factory.kw["bind"].url.render_as_string(hide_password=False)
    settings = Settings(database_url=url, data_dir=tmp_path, lost_after_seconds=10)
    app = create_app(settings, session_factory=session_factory, sweep_seconds=0.05)
    with TestClient(app):
        deadline = time.monotonic() + 10
        while get_run(session_factory, run_id).status != "lost" and time.monotonic() < deadline:
            time.sleep(0.05)
    lost = get_run(session_factory, run_id)
    assert lost.status == "lost" and "heartbeats" in (lost.error or "")
    assert get_run(session_factory, fresh).status == "running"
    with session_scope(session_factory) as session:  # its steps stay, for Resume to continue
        assert store.last_step(session, run_id=run_id) == 2


def test_openapi_documents_the_actions(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    paths = spec["paths"]
    assert "post" in paths["/api/runs"] and "get" in paths["/api/runs"]
    for path in ("/api/runs/{run_id}/cancel", "/api/runs/{run_id}/resume"):
        assert set(paths[path]) == {"post"}
    for path in ("/api/runs/{run_id}/progress", "/api/alerts", "/api/presets"):
        assert set(paths[path]) == {"get"}
    launch_op = paths["/api/runs"]["post"]
    assert {"201", "422", "503"} <= set(launch_op["responses"])
    assert not any(p.startswith("/runs") for p in paths)  # the HTML forms stay out


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--k", "65"], "k: Input should be less than or equal to 64"),
        (["--group-size", "1"], "group_size: Input should be greater than or equal to 2"),
        (["--lr", "-0.1"], "learning_rate: Input should be greater than 0"),
        (["--verifier", "lenient"], "unknown verifier 'lenient'"),
        (["--model", "/no/such/model"], "neither `tiny`, a hub id, nor an existing folder"),
    ],
)
def test_the_cli_validates_with_the_same_model(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    args: list[str],
    words: str,
) -> None:
    from rollout_lens.cli import main

    monkeypatch.setenv("ROLLOUT_LENS_DATA_DIR", str(tmp_path))
    assert main(["train", "--quiet", *args]) == 2
    assert words in capsys.readouterr().err
    assert not (tmp_path / "rollout-lens.db").exists()  # nothing created


def test_the_web_takes_a_model_folder_and_the_worker_fails_a_run_without_it(
    client: TestClient,
    session_factory: sessionmaker[Session],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rollout_lens.trainer.worker.tasks import train_run

    missing = str(tmp_path / "no-such-model")
    response = client.post("/api/runs", json={"model": missing, "steps": 3})
    assert response.status_code == 201  # the web host cannot know the worker's folders
    (run,) = response.json()["runs"]
    url = session_factory.kw["bind"].url.render_as_string(hide_password=False)
    monkeypatch.setenv("ROLLOUT_LENS_DATABASE_URL", url)
    monkeypatch.setenv("ROLLOUT_LENS_DATA_DIR", str(tmp_path))
    train_run.apply(args=[run["id"]])  # what the worker runs, here in the test's process
    failed = get_run(session_factory, run["id"])
    assert failed.status == RunStatus.failed
    assert failed.error == f"invalid run config: {unusable(missing)}"


def test_a_launched_model_folder_tells_readers_nothing_of_the_workers_disk(
    client: TestClient,
    session_factory: sessionmaker[Session],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A missing folder, a folder without config.json (`/etc`) and one whose config.json does not
    load all fail with one message; only the worker's log says which it was."""
    from rollout_lens.trainer.worker.tasks import train_run

    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("SECRET-LINE not json")
    url = session_factory.kw["bind"].url.render_as_string(hide_password=False)
    monkeypatch.setenv("ROLLOUT_LENS_DATABASE_URL", url)
    monkeypatch.setenv("ROLLOUT_LENS_DATA_DIR", str(tmp_path))
    for model in ("/etc", str(tmp_path / "no-such-folder"), "~root/.ssh", str(broken)):
        response = client.post("/api/runs", json={"model": model, "steps": 1})
        (run,) = response.json()["runs"]
        with caplog.at_level("WARNING"):
            train_run.apply(args=[run["id"]])
        failed = get_run(session_factory, run["id"])
        assert failed.status == RunStatus.failed
        first = (failed.error or "").splitlines()[0]
        # the config check (before training) or the loading (in it): the same words
        assert first.split(": ", 1)[1] == unusable(model), failed.error
        told = (failed.error or "").replace(model, "MODEL")  # the name was the reader's own
        for leak in ("config.json", "exist", "folder", "SECRET-LINE", "JSON"):
            assert leak not in told, (model, failed.error)
    logged = caplog.text
    assert "no config.json" in logged and "nor an existing folder" in logged
    assert "broken-model" in logged


def test_form_errors_speak_in_the_forms_labels(client: TestClient) -> None:
    response = client.post("/runs/new", data=form_data(group_size="1", steps="many"))
    assert response.status_code == 422
    banner = parse(response.text).by_id("form-errors").text
    assert "Group size G must be at least 2" in banner and "Steps must be a whole number" in banner
    assert "group_size" not in banner and "Input should be" not in banner


def test_the_form_shows_effective_defaults_and_warns_of_a_model_build(
    client: TestClient, session_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    from rollout_lens.trainer.builders import prebuilt

    page = parse(client.get("/runs/new").text)
    assert page.by_id("f-verifier").find("option", selected="").text == "judge"
    budget = page.by_id("help-max_completion_tokens").find(cls="field-default")
    assert budget.text == "default 8"
    assert json.loads(budget.attrs["data-by-recipe"]) == {
        "tiny/single": "8",
        "tiny/multi": "128",
        "pretrained/single": "32",
        "pretrained/multi": "256",
    }
    rate = page.by_id("help-learning_rate").find(cls="field-default")
    assert json.loads(rate.attrs["data-by-recipe"])["pretrained/single"] == "1e-05"
    # The packaged models serve this install: nothing to build, nothing to warn of.
    assert prebuilt.launch_notes(tmp_path / "models") == {}
    assert not page.find_all(cls="model-build")
    # Where a launch would build one (another torch: another recipe hash), the form says so.
    other = dataclasses.replace(prebuilt.MULTITURN, recipe_hash="000000000000")
    notes = prebuilt.launch_notes(tmp_path / "models", {"multi": other})
    assert "builds the multi-turn model before its first step (about 3 minutes" in notes["multi"]
    url = session_factory.kw["bind"].url.render_as_string(hide_password=False)
    settings = Settings(data_dir=tmp_path, database_url=url)
    app = create_app(settings, session_factory=session_factory, model_builds=lambda: notes)
    warned = TestClient(app, base_url="http://127.0.0.1")
    form = parse(warned.get("/runs/new").text)
    assert form.by_id("model-build-multi").text == notes["multi"]
