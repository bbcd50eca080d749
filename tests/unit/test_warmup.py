"""The format warm-up's data (trainer.envs.warmup): the format on what the RL run never sees."""

from __future__ import annotations

import pytest
from rollout_lens.trainer.envs import warmup
from rollout_lens.trainer.envs.onestep import EscalationEnv, parse_vote, reply, tokens

SEEDS = range(6)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("variant", ["patched", "leaky"])
def test_no_query_or_target_capability_of_the_run(seed: int, variant: str) -> None:
    """No warm-up query is a training or held-out query of the run, and no warm-up target is a
    capability any of them asks for."""
    env = EscalationEnv(seed=seed, variant=variant)
    run_queries = {q.text for q in env.train_queries + env.heldout_queries}
    run_capabilities = {q.capability for q in env.train_queries + env.heldout_queries}
    examples = warmup.examples(env)
    assert examples
    for example in examples:
        assert example.query not in run_queries
        assert example.target in example.tool_ids
        capability = next(
            line.split(": ", 1)[1]
            for line in example.prompt.splitlines()
            if line.startswith(f"- {example.target}: ")
        )
        assert capability not in run_capabilities
        assert warmup.QUERIES[capability] == example.query


@pytest.mark.parametrize("seed", SEEDS)
def test_patched_warmup_lists_no_capability_the_run_targets(seed: int) -> None:
    """A patched run's warm-up lists k tools, none of them one a training query asks for."""
    env = EscalationEnv(seed=seed, variant="patched", k=4)
    targeted = {q.capability for q in env.train_queries}
    for example in warmup.examples(env):
        listed = [line.split(": ", 1)[1] for line in example.prompt.splitlines()[1:5]]
        assert len(example.tool_ids) == len(listed) == 4
        assert not targeted & set(listed)


def test_leaky_warmup_lists_all_64_under_other_ids() -> None:
    """A leaky run's warm-up lists every tool, as the run does, under ids drawn afresh."""
    env = EscalationEnv(seed=0, variant="leaky")
    run_ids = {t.capability: t.id for t in env.tools}
    examples = warmup.examples(env)
    assert all(len(set(e.tool_ids)) == 64 for e in examples)
    same = sum(
        run_ids[line.split(": ", 1)[1]] == line[2:9]
        for e in examples
        for line in e.prompt.splitlines()
        if line.startswith("- tool_")
    )
    # A fresh random id matches the run's 1 time in 64: about a sixty-fourth of the lines.
    assert same < len(examples) * 64 / 16


def test_the_ids_say_nothing_across_examples() -> None:
    """The same capability is the target under different ids (ids carry no meaning into RL)."""
    env = EscalationEnv(seed=0, variant="patched")
    targets: dict[str, set[str]] = {}
    for example in warmup.examples(env, repeats=4):
        targets.setdefault(example.query, set()).add(example.target)
    assert all(len(ids) > 1 for ids in targets.values())


def test_the_reply_is_the_format_and_retrieval_ranks_as_the_run_does() -> None:
    """The taught reply parses as a vote; the shortlist's others share the most query words."""
    env = EscalationEnv(seed=1, variant="patched")
    for example in warmup.examples(env):
        assert parse_vote(reply(example.target)) == example.target
    pool = warmup.untargeted(env)
    query, capability = next(
        (q, c) for c, q in warmup.QUERIES.items() if c == "generate a random password"
    )
    example = next(e for e in warmup.examples(env) if e.query == query)
    listed = [line.split(": ", 1)[1] for line in example.prompt.splitlines()[1:5]]
    others = sorted(
        (c for c in pool if c != capability), key=lambda c: -len(tokens(query) & tokens(c))
    )
    best = len(tokens(query) & tokens(others[0]))
    assert any(len(tokens(query) & tokens(c)) == best for c in listed if c != capability)


def test_a_seed_draws_its_own_warmup() -> None:
    a, b = (warmup.examples(EscalationEnv(seed=s)) for s in (0, 1))
    assert a == warmup.examples(EscalationEnv(seed=0))
    assert [e.prompt for e in a] != [e.prompt for e in b]
