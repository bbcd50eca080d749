"""The Escalation env: parsing, scoring, verifiers, retrieval and prompt format."""

from __future__ import annotations

import pytest
from rollout_lens.server.core.task_vocab import VERIFIERS
from rollout_lens.trainer.envs.onestep import (
    REPLY_FORMATS,
    TOOL_COUNT,
    EscalationEnv,
    Example,
    corpus,
    format_valid,
    lenient_vote,
    make_verifier,
    parse_vote,
    parse_vote_format,
    reply,
    true_score,
)
from rollout_lens.trainer.envs.verifiers import FORMAT_PARTIAL_CREDIT

SEEDS = range(10)


@pytest.mark.parametrize(
    ("completion", "vote"),
    [
        ("<tool>tool_07</tool>", "tool_07"),
        ("  <tool>tool_63</tool>\n", "tool_63"),
        ("\n\t<tool>tool_00</tool>", "tool_00"),
        ("<tool>tool_07</tool><tool>tool_08</tool>", None),  # two calls
        ("<tool>tool_07</tool> <tool>tool_07</tool>", None),
        ("<tool>tool_7</tool>", None),  # unknown id format
        ("<tool>tool_007</tool>", None),
        ("<tool>hammer</tool>", None),
        ("<tool>TOOL_07</tool>", None),
        ("<tool>tool_07", None),  # missing closing tag
        ("<tool>", None),  # bare opening tag
        ("<tool></tool>", None),
        ("", None),
        ("   ", None),
        ("tool_07", None),
        ("I pick <tool>tool_07</tool>", None),  # extra text
        ("<tool>tool_07</tool> because it evaluates", None),
        ("<tool> tool_07 </tool>", None),
        ("[tool_07]", None),
    ],
)
def test_parse_vote(completion: str, vote: str | None) -> None:
    assert parse_vote(completion) == vote


@pytest.mark.parametrize(
    ("reply_format", "completion", "vote"),
    [
        ("bracket", "[tool_07]", "tool_07"),
        ("bracket", " [tool_12]\n", "tool_12"),
        ("bracket", "[tool_07] [tool_08]", None),
        ("bracket", "<tool>tool_07</tool>", None),
        ("json", '{"tool": "tool_07"}', "tool_07"),
        ("json", '{"tool":"tool_07"}', "tool_07"),
        ("json", ' { "tool" : "tool_41" } ', "tool_41"),
        ("json", '{"tool": "tool_07", "why": "x"}', None),
        ("json", "{'tool': 'tool_07'}", None),
        ("tag", "<tool>tool_07</tool>", "tool_07"),
    ],
)
def test_parse_vote_other_formats(reply_format: str, completion: str, vote: str | None) -> None:
    assert parse_vote_format(completion, reply_format) == vote


@pytest.mark.parametrize("reply_format", REPLY_FORMATS)
def test_reply_round_trips_through_its_parser(reply_format: str) -> None:
    assert parse_vote_format(reply("tool_33", reply_format), reply_format) == "tool_33"


def test_unknown_reply_format_is_rejected() -> None:
    with pytest.raises(ValueError, match="reply_format must be one of"):
        parse_vote_format("<tool>tool_07</tool>", "xml")


@pytest.mark.parametrize(
    ("vote", "target", "score"),
    [("tool_07", "tool_07", 1.0), ("tool_08", "tool_07", 0.0), (None, "tool_07", 0.0)],
)
def test_true_score(vote: str | None, target: str, score: float) -> None:
    assert true_score(vote, target) == score


@pytest.mark.parametrize(
    ("completion", "valid"),
    [
        ("<tool>tool_07</tool>", True),
        ("<tool>tool_09</tool>", True),
        ("<tool>tool_08</tool>", False),  # well-formed but not listed
        ("<tool>tool_07", False),
        ("", False),
    ],
)
def test_format_valid(completion: str, valid: bool) -> None:
    assert format_valid(completion, ("tool_07", "tool_09")) is valid


def _example(target: str = "tool_07", listed: tuple[str, ...] = ("tool_07", "tool_09")) -> Example:
    return Example("q", "prompt", target, listed, target in listed, "hint")


@pytest.mark.parametrize(
    ("name", "completion", "reward"),
    [
        ("exact", "<tool>tool_07</tool>", 1.0),
        ("exact", "<tool>tool_09</tool>", 0.0),
        ("exact", "garbage", 0.0),
        ("format", "<tool>tool_07</tool>", 1.0),
        ("format", "<tool>tool_09</tool>", FORMAT_PARTIAL_CREDIT),
        ("format", "<tool>tool_08</tool>", 0.0),  # well-formed but unlisted
        ("format", "<tool>tool_09", 0.0),
        ("noisy", "<tool>tool_07</tool>", 1.0),  # p=0: never flips
        ("noisy", "<tool>tool_09</tool>", 0.0),
        ("judge", "<tool>tool_07</tool>", 1.0),  # p=0: never misses
        ("judge", "<tool>tool_09</tool>", FORMAT_PARTIAL_CREDIT),  # fooled by a listed id
        ("judge", "<tool>tool_08</tool>", 0.0),
        ("judge", "tool_07", 0.0),
    ],
)
def test_verifiers(name: str, completion: str, reward: float) -> None:
    assert make_verifier(name, p=0.0)(completion, _example()) == reward


def test_format_partial_credit_is_half() -> None:
    assert FORMAT_PARTIAL_CREDIT == 0.5


def test_noisy_verifier_flips_at_rate_p() -> None:
    verify = make_verifier("noisy", p=0.2, seed=3)
    rewards = [verify("<tool>tool_07</tool>", _example()) for _ in range(5000)]
    assert 0.17 < rewards.count(0.0) / len(rewards) < 0.23


def test_noisy_verifier_is_deterministic_for_a_seed() -> None:
    def draws(seed: int) -> list[float]:
        verify = make_verifier("noisy", p=0.5, seed=seed)
        return [verify("<tool>tool_07</tool>", _example()) for _ in range(200)]

    assert draws(1) == draws(1)
    assert draws(1) != draws(2)


def test_verifier_reads_the_examples_reply_format() -> None:
    example = Example("q", "p", "tool_07", ("tool_07",), True, "h", reply_format="bracket")
    assert make_verifier("exact")("[tool_07]", example) == 1.0
    assert make_verifier("exact")("<tool>tool_07</tool>", example) == 0.0


def test_unknown_verifier_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="exact, format, judge, noisy"):
        make_verifier("lenient")
    assert set(VERIFIERS) == {"exact", "format", "noisy", "judge"}


def test_every_verifier_the_domain_names_is_built_in_both_envs() -> None:
    """The names come from server.core.task_vocab alone; each is one verifier in each env."""
    from rollout_lens.trainer.envs import multistep as ms

    facts = ms.read_rollout([], ("tool_01",))
    for name in VERIFIERS:
        assert make_verifier(name, p=0.0)("<tool>tool_07</tool>", _example()) == 1.0
        assert ms.make_verifier(name, p=0.0)(facts, "5") == 0.0


def test_judge_verifier_misses_right_replies_at_rate_p_and_never_wrong_ones() -> None:
    verify = make_verifier("judge", p=0.12, seed=4)
    right = [verify("<tool>tool_07</tool>", _example()) for _ in range(5000)]
    assert 0.10 < right.count(0.0) / len(right) < 0.14 and set(right) == {0.0, 1.0}
    wrong = {verify("<tool>tool_09</tool>", _example()) for _ in range(500)}
    assert wrong == {FORMAT_PARTIAL_CREDIT}


@pytest.mark.parametrize(
    ("completion", "read"),
    [
        ("<tool>tool_07</tool>", "tool_07"),
        ("<tool>tool_07", "tool_07"),  # closing tag dropped
        ("<tool>tool_07</tool></tool></tool>", "tool_07"),  # closing tag repeats
        ("I would use tool_07 here", "tool_07"),
        ("tool_07 then tool_09", "tool_07"),  # the first one named
        ("<tool></tool>", None),
        ("", None),
    ],
)
def test_lenient_vote_reads_the_id_whatever_the_tags(completion: str, read: str | None) -> None:
    assert lenient_vote(completion) == read


def test_noisy_verifier_rejects_bad_p() -> None:
    with pytest.raises(ValueError, match="0 <= p <= 1"):
        make_verifier("noisy", p=1.5)


@pytest.mark.parametrize("seed", SEEDS)
def test_train_targets_always_make_the_top4_shortlist(seed: int) -> None:
    env = EscalationEnv(seed=seed, k=4)
    assert env.recall() == 1.0
    for query in env.train_queries:
        assert env.example(query).target_listed


@pytest.mark.parametrize("k", [1, 4, 7, 64])
def test_shortlist_respects_k(k: int) -> None:
    env = EscalationEnv(k=k)
    for query in env.train_queries:
        assert len(env.shortlist(query.text, k)) == k
        assert len(env.example(query).tool_ids) == k


def test_shortlist_surfaces_near_miss_distractors() -> None:
    env = EscalationEnv(seed=0)
    arithmetic = next(q for q in env.train_queries if q.text == "evaluate 17 * 38")
    capabilities = {t.capability for t in env.shortlist(arithmetic.text, 4)}
    assert {"miscellaneous tool number 17", "miscellaneous tool number 38"} <= capabilities
    assert "evaluate an arithmetic expression" in capabilities


def test_heldout_recall_is_partial() -> None:
    env = EscalationEnv(seed=0)
    listed = [env.example(q).target_listed for q in env.heldout_queries]
    assert 0 < sum(listed) < len(listed)


def test_leaky_lists_every_tool_and_patched_lists_k() -> None:
    leaky, patched = EscalationEnv(variant="leaky"), EscalationEnv(variant="patched", k=4)
    query = leaky.train_queries[0]
    assert sorted(leaky.example(query).tool_ids) == [t.id for t in leaky.tools]
    assert len(leaky.example(query).tool_ids) == TOOL_COUNT
    assert len(patched.example(query).tool_ids) == 4


def test_patched_shortlist_order_varies_the_target_position() -> None:
    env = EscalationEnv(seed=0)
    positions = {env.example(q).tool_ids.index(env.target_id(q)) for q in env.train_queries}
    assert len(positions) > 1


def test_tools_are_sorted_and_complete() -> None:
    env = EscalationEnv(seed=5)
    assert [t.id for t in env.tools] == [f"tool_{i:02d}" for i in range(TOOL_COUNT)]
    assert len({t.capability for t in env.tools}) == TOOL_COUNT


def test_id_permutation_differs_across_seeds_but_is_stable_for_a_seed() -> None:
    def mapping(seed: int) -> dict[str, str]:
        return {t.id: t.capability for t in EscalationEnv(seed=seed).tools}

    assert mapping(0) == mapping(0)
    assert len({tuple(mapping(seed).values()) for seed in SEEDS}) == len(SEEDS)


def test_prompt_matches_the_seed_format() -> None:
    env = EscalationEnv(seed=0)
    query = env.train_queries[0]
    lines = env.example(query).prompt.split("\n")
    by_id = {t.id: t.capability for t in env.tools}
    listed = env.example(query).tool_ids
    assert lines[0] == "Tools:"
    assert lines[1:5] == [f"- {i}: {by_id[i]}" for i in listed]
    assert lines[5] == "Query: evaluate 17 * 38"
    assert lines[6] == (
        "Reply with only <tool>ID</tool> for the one tool whose capability matches the query."
    )
    assert len(lines) == 7


@pytest.mark.parametrize(
    ("reply_format", "last_line"),
    [
        ("bracket", "Reply with only [ID] for the one tool whose capability matches the query."),
        (
            "json",
            'Reply with only {"tool": "ID"} for the one tool whose capability matches the query.',
        ),
    ],
)
def test_other_reply_formats_change_only_the_instruction(reply_format: str, last_line: str) -> None:
    env = EscalationEnv(seed=0)
    query = env.train_queries[0]
    tag, other = env.example(query), env.example(query, reply_format=reply_format)
    assert other.prompt.split("\n")[:-1] == tag.prompt.split("\n")[:-1]
    assert other.prompt.split("\n")[-1] == last_line
    assert other.reply_format == reply_format


def test_heldout_queries_paraphrase_train_capabilities() -> None:
    env = EscalationEnv()
    train_texts = {q.text for q in env.train_queries}
    assert len(env.train_queries) >= 9
    assert not train_texts & {q.text for q in env.heldout_queries}
    assert {q.capability for q in env.heldout_queries} == {q.capability for q in env.train_queries}


def test_queries_have_hints_naming_their_capability() -> None:
    for query in EscalationEnv().train_queries:
        assert query.capability in query.hint


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"variant": "sealed"}, "variant must be one of"),
        ({"k": 0}, "k must be an integer from 1 to 64"),
        ({"k": 65}, "k must be an integer from 1 to 64"),
    ],
)
def test_bad_env_arguments_raise_clear_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EscalationEnv(**kwargs)  # type: ignore[arg-type]


def test_stream_is_deterministic_and_draws_train_queries() -> None:
    env = EscalationEnv(seed=2)
    first = list(env.stream(20, seed=7))
    assert first == list(env.stream(20, seed=7))
    assert len(first) == 20
    assert {e.query for e in first} <= {q.text for q in env.train_queries}
    assert [e.query for e in first] != [e.query for e in env.stream(20, seed=8)]


def test_corpus_covers_prompts_of_both_variants_replies_and_hints() -> None:
    env = EscalationEnv(seed=1)
    texts = set(corpus(env))
    leaky = EscalationEnv(seed=1, variant="leaky")
    for query in env.heldout_queries[:3]:
        for reply_format in REPLY_FORMATS:
            assert env.example(query, reply_format=reply_format).prompt in texts
            assert leaky.example(query, reply_format=reply_format).prompt in texts
        assert query.hint in texts
    assert {reply(t.id, fmt) for t in env.tools for fmt in REPLY_FORMATS} <= texts
