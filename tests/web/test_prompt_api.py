"""The prompt lens's JSON API against the brute-force oracle over the rollouts: the prompts list
walked by its cursor, a prompt's history with its completions, the heatmap, the compare, the
JSONL export a TRL script reads, the step viewer's group naming its prompt, and bad input."""

from __future__ import annotations

import json
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from tests.prompt_lens_support import FIGURES, SCHEDULES, looks, oracle, schedule_run


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and abs(a - b) < 1e-9
    return bool(a == b)


def _walk(client: TestClient, path: str, key: str, **params: Any) -> list[dict[str, Any]]:
    """Every row of a paged answer, passing `next` back as `after`."""
    rows: list[dict[str, Any]] = []
    after = None
    while True:
        answer = client.get(path, params=params | ({"after": after} if after else {}))
        assert answer.status_code == 200, answer.text
        page = answer.json()
        rows += page[key]
        after = page["next"]
        if after is None:
            return rows


def test_the_prompts_api_answers_the_oracles_figures(
    session_factory: sessionmaker[Session], client: TestClient
) -> None:
    run_id = schedule_run(session_factory, steps=8)
    want = oracle(session_factory, run_id)
    got = {
        p["prompt_id"]: p for p in _walk(client, f"/api/runs/{run_id}/prompts", "prompts", limit=3)
    }
    assert set(got) == set(want) and len(want) == len(SCHEDULES)
    for prompt_id, p in want.items():
        for name in FIGURES:
            assert _close(got[prompt_id][name], p[name]), (name, got[prompt_id], p)
        assert got[prompt_id]["text"] == p["text"]
    for look in ("never_solved", "flipping", "stuck", "forgotten"):
        chosen = _walk(client, f"/api/runs/{run_id}/prompts", "prompts", look=look, limit=2)
        assert {p["prompt_id"] for p in chosen} == {i for i, p in want.items() if look in looks(p)}
    ordered = _walk(client, f"/api/runs/{run_id}/prompts", "prompts", sort="flips", order="desc")
    assert [p["flips"] for p in ordered] == sorted(
        (p["flips"] for p in want.values()), reverse=True
    )
    found = _walk(client, f"/api/runs/{run_id}/prompts", "prompts", q="forgotten")
    assert [p["label"] for p in found] == ["what does forgotten need?"]


def test_a_prompts_history_with_its_completions(
    session_factory: sessionmaker[Session], client: TestClient
) -> None:
    run_id = schedule_run(session_factory, steps=5)
    want = oracle(session_factory, run_id)
    for prompt_id, p in want.items():
        path = f"/api/runs/{run_id}/prompts/{prompt_id}"
        plain = _walk(client, path, "steps", limit=2)
        full = _walk(client, path, "steps", limit=3, completions="true")
        assert [(g["step"], g["group"]) for g in plain] == [
            (g["step"], g["group"]) for g in p["history"]
        ]
        assert [g["rollout_ids"] for g in full] == [g["rollout_ids"] for g in p["history"]]
        assert "completions" not in plain[0]
        for g, w in zip(full, p["history"], strict=True):
            assert g["votes"] == w["votes"] and _close(g["agreement"], w["agreement"])
            assert g["solved"] is w["solved"] and g["zero_spread"] is w["zero_spread"]
            # the step viewer's group: the same completions, and it names this prompt (one
            # click back to this history)
            group = client.get(f"/api/runs/{run_id}/steps/{g['step']}/groups/{g['group']}").json()
            assert [r["index"] for r in group["rollouts"]] == g["indexes"]
            assert g["completions"] == [r["completion"] for r in group["rollouts"]]
            assert g["completions"] == [f"<tool>{v}</tool>" for v in g["rollout_votes"]]
            assert group["prompt_id"] == prompt_id


def test_heatmap_compare_and_export(
    session_factory: sessionmaker[Session], client: TestClient
) -> None:
    run_id = schedule_run(session_factory, steps=9)
    again = schedule_run(session_factory, steps=4, query_meta=False)
    want = oracle(session_factory, run_id)
    rows = _walk(client, f"/api/runs/{run_id}/prompts/heatmap", "rows", limit=3, width=4)
    listed = _walk(client, f"/api/runs/{run_id}/prompts", "prompts", limit=3)
    assert [r["prompt_id"] for r in rows] == [p["prompt_id"] for p in listed]  # the list's order
    heat = client.get(f"/api/runs/{run_id}/prompts/heatmap", params={"width": 4}).json()
    assert (heat["first_step"], heat["last_step"], heat["bucket"], heat["columns"]) == (1, 9, 3, 3)
    for row in rows:
        for cell in row["cells"]:
            groups = [
                g for g in want[row["prompt_id"]]["history"] if (g["step"] - 1) // 3 == cell["col"]
            ]
            trues = [t for g in groups for t in g["_trues"]]
            rewards = [r for g in groups for r in g["_rewards"]]
            assert _close(
                cell["value"], sum(trues) / len(trues) if trues else sum(rewards) / len(rewards)
            )
            assert (cell["step"], cell["group"]) == (groups[0]["step"], groups[0]["group"])

    # matched by query across two runs (the second names no query: its last user turn does)
    by_query = client.get("/api/compare/prompts", params={"runs": f"{run_id},{again}"}).json()
    assert by_query["total"] == 0  # a query is not a user turn
    by_turn = client.get(
        "/api/compare/prompts", params={"runs": f"{run_id},{again}", "match": "user"}
    ).json()
    assert by_turn["total"] == len(SCHEDULES)
    for match in by_turn["prompts"]:
        assert [len(side["prompts"]) for side in match["runs"]] == [1, 1]

    export = client.get(f"/api/runs/{run_id}/prompts/export.jsonl", params={"look": "never_solved"})
    assert export.status_code == 200
    assert export.headers["content-type"].startswith("application/x-ndjson")
    assert f"run-{run_id}-prompts-never_solved.jsonl" in export.headers["content-disposition"]
    lines = [json.loads(line) for line in export.text.splitlines()]
    assert {r["prompt_id"] for r in lines} == {
        i for i, p in want.items() if "never_solved" in looks(p)
    }
    for r in lines:
        assert [m["role"] for m in r["prompt"]] == ["system", "user"]
        assert want[r["prompt_id"]]["text"].count(r["prompt"][1]["content"]) == 1


def test_bad_input_is_refused_saying_why(
    session_factory: sessionmaker[Session], client: TestClient
) -> None:
    run_id = schedule_run(session_factory, steps=2)
    for path, params, status, words in (
        (f"/api/runs/{run_id}/prompts", {"look": "lost"}, 422, "look"),
        (f"/api/runs/{run_id}/prompts", {"sort": "nonsense"}, 422, "sort"),
        (f"/api/runs/{run_id}/prompts", {"after": "garbage"}, 400, "not a cursor"),
        (f"/api/runs/{run_id}/prompts", {"limit": 501}, 422, "limit"),
        ("/api/runs/999/prompts", {}, 404, "run 999"),
        (f"/api/runs/{run_id}/prompts/999999", {}, 404, "has no prompt"),
        (f"/api/runs/{run_id}/prompts/heatmap", {"width": 0}, 422, "width"),
        ("/api/compare/prompts", {"runs": str(run_id)}, 400, "runs"),
        ("/api/compare/prompts", {"runs": f"{run_id},{run_id}"}, 400, "runs"),
        ("/api/runs/999/prompts/export.jsonl", {}, 404, "run 999"),
    ):
        answer = client.get(path, params=params)
        assert answer.status_code == status, (path, params, answer.text)
        assert words in answer.text, (path, answer.text)
