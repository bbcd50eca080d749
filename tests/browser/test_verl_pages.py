"""An imported verl run on the dashboard: run page, step viewer and groups, compare with a run
launched here, export → import round trip, the Python client, and Chromium's view of it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from rollout_lens.server.core.config import Settings
from rollout_lens.server.exchange import export
from rollout_lens.server.exchange.dump_import import import_dumps
from rollout_lens.server.exchange.importer import import_export
from rollout_lens.server.exchange.verl_import import VerlDump
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.store.models import RunStatus
from rollout_lens.server.webapp.app import create_app
from sqlalchemy.orm import Session, sessionmaker

from rollout_lens import Client
from tests import web_support
from tests.factories import make_run
from tests.store.test_verl_import import ANSWERS, PROMPTS, STEPS, Dumps, dumps  # noqa: F401 - fixture
from tests.web_support import client_for, serve_app

ARTIFACTS = Path(
    os.environ.get("ROLLOUT_LENS_TEST_ARTIFACTS")
    or Path(__file__).resolve().parents[2] / "test-artifacts"
)

# verl's own dump code (tests/verl_dump.py, with torch) writes these tests' input.


def imported(factory: sessionmaker[Session], dumps: Dumps) -> int:  # noqa: F811
    return import_dumps(
        factory,
        VerlDump(dumps.rollout, validation=dumps.validation, name="gsm8k on verl"),
        settle=0,
    ).run_id


def _records(factory: sessionmaker[Session], run_id: int, fmt: str = "jsonl") -> bytes:
    with session_scope(factory) as session:
        return b"".join(export.export_chunks(session, run_id=run_id, fmt=fmt))


def _comparable(data: bytes) -> list[str]:
    """Export records without what an import changes (ids, source, the note it adds)."""
    out = []
    for line in data.decode().splitlines():
        record = json.loads(line)
        record.pop("id" if record["kind"] == "run" else "run_id", None)
        if record["kind"] == "run":
            record["source"] = None
            record["notes"] = [n for n in record["notes"] if "rollout-lens export" not in n]
        out.append(json.dumps(record))
    return out


def test_a_verl_run_works_like_any_other(
    session_factory: sessionmaker[Session],
    dumps: Dumps,  # noqa: F811
    tmp_path: Path,
) -> None:
    run_id = imported(session_factory, dumps)
    launched = make_run(session_factory, steps=STEPS, name="launched here")
    with client_for(session_factory) as client:
        page = client.get(f"/runs/{run_id}")
        assert page.status_code == 200
        for text in (
            "gsm8k on verl",
            "imported from verl&#39;s rollout dumps",
            "advantages computed from scores as GRPO&#39;s group-normalised score",
            "verl&#39;s dump has no token ids, logprobs or control-token probabilities",
        ):
            assert text in page.text, text
        series = client.get(f"/api/runs/{run_id}/series", params={"full": 1}).json()["series"]
        assert series["reward_mean"]["x"] == list(range(1, STEPS + 1))
        assert series["true_accuracy"]["x"] == list(range(1, STEPS + 1))
        assert series["eval/validation"]["x"] == [2, 4, 5]
        assert "verl/acc" in series and not any(n.startswith("ctrl/") for n in series)

        viewer = client.get(f"/runs/{run_id}/steps/2/groups/1")
        assert viewer.status_code == 200
        assert "Weng earns $12 an hour" in viewer.text and ANSWERS[1] in viewer.text
        parsed = web_support.parse(viewer.text)
        assert len(parsed.by_id("rollout-tabs").find_all("button")) == 4
        detail = client.get(f"/api/runs/{run_id}/steps/2").json()
        assert [g["size"] for g in detail["groups"]] == [4, 4, 4]
        first = client.get(f"/api/runs/{run_id}/steps/2/groups/0").json()
        assert first["rollouts"][0]["prompt"] == PROMPTS[0]
        found = client.get(f"/api/runs/{run_id}/rollouts", params={"q": "Weng"}).json()
        assert {r["group"] for r in found["rollouts"]} == {1} and found["total"] == 4 * STEPS

        both = f"{run_id},{launched}"
        assert client.get("/compare", params={"runs": both}).status_code == 200
        compared = client.get("/api/compare", params={"runs": both}).json()
        assert {r["id"] for r in compared["runs"]} == {run_id, launched}

    for fmt in ("jsonl", "parquet"):
        path = tmp_path / f"verl.{fmt}"
        path.write_bytes(_records(session_factory, run_id, fmt))
        copy = import_export(session_factory, path).run_id
        assert _comparable(_records(session_factory, copy)) == _comparable(
            _records(session_factory, run_id)
        )


def test_the_client_reads_a_verl_run(
    session_factory: sessionmaker[Session],
    dumps: Dumps,  # noqa: F811
    tmp_path: Path,
) -> None:
    run_id = imported(session_factory, dumps)
    url = session_factory.kw["bind"].url.render_as_string(hide_password=False)
    app = create_app(Settings(database_url=url, data_dir=tmp_path), session_factory=session_factory)
    with serve_app(app) as base, Client(base) as lens:
        run = lens.run(run_id)
        assert (run["source"], run["status"]) == ("verl-import", RunStatus.completed)
        rows = lens.series(run_id, ["reward_mean", "eval/validation"])
        rollouts = lens.step_rollouts(run_id, 3)
    steps = list(rows.index) if hasattr(rows, "index") else [r["step"] for r in rows]
    assert steps == list(range(1, STEPS + 1))
    assert len(rollouts) == 12 and rollouts[0]["completion_ids"] == []


@pytest.mark.browser
def test_chromium_shows_a_verl_run(browser: Any, dumps: Dumps, tmp_path: Path) -> None:  # noqa: F811
    """The run page (notes, charts, evaluation) and the step viewer of an imported verl run, in
    Chromium; screenshots verl-run.png and verl-step.png."""
    from rollout_lens.server.store.db import make_engine, make_session_factory
    from rollout_lens.server.store.migrate import upgrade

    url = f"sqlite:///{tmp_path / 'rollout-lens.db'}"
    engine = make_engine(url)
    upgrade(engine)
    factory = make_session_factory(engine)
    run_id = imported(factory, dumps)
    errors: list[str] = []
    app = create_app(Settings(database_url=url, data_dir=tmp_path))
    try:
        with serve_app(app) as base:
            context = browser.new_context(viewport={"width": 1440, "height": 900}, base_url=base)
            context.set_default_timeout(10_000)
            page = context.new_page()
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.goto(f"/runs/{run_id}")
            page.wait_for_selector("body[data-charts-ready]")
            notes = page.locator(".recording-notes").inner_text()
            assert "verl's own advantages are not in its dump" in notes
            assert "no token ids, logprobs or control-token probabilities" in notes
            for figure in ("reward", "eval"):
                assert page.locator(f"#fig-{figure} svg.main-svg").count() >= 1, figure
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "verl-run.png"), full_page=True)
            page.goto(f"/runs/{run_id}/steps/{STEPS}/groups/0")
            page.keyboard.press("2")
            assert page.locator("#tab-2").get_attribute("aria-selected") == "true"
            assert page.locator("#rollout-2 .completion").inner_text().startswith("She sold")
            page.screenshot(path=str(ARTIFACTS / "verl-step.png"), full_page=True)
            context.close()
    finally:
        engine.dispose()
    assert errors == []
