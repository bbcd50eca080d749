"""The step pages byte for byte against bodies captured before the write path's rewrite (issue
27): a recorded fixture set (ragged rollouts, NaN and −inf logprobs, empty and one-token
completions, tool-calling turns, a multi-turn group, alerts) rendered by the step viewer, the
group page, their JSON, the export, and compare's side-by-side step against a second run (its
page, its JSON, the step card); every body must equal its file under
tests/fixtures/pages/. A change that means to alter a page regenerates them with
`ROLLOUT_LENS_WRITE_ORACLE=1 pytest tests/store/test_page_oracle.py` and shows the diff for review;
after a merge whose pages changed, regenerate them from the merged-in branch's own code (not
the branch being checked), then check the merge against them.

Only what is not the pages' own varies between renders is masked: times (run created/started,
recorded_at, server timing) and the per-request CSP nonce and CSRF token."""

from __future__ import annotations

import math
import os
import random
import re
from pathlib import Path

import pytest
from rollout_lens.server import store
from rollout_lens.server.core.records import RolloutRecord
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.store.models import RunStatus

from tests.factories import (
    CONTROL_TOKENS,
    make_groups,
    make_multiturn_group,
    make_rollouts,
    make_tool_rollouts,
    record_step,
)

ORACLE = Path(__file__).parents[1] / "fixtures" / "pages"
WRITE = os.environ.get("ROLLOUT_LENS_WRITE_ORACLE") == "1"
_MASKS = (
    (re.compile(r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(\.\d+)?(\+00:00|Z)?"), "TIME"),
    (re.compile(r'nonce="[^"]*"'), 'nonce="NONCE"'),
    (re.compile(r'(name="csrf_token" value=")[^"]*"'), r'\1CSRF"'),
    (re.compile(r'(<meta name="csrf-token" content=")[^"]*"'), r'\1CSRF"'),
    (re.compile(r"\b\d+ (seconds?|minutes?|hours?|days?) ago\b"), "AGO"),
)


def _ragged(rng: random.Random) -> list[RolloutRecord]:
    """One group of 6: lengths 0, 1, 3, 7, 40 and 130 tokens; NaN and −inf logprobs, NaN
    control-token probabilities, probabilities at the storage floor and exactly 1."""
    out = []
    for index, n in enumerate((0, 1, 3, 7, 40, 130)):
        ids = [rng.randrange(2000) for _ in range(n)]
        lps = [-rng.random() * 3 for _ in range(n)]
        ctrl = {t: [rng.random() ** 4 for _ in range(n)] for t in CONTROL_TOKENS}
        if n >= 3:
            lps[1], lps[2] = -math.inf, math.nan
            ctrl[CONTROL_TOKENS[0]][0] = math.nan
            ctrl[CONTROL_TOKENS[1]][1] = 1.0
            ctrl[CONTROL_TOKENS[2]][2] = 1e-3
        out.append(
            RolloutRecord(
                group=0,
                index=index,
                prompt="<user>ragged prompt</user><assistant>",
                completion=" ".join(f"w{i}" for i in ids),
                completion_ids=ids,
                token_logprobs=lps,
                control_probs=ctrl,
                vote=None if n < 3 else "tool_01",
                target="tool_01",
                verifier_reward=float(index % 2),
                true_score=float(index % 3 == 0),
                advantage=(index - 2.5) / 2,
                format_valid=n >= 3,
                format_state="healthy_call" if n >= 3 else "no_call",
                meta={"query": f"ragged {index}", "probes": {"x": 0.25 * index}},
                tokens=[f"w{i}" for i in ids] if index != 4 else None,
            )
        )
    return out


def _fixture_runs(factory) -> dict[str, int]:  # type: ignore[no-untyped-def]
    rng = random.Random(27)
    with session_scope(factory) as session:
        run_id = store.create_run(
            session,
            name="oracle <b>run</b>",
            model="tiny",
            total_steps=6,
            group_size=8,
            seed=27,
            config={"learning_rate": 3e-4},
            control_tokens=CONTROL_TOKENS,
            status=RunStatus.completed,
            prompts_per_step=6,
        ).id
    record_step(factory, run_id, 1, rollouts=make_rollouts(rng), values={"reward_mean": 0.5})
    record_step(factory, run_id, 2, rollouts=make_groups(rng, groups=5, tokens=9))
    record_step(factory, run_id, 3, rollouts=_ragged(rng), metrics={"ctrl/x/max": math.nan})
    tools = make_tool_rollouts(3)
    multi = make_multiturn_group(group=1)
    record_step(factory, run_id, 4, rollouts=tools + multi)
    record_step(factory, run_id, 5, rollout_step=4, values={"loss": 0.1})  # a reused generation
    # a second run to compare with: the same steps' shapes, other draws
    with session_scope(factory) as session:
        other = store.create_run(
            session,
            name="oracle other",
            model="tiny",
            total_steps=6,
            group_size=8,
            seed=28,
            config={"learning_rate": 1e-4},
            control_tokens=CONTROL_TOKENS,
            status=RunStatus.completed,
            prompts_per_step=6,
        ).id
    record_step(factory, other, 1, rollouts=make_rollouts(rng), values={"reward_mean": 0.25})
    record_step(factory, other, 2, rollouts=make_groups(rng, groups=5, tokens=9))
    record_step(factory, other, 4, rollouts=make_tool_rollouts(3) + make_multiturn_group(group=1))
    return {"run": run_id, "other": other}


def _pages(run_id: int, other: int) -> dict[str, str]:
    pages = {}
    for step, groups in ((1, (0,)), (2, (0, 3)), (3, (0,)), (4, (0, 1)), (5, (0,))):
        pages[f"step{step}.html"] = f"/runs/{run_id}/steps/{step}"
        pages[f"step{step}.json"] = f"/api/runs/{run_id}/steps/{step}"
        for g in groups:
            pages[f"step{step}-group{g}.html"] = f"/runs/{run_id}/steps/{step}/groups/{g}"
            pages[f"step{step}-group{g}.json"] = f"/api/runs/{run_id}/steps/{step}/groups/{g}"
    pages["step2-sorted.html"] = f"/runs/{run_id}/steps/2?sort=max_abs_advantage&order=desc"
    pages["export.jsonl"] = f"/api/runs/{run_id}/export"
    pages["explorer.json"] = f"/api/runs/{run_id}/rollouts?sort=advantage&order=desc"
    # compare's side-by-side step (typed views in its cards, their JSON in its answer)
    for step, group in ((2, 3), (4, 1)):
        query = f"runs={run_id},{other}&step={step}&group={group}"
        pages[f"compare-step{step}.html"] = f"/compare?{query}"
        pages[f"compare-step{step}.json"] = f"/api/compare?{query}"
        pages[f"card-step{step}.html"] = f"/runs/{run_id}/steps/{step}/card?group={group}"
    return pages


def _masked(body: str) -> str:
    for pattern, replacement in _MASKS:
        body = pattern.sub(replacement, body)
    return body


@pytest.mark.parametrize("engine", ["sqlite"], indirect=True)
def test_step_pages_match_the_recorded_oracle(session_factory, client) -> None:
    ids = _fixture_runs(session_factory)
    pages = _pages(ids["run"], ids["other"])
    if WRITE:
        ORACLE.mkdir(parents=True, exist_ok=True)
    mismatched = []
    for name, url in pages.items():
        answer = client.get(url)
        assert answer.status_code == 200, (url, answer.text[:300])
        body = _masked(answer.text.replace(f"/runs/{ids['run']}/", "/runs/RUN/"))
        path = ORACLE / name
        if WRITE:
            path.write_text(body, encoding="utf-8")
            continue
        if path.read_text(encoding="utf-8") != body:
            mismatched.append(name)
    assert not mismatched, f"pages differ from tests/fixtures/pages/: {mismatched}"
