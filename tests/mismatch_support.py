"""A run whose rollouts carry both sides' logprobs (issue 47), recorded through the store: the
generator's drift from the trainer's grows with the step, some of its positions are NaN (a
tool result, or a token the engine gave no logprob for), some rollouts have no generator side
at all; and the brute-force figures of each stored rollout, read back from its arrays."""

from __future__ import annotations

import math
import random
from typing import Any

from rollout_lens.server import store
from rollout_lens.server.core import mismatch
from rollout_lens.server.core.records import RolloutRecord, StepRecord
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.store.serialize import per_token
from sqlalchemy.orm import Session, sessionmaker

from tests.factories import CONTROL_TOKENS, record_steps

WORDS = ["<tool>", "tool_01", "</tool>", " the", " cat", " sat", " on", " mat", "\n", " é"]
HOSTILE = '<script>alert("worst")</script>'
TEXTS = {i: w for i, w in enumerate(WORDS)} | {len(WORDS): HOSTILE}


def _rollout(
    rng: random.Random, step: int, group: int, index: int, *, generator: bool, hostile: bool
) -> RolloutRecord:
    n = rng.randrange(0, 14)
    ids = [rng.randrange(len(WORDS)) for _ in range(n)]
    if hostile and n:
        ids[rng.randrange(n)] = len(WORDS)
    trainer = [-rng.expovariate(1.5) for _ in ids]
    gen: list[float] | None = None
    if generator:
        drift = 0.05 * step
        gen = [
            math.nan if rng.random() < 0.15 else min(0.0, t + rng.gauss(0.0, drift))
            for t in trainer
        ]
        for at, token in enumerate(ids):  # the hostile token far off: among the worst
            if token == len(WORDS):
                gen[at] = trainer[at] - 2.5
    return RolloutRecord(
        group=group,
        index=index,
        prompt=f"<user>Query {group}</user><assistant>",
        completion="".join(WORDS[i] if i < len(WORDS) else HOSTILE for i in ids),
        completion_ids=ids,
        token_logprobs=trainer,
        generator_logprobs=gen,
        control_probs={t: [rng.random() for _ in ids] for t in CONTROL_TOKENS},
        vote="tool_01",
        target="tool_01",
        verifier_reward=rng.choice([0.0, 1.0]),
        true_score=rng.choice([0.0, 1.0]),
        advantage=round(rng.uniform(-1, 1), 3),
        format_valid=True,
        format_state="healthy_call",
        tokens=[TEXTS[i] for i in ids],
    )


def mismatch_steps(
    *,
    steps: int = 4,
    groups: int = 3,
    group_size: int = 4,
    seed: int = 0,
    generator: str = "most",
    hostile: bool = False,
) -> list[StepRecord]:
    """`steps` steps × `groups` × `group_size`, each with its mismatch/* series as the recorder
    computes them; `generator`: "most" (a rollout in five without a generator side), "all" or
    "none"."""
    rng = random.Random(seed)
    records = []
    for step in range(1, steps + 1):
        rollouts = [
            _rollout(
                rng,
                step,
                g,
                i,
                generator=generator == "all" or (generator == "most" and rng.random() > 0.2),
                hostile=hostile,
            )
            for g in range(groups)
            for i in range(group_size)
        ]
        sides = [
            mismatch.Sides(r.token_logprobs, r.generator_logprobs)
            for r in rollouts
            if r.generator_logprobs is not None
        ]
        metrics: dict[str, float | None] = dict(mismatch.step_figures(sides))
        records.append(StepRecord(step, step, {"reward_mean": 0.5}, rollouts, metrics))
    return records


def mismatch_run(
    factory: sessionmaker[Session],
    *,
    records: list[StepRecord] | None = None,
    keep_tokens_every: int | None = None,
    name: str = "mismatch",
    **shape: Any,
) -> int:
    """A run of `records` (else mismatch_steps(**shape)) recorded through the store; its id."""
    records = records if records is not None else mismatch_steps(**shape)
    size = max((len(r.rollouts) for r in records), default=1)
    with session_scope(factory) as session:
        run_id = store.create_run(
            session, name=name, model="tiny", total_steps=len(records), group_size=size,
            control_tokens=CONTROL_TOKENS, keep_tokens_every=keep_tokens_every,
        ).id  # fmt: skip
    record_steps(factory, run_id, records)
    return run_id


def stored_figures(factory: sessionmaker[Session], run_id: int) -> dict[int, dict[str, Any]]:
    """rollout id → its step, group, index, stored columns and the brute-force figures of its
    arrays as read back (mismatch.rollout_figures over serialize.per_token's two sides)."""
    out = {}
    with session_scope(factory) as session:
        for row, _ in store.iter_rollouts(session, run_id=run_id):
            trainer, generator, _, _ = per_token(row, CONTROL_TOKENS, None)
            found = None
            if generator is not None and row.tokens_kept:
                found = mismatch.rollout_figures(mismatch.Sides(trainer, generator))
            out[row.id] = {
                "id": row.id,
                "step": row.step,
                "group": row.group,
                "index": row.index,
                "column_diff": row.abs_diff_max,
                "column_ratio": row.log_seq_ratio,
                "abs_diff_max": None if found is None else found.abs_diff_max,
                "log_seq_ratio": None if found is None else found.log_seq_ratio,
                "trainer": trainer,
                "generator": generator,
            }
    return out
