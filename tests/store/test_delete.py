"""Deleting a run: its rows, the prompts only it used, its files and its queued message; never
anything of another run; a running run is refused (cancel it first)."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient
from rollout_lens.server.store.models import (
    AlertRow,
    PromptRow,
    RolloutRow,
    RollupRow,
    RunRow,
    RunStatus,
    RunTokenRow,
    StepRow,
)
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from tests.factories import make_run
from tests.web_support import parse

TABLES = (RunRow, StepRow, RolloutRow, RollupRow, RunTokenRow, AlertRow)


def _counts(factory: sessionmaker[Session], run_id: int) -> dict[str, int]:
    with factory() as session:
        counts = {
            t.__tablename__: int(
                session.scalar(
                    select(func.count())
                    .select_from(t)
                    .where((t.id if t is RunRow else t.run_id) == run_id)  # type: ignore[attr-defined]
                )
                or 0
            )
            for t in TABLES
        }
        prompts = select(RolloutRow.prompt_id).where(RolloutRow.run_id == run_id)
        counts["prompts"] = int(
            session.scalar(
                select(func.count()).select_from(PromptRow).where(PromptRow.id.in_(prompts))
            )
            or 0
        )
        return counts


def _all_prompts(factory: sessionmaker[Session]) -> int:
    with factory() as session:
        return int(session.scalar(select(func.count()).select_from(PromptRow)) or 0)


def test_deleting_a_run_keeps_every_other_run_and_the_prompts_they_share(
    client: TestClient, session_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    # the same seed: the same prompts for the first 3 steps; the doomed run's last 2 are its own
    doomed = make_run(session_factory, steps=5, seed=0, status=RunStatus.completed)
    kept = make_run(session_factory, steps=3, seed=0, status=RunStatus.completed)
    kept_before = _counts(session_factory, kept)
    assert _counts(session_factory, doomed)["prompts"] > kept_before["prompts"] > 0
    assert kept_before["steps"] == 3 and kept_before["rollouts"] > 0
    for run_id in (doomed, kept):
        (tmp_path / "runs" / str(run_id) / "checkpoint-2").mkdir(parents=True)
        (tmp_path / "runs" / str(run_id) / "checkpoint-2" / "model.bin").write_bytes(b"x")

    response = client.delete(f"/api/runs/{doomed}")
    assert response.status_code == 200
    assert response.json() == {"deleted": doomed}
    after = _counts(session_factory, doomed)
    assert all(n == 0 for n in after.values()), after
    assert _counts(session_factory, kept) == kept_before
    assert _all_prompts(session_factory) == kept_before["prompts"]  # only the doomed run's went
    assert not (tmp_path / "runs" / str(doomed)).exists()
    assert (tmp_path / "runs" / str(kept) / "checkpoint-2" / "model.bin").exists()
    assert client.get(f"/api/runs/{doomed}").status_code == 404
    assert client.get(f"/api/runs/{kept}/steps/3").status_code == 200
    assert client.delete(f"/api/runs/{doomed}").status_code == 404


def test_a_running_run_must_be_cancelled_first(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    run_id = make_run(session_factory, steps=2, status=RunStatus.running)
    before = _counts(session_factory, run_id)
    response = client.delete(f"/api/runs/{run_id}")
    assert response.status_code == 409
    assert "cancel it first" in response.json()["detail"]
    form = client.post(f"/runs/{run_id}/delete", follow_redirects=False)
    assert form.status_code == 303
    page = parse(client.get(form.headers["location"]).text)
    assert "cancel it first" in page.by_id("notice").text
    assert page.by_id("delete-form").attrs.get("hidden") is not None
    assert _counts(session_factory, run_id) == before


def test_a_queued_run_is_deleted_with_its_message(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    (run,) = client.post("/api/runs", json={"steps": 5}).json()["runs"]
    with session_factory() as session:
        assert session.get(RunRow, run["id"]).task_id  # type: ignore[union-attr]
    assert client.delete(f"/api/runs/{run['id']}").status_code == 200
    assert _counts(session_factory, run["id"])["runs"] == 0


def test_the_run_page_deletes_with_a_confirmed_form(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    run_id = make_run(session_factory, steps=2, status=RunStatus.failed, name="<b>bold</b>")
    page = parse(client.get(f"/runs/{run_id}").text)
    form = page.by_id("delete-form")
    assert form.attrs["method"] == "post" and form.attrs["action"] == f"/runs/{run_id}/delete"
    assert "hidden" not in form.attrs
    assert "<b>bold</b>" in form.attrs["data-confirm"]  # an attribute: escaped, shown as text
    assert form.find("input", name="csrf_token").attrs["value"]
    response = client.post(f"/runs/{run_id}/delete", follow_redirects=False)
    assert response.status_code == 303 and response.headers["location"] == "/"
    assert _counts(session_factory, run_id)["runs"] == 0
