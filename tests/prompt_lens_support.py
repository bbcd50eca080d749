"""A run whose prompts follow known schedules (learned midway, alternating, never solved, stuck
without spread, always solved with zero spread, forgotten, a tie, no true score, twice in a step), and the prompt
lens's figures computed by brute force from its rollouts as the database holds them."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable
from typing import Any

from rollout_lens.server import store
from rollout_lens.server.core.records import RolloutRecord, StepRecord
from rollout_lens.server.store import prompt_texts
from rollout_lens.server.store.db import make_engine, make_session_factory, session_scope
from rollout_lens.server.store.models import RolloutRow
from rollout_lens.server.webapp import queries
from rollout_lens.server.webapp.queries import prompts as lens
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from tests.factories import CONTROL_TOKENS

SIZE = 4
STEPS = 12
SYSTEM = "You pick tools. " * 20  # a head every prompt shares


def chatml(user: str) -> str:
    return (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


# schedule name → step → (truly correct of SIZE, or None for no true score)
SCHEDULES: dict[str, Any] = {
    "learned": lambda s: 1 if s < 6 else 4,
    "alternating": lambda s: 3 if s % 2 else 1,
    "never": lambda s: 0,
    "stuck": lambda s: 0,  # every reward 0: no spread, no gradient
    "always": lambda s: SIZE,
    "forgotten": lambda s: 3 if s < 5 else 0,
    "tie": lambda s: SIZE // 2,
    "unknown": lambda s: None,
}


def schedule_rollouts(
    step: int,
    rng: random.Random,
    *,
    query_meta: bool = True,
    render: Callable[[str], str] = chatml,
) -> list[RolloutRecord]:
    """One step's groups: each schedule's prompt (one absent on steps divisible by 4, as an
    epoch that skips it; `alternating` twice at step 3), in a shuffled group order."""
    names = [n for n in SCHEDULES if not (n == "tie" and step % 4 == 0)]
    if step == 3:
        names.append("alternating")
    rng.shuffle(names)
    out = []
    for group, name in enumerate(names):
        correct = SCHEDULES[name](step)
        user = f"Query: what does {name} need?\nReply with <tool>ID</tool>."
        for index in range(SIZE):
            right = correct is not None and index < correct
            vote = "tool_01" if right else ("tool_02" if index % 2 else None)
            # `never` has reward spread (a partial reward) where the others match the truth
            reward = (0.5 if index == 0 else 0.0) if name == "never" else float(right)
            if correct is None:
                reward = float(index % 2)
            out.append(
                RolloutRecord(
                    group=group,
                    index=index,
                    prompt=render(user),
                    completion=f"<tool>{vote}</tool>",
                    completion_ids=[5, 6],
                    token_logprobs=[-0.1, -0.2],
                    control_probs={t: [0.1, 0.2] for t in CONTROL_TOKENS},
                    vote=vote,
                    target="tool_01",
                    verifier_reward=reward,
                    true_score=None if correct is None else float(right),
                    advantage=reward - 0.5,
                    format_valid=vote is not None,
                    format_state="healthy_call" if vote else "no_call",
                    meta={"query": f"what does {name} need?"} if query_meta else {},
                )
            )
    return out


def schedule_run(
    factory: sessionmaker[Session],
    *,
    steps: int = STEPS,
    query_meta: bool = True,
    render: Callable[[str], str] = chatml,
    after_step: Callable[[int, int], None] | None = None,
) -> int:
    """A run of SCHEDULES' prompts (as schedule_rollouts writes them, each prompt `render`ed
    from its user turn), recorded a step at a time; `after_step(run_id, step)` after each."""
    rng = random.Random(7)
    with session_scope(factory) as session:
        run_id = store.create_run(
            session,
            name="schedules",
            model="tiny",
            total_steps=steps,
            group_size=SIZE,
            prompts_per_step=len(SCHEDULES),
            control_tokens=CONTROL_TOKENS,
        ).id
    for step in range(1, steps + 1):
        record = StepRecord(
            step=step,
            rollout_step=step,
            values={"reward_mean": 0.5},
            rollouts=schedule_rollouts(step, rng, query_meta=query_meta, render=render),
            metrics={},
        )
        with session_scope(factory) as session:
            store.record_step(session, run_id=run_id, record=record, control_tokens=CONTROL_TOKENS)
        if after_step is not None:
            after_step(run_id, step)
    return run_id


# --- the oracle ----------------------------------------------------------------------------


def _finite(values: list[Any]) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v)]


def oracle(factory: sessionmaker[Session], run_id: int) -> dict[int, dict[str, Any]]:
    """prompt id → its figures and its groups, from every rollout of the run, by brute force."""
    with session_scope(factory) as session:
        rows = session.execute(
            select(
                RolloutRow.id,
                RolloutRow.step,
                RolloutRow.group,
                RolloutRow.index,
                RolloutRow.prompt_id,
                RolloutRow.verifier_reward,
                RolloutRow.true_score,
                RolloutRow.vote,
                RolloutRow.advantage,
            ).where(RolloutRow.run_id == run_id)
        ).all()
        used = session.scalars(
            select(RolloutRow.prompt_id).where(RolloutRow.run_id == run_id).distinct()
        )
        texts = prompt_texts.texts(session, used)
    groups: dict[tuple[int, int], list[Any]] = {}
    for r in rows:
        groups.setdefault((r.step, r.group), []).append(r)
    prompts: dict[int, dict[str, Any]] = {}
    for (step, group), members in sorted(groups.items()):
        members.sort(key=lambda r: r.index)
        rewards = _finite([r.verifier_reward for r in members])
        trues = _finite([r.true_score for r in members])
        correct = len([t for t in trues if t >= 1])
        solved = None if not trues else correct > len(trues) / 2
        votes = Counter(r.vote for r in members)
        agree = max((c for v, c in votes.items() if v is not None), default=0)
        g = {
            "step": step,
            "group": group,
            "size": len(members),
            "reward_mean": sum(rewards) / len(rewards) if rewards else None,
            "true_mean": sum(trues) / len(trues) if trues else None,
            "solved": solved,
            "zero_spread": max(rewards) - min(rewards) < 1e-9 if rewards else True,
            "agreement": agree / len(members),
            "votes": {("None" if v is None else v): c for v, c in votes.items()},
            "rollout_ids": [r.id for r in members],
            "rewards": [r.verifier_reward for r in members],
            "true_scores": [r.true_score for r in members],
            "advantages": [r.advantage for r in members],
            "_trues": trues,
            "_rewards": rewards,
        }
        prompt_id = members[0].prompt_id
        prompts.setdefault(prompt_id, {"history": [], "text": texts[prompt_id]})
        prompts[prompt_id]["history"].append(g)
    for p in prompts.values():
        h = p["history"]
        states = [g["solved"] for g in h if g["solved"] is not None]
        solved_steps = [g["step"] for g in h if g["solved"] is True]
        failed_steps = [g["step"] for g in h if g["solved"] is False]
        all_rewards = [x for g in h for x in g["_rewards"]]
        all_trues = [x for g in h for x in g["_trues"]]
        votes: Counter[str] = Counter()
        for g in h:
            votes.update(g["votes"])
        p.update(
            groups=len(h),
            first_step=h[0]["step"],
            last_step=h[-1]["step"],
            reward_mean=sum(all_rewards) / len(all_rewards) if all_rewards else None,
            true_mean=sum(all_trues) / len(all_trues) if all_trues else None,
            solved_at=min(solved_steps, default=None),
            last_failed=max(failed_steps, default=None),
            flips=sum(1 for a, b in zip(states, states[1:], strict=False) if a != b),
            zero_spread_share=sum(g["zero_spread"] for g in h) / len(h),
            votes=dict(votes),
        )
        p["forgotten"] = (
            p["solved_at"] is not None
            and p["last_failed"] is not None
            and p["last_failed"] > p["solved_at"]
        )
    return prompts


def looks(p: dict[str, Any]) -> set[str]:
    """The looks (filters) a prompt's oracle figures put it under."""
    out = set()
    if p["solved_at"] is None and p["last_failed"] is not None:
        out.add("never_solved")
    if p["solved_at"] is not None:
        out.add("solved")
    if p["flips"] >= 2:
        out.add("flipping")
    if p["solved_at"] is None and p["zero_spread_share"] >= 0.5:
        out.add("stuck")
    if p["forgotten"]:
        out.add("forgotten")
    return out


# --- the prompt lens against the oracle ---------------------------------------------------

FIGURES = (
    "groups",
    "first_step",
    "last_step",
    "reward_mean",
    "true_mean",
    "solved_at",
    "last_failed",
    "flips",
    "zero_spread_share",
    "forgotten",
)
GROUP_FIGURES = (
    "step",
    "group",
    "size",
    "reward_mean",
    "true_mean",
    "solved",
    "zero_spread",
    "agreement",
    "votes",
    "rollout_ids",
    "rewards",
    "true_scores",
    "advantages",
)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and math.isclose(a, b, abs_tol=1e-12)
    return bool(a == b)


def all_pages(factory: sessionmaker[Session], run_id: int, **query: Any) -> list[dict[str, Any]]:
    """Every row of the prompts list, walking its cursor (pages of 2)."""
    out: list[dict[str, Any]] = []
    totals: set[int] = set()
    after = None
    with session_scope(factory) as session:
        while True:
            page = lens.prompts_page(
                session, run_id=run_id, query=lens.PromptQuery(limit=2, after=after, **query)
            )
            out += page["prompts"]
            totals.add(page["total"])
            after = page["next"]
            if after is None:
                assert totals == {len(out)}  # every page counts them all
                return out


def assert_matches_oracle(factory: sessionmaker[Session], run_id: int) -> dict[int, Any]:
    """Every figure of the list, every prompt's history and the heatmap equal the oracle's."""
    want = oracle(factory, run_id)
    got = {p["prompt_id"]: p for p in all_pages(factory, run_id)}
    assert set(got) == set(want)
    for prompt_id, p in want.items():
        for name in FIGURES:
            assert _same(got[prompt_id][name], p[name]), (prompt_id, name, got[prompt_id], p)
        assert got[prompt_id]["text"] == p["text"]
        assert got[prompt_id]["rollouts"] == sum(g["size"] for g in p["history"])
        top = sorted(p["votes"].items(), key=lambda kv: (kv[0] == "None", -kv[1], kv[0]))
        assert got[prompt_id]["votes"] == dict(top[: lens.TOP_VOTES])
    with session_scope(factory) as session:
        for prompt_id, p in want.items():
            history = queries.prompt_history(session, run_id=run_id, prompt_id=prompt_id, limit=5)
            steps = history["steps"]
            while history["next"]:
                history = queries.prompt_history(
                    session, run_id=run_id, prompt_id=prompt_id, limit=5, after=history["next"]
                )
                steps += history["steps"]
            assert len(steps) == len(p["history"])
            for g, w in zip(steps, p["history"], strict=True):
                for name in GROUP_FIGURES:
                    assert _same(g[name], w[name]) or g[name] == w[name], (name, g, w)
            assert history["prompt"]["votes"] == dict(
                sorted(p["votes"].items(), key=lambda kv: (kv[0] == "None", -kv[1], kv[0]))
            )
        for width in (3, 1000):
            _check_heatmap(session, run_id, want, width)
    return want


def _check_heatmap(session: Session, run_id: int, want: dict[int, Any], width: int) -> None:
    heat = queries.heatmap(session, run_id=run_id, query=lens.PromptQuery(limit=500), width=width)
    steps = [g["step"] for p in want.values() for g in p["history"]]
    lo, hi = min(steps), max(steps)
    bucket = max(1, math.ceil((hi - lo + 1) / width))
    assert (heat["first_step"], heat["last_step"], heat["bucket"]) == (lo, hi, bucket)
    assert heat["columns"] <= width
    for row in heat["rows"]:
        cells: dict[int, list[dict[str, Any]]] = {}
        for g in want[row["prompt_id"]]["history"]:
            cells.setdefault((g["step"] - lo) // bucket, []).append(g)
        assert [c["col"] for c in row["cells"]] == sorted(cells)
        for cell in row["cells"]:
            groups = cells[cell["col"]]
            trues = [t for g in groups for t in g["_trues"]]
            rewards = [r for g in groups for r in g["_rewards"]]
            value = sum(trues) / len(trues) if trues else sum(rewards) / len(rewards)
            assert _same(cell["value"], value)
            assert cell["score"] == ("true" if trues else "reward")
            assert (cell["step"], cell["group"]) == (groups[0]["step"], groups[0]["group"])
            assert cell["groups"] == len(groups)
            assert cell["solved"] == sum(g["solved"] is True for g in groups)
            assert cell["failed"] == sum(g["solved"] is False for g in groups)


def assert_lens_matches(database_url: str, run_id: int) -> dict[int, Any]:
    """assert_matches_oracle on the database at `database_url` (a trainer's, a script's)."""
    engine = make_engine(database_url)
    try:
        return assert_matches_oracle(make_session_factory(engine), run_id)
    finally:
        engine.dispose()
