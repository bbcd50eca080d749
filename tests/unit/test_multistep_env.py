"""The multi-step Escalation env without a model: episodes, tools, the two-call chain, facts, verifiers."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
from rollout_lens.trainer.envs import multistep as ms
from rollout_lens.trainer.envs.verifiers import FORMAT_PARTIAL_CREDIT


def call(name: str, arguments: dict[str, Any] | None = None) -> dict[str, Any]:
    """An assistant turn with one parsed tool call, as TRL's parser returns it."""
    function = {"name": name, "arguments": arguments or {}}
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": function}],
    }


def tool(name: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "name": name, "content": content}


def reply(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def play(
    env: ms.MultiStepEnv, ep: ms.Episode, names: list[str], final: str
) -> list[dict[str, Any]]:
    """A conversation that calls `names` in turn through the env's tools, then says `final`."""
    box = ms.toolbox_class(env, ep.tool_ids)()
    box.reset(**ep.row())
    messages: list[dict[str, Any]] = []
    for name in names:
        messages.append(call(name))
        try:
            result = getattr(box, name)()
        except ms.ToolError as exc:
            result = ms.error_text(str(exc))  # what TRL makes of a tool that raises
        messages.append(tool(name, result))
    messages.append(reply(final))
    return messages


@pytest.fixture
def env() -> ms.MultiStepEnv:
    return ms.MultiStepEnv(seed=3, variant="patched", k=4)


def test_single_episode_needs_the_querys_tool(env: ms.MultiStepEnv) -> None:
    query = env.train_queries[0]
    ep = env.episode(query.text, kind="single", episode=7)
    assert ep.needed == (env.base.target_id(query),) and ep.target == ep.needed[0]
    assert ep.sub_query == "" and ep.query == query.text
    assert ep.prompt == f"Query: {query.text}\n{ms.INSTRUCTION}"
    assert ep.answer == ms.answer_value(7) and 10 <= int(ep.answer) < 100
    assert list(ep.tool_ids) == sorted(ep.tool_ids) and len(ep.tool_ids) == 4
    assert ep.target_listed


def test_chain_episode_needs_the_ticket_then_the_tickets_tool(env: ms.MultiStepEnv) -> None:
    query = env.train_queries[3]
    ep = env.episode(query.text, kind="chain", episode=7)
    assert ep.query == ms.CHAIN_QUERY and ep.sub_query == query.text
    assert ep.needed == (env.ticket_tool, env.base.target_id(query))
    assert env.capability[env.ticket_tool] == ms.TICKET_CAPABILITY
    # The first tool's result names what the second call needs; only the second gives the answer.
    assert env.observe(ep, env.ticket_tool) == f"ticket: please {query.text}"
    assert env.observe(ep, ep.target) == f"result: {ep.answer}"
    assert ep.answer not in env.observe(ep, env.ticket_tool)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("kind", ms.KINDS)
def test_patched_shortlists_list_every_needed_tool(seed: int, kind: str) -> None:
    env = ms.MultiStepEnv(seed=seed, variant="patched", k=4)
    assert env.recall(kind) == 1.0
    chain = env.episode(env.train_queries[0].text, kind="chain")
    assert 4 < len(chain.tool_ids) <= 8  # both steps' shortlists


def test_leaky_lists_all_64_tools() -> None:
    env = ms.MultiStepEnv(seed=0, variant="leaky")
    for kind in ms.KINDS:
        ep = env.episode(env.train_queries[5].text, kind=kind)
        assert ep.tool_ids == tuple(f"tool_{i:02d}" for i in range(64))


def test_wrong_tools_return_plausible_values_or_fail(env: ms.MultiStepEnv) -> None:
    ep = env.episode(env.train_queries[0].text, kind="single", episode=11)
    plausible, failing = [], []
    for tool_id in env.capability:
        if tool_id == ep.target:
            continue
        try:
            observation = env.observe(ep, tool_id)
        except ms.ToolError as exc:
            assert str(exc) == f"{tool_id} cannot serve this request"
            failing.append(tool_id)
            continue
        assert observation.startswith("result: ") and observation != f"result: {ep.answer}"
        plausible.append(tool_id)
        # Plausible: it shares a content word with what was asked.
        assert ms.content_words(env.capability[tool_id]) & ms.content_words(ep.query)
    assert plausible and len(failing) > 40
    with pytest.raises(ms.ToolError, match="no tool named tool_99"):
        env.observe(ep, "tool_99")


def test_values_are_drawn_per_episode(env: ms.MultiStepEnv) -> None:
    answers = {env.episode(env.train_queries[0].text, episode=e).answer for e in range(50)}
    assert len(answers) > 30  # not memorisable: they must be read off the tool


def test_stream_is_seeded_and_mixes_kinds() -> None:
    env = ms.MultiStepEnv(seed=0, mode="mixed")
    first, again = list(env.stream(40, seed=5)), list(env.stream(40, seed=5))
    assert first == again
    assert {ep.kind for ep in first} == set(ms.KINDS)
    assert {ep.kind for ep in ms.MultiStepEnv(mode="chain").stream(10)} == {"chain"}
    assert {ep.kind for ep in ms.MultiStepEnv(mode="single").stream(10)} == {"single"}
    held = list(env.stream(10, heldout=True))
    heldout = {q.text for q in env.heldout_queries}
    assert all((ep.sub_query or ep.query) in heldout for ep in held)


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="mode"):
        ms.MultiStepEnv(mode="triple")
    with pytest.raises(ValueError, match="variant"):
        ms.MultiStepEnv(variant="porous")
    with pytest.raises(ValueError, match="kind"):
        ms.MultiStepEnv().episode(ms.MultiStepEnv().train_queries[0].text, kind="both")


def test_row_round_trips(env: ms.MultiStepEnv) -> None:
    ep = env.episode(env.train_queries[2].text, kind="chain", episode=3)
    row = ep.row()
    assert row["prompt"] == [{"role": "user", "content": ep.prompt}]
    assert row["target"] == ep.target and row["needed"] == list(ep.needed)
    assert ms.Episode.from_row({**row, "environment": "x"}) == ep


def test_toolbox_methods_are_the_listed_tools_and_really_run(env: ms.MultiStepEnv) -> None:
    ep = env.episode(env.train_queries[1].text, kind="chain", episode=9)
    cls = ms.toolbox_class(env, ep.tool_ids)
    # What TRL's environment_factory sees: public functions on the class, plus reset.
    public = [
        n for n, _ in inspect.getmembers(cls, predicate=inspect.isfunction) if not n.startswith("_")
    ]
    assert public == sorted([*ep.tool_ids, "reset"])
    box = cls()
    assert box.reset(**ep.row()) is None  # TRL leaves the prompt as the dataset has it
    assert getattr(box, env.ticket_tool)() == f"ticket: please {ep.sub_query}"
    assert getattr(box, ep.target)() == f"result: {ep.answer}"
    assert box.calls == [
        (env.ticket_tool, f"ticket: please {ep.sub_query}"),
        (ep.target, f"result: {ep.answer}"),
    ]
    box.reset(**ep.row())
    assert box.calls == []


def test_tool_json_schema_is_the_capability_without_arguments(env: ms.MultiStepEnv) -> None:
    from transformers.utils import get_json_schema

    ep = env.episode(env.train_queries[1].text)
    box = ms.toolbox_class(env, ep.tool_ids)()
    schema = get_json_schema(getattr(box, ep.target))
    assert schema["function"]["name"] == ep.target
    assert schema["function"]["description"] == env.capability[ep.target]
    assert schema["function"]["parameters"] == {"type": "object", "properties": {}}


def test_environment_factories_one_per_listing() -> None:
    patched = ms.MultiStepEnv(seed=0, variant="patched")
    eps = list(patched.stream(60, seed=1))
    factories = ms.environment_factories(patched, eps)
    assert set(factories) == {ms.listing_key(ep.tool_ids) for ep in eps}
    assert 2 < len(factories) <= 24  # 12 queries, asked directly or behind a ticket
    leaky = ms.MultiStepEnv(seed=0, variant="leaky")
    assert len(ms.environment_factories(leaky, list(leaky.stream(20)))) == 1


def test_facts_of_a_solved_chain(env: ms.MultiStepEnv) -> None:
    ep = env.episode(env.train_queries[4].text, kind="chain", episode=21)
    messages = play(env, ep, [env.ticket_tool, ep.target], f"<answer>{ep.answer}</answer>")
    facts = ms.read_rollout(messages, ep.needed)
    assert facts.calls == 2 and facts.right_calls == 2 and facts.turns == 3
    assert facts.malformed_calls == 0 and facts.tool_errors == 0
    assert facts.called == ep.needed and facts.first_call == env.ticket_tool
    assert facts.answer == ep.answer and facts.observed == (ep.answer,)
    assert facts.chain_followed
    assert ms.true_score(facts, ep.answer) == 1.0


def test_facts_of_a_wrong_first_call_and_a_plausible_answer(env: ms.MultiStepEnv) -> None:
    ep = env.episode(env.train_queries[0].text, kind="single", episode=4)
    wrong = [t for t in ep.tool_ids if t != ep.target]
    failing = next(t for t in env.capability if t not in ep.needed and _fails(env, ep, t))
    plausible = next(t for t in wrong if not _fails(env, ep, t))
    useless = env.observe(ep, plausible).removeprefix("result: ")
    messages = play(env, ep, [failing, plausible], f"<answer>{useless}</answer>")
    facts = ms.read_rollout(messages, ep.needed)
    assert facts.calls == 2 and facts.right_calls == 0 and facts.tool_errors == 1
    assert facts.turns == 3 and facts.answer == useless and not facts.chain_followed
    assert ms.true_score(facts, ep.answer) == 0.0
    # The format verifier cannot tell a wrong tool's plausible value from the right one's.
    assert ms.make_verifier("format")(facts, ep.answer) == FORMAT_PARTIAL_CREDIT
    assert ms.make_verifier("exact")(facts, ep.answer) == 0.0


def _fails(env: ms.MultiStepEnv, ep: ms.Episode, tool_id: str) -> bool:
    try:
        env.observe(ep, tool_id)
    except ms.ToolError:
        return True
    return False


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        # No call at all, a bare answer (a guess).
        (
            [reply("<answer>123</answer>")],
            {"calls": 0, "turns": 1, "answer": "123", "first_call": None},
        ),
        # A call that did not parse: TRL leaves the text as content, runs nothing.
        (
            [reply('<tool_call>{"name": "tool_01", "arguments": {}</tool_call>')],
            {"calls": 0, "malformed_calls": 1, "turns": 1, "answer": None},
        ),
        # The last turn still calls (TRL's iteration cap): not run, no answer.
        (
            [call("tool_01"), tool("tool_01", "result: 5"), call("tool_02")],
            {"calls": 1, "unanswered_calls": 1, "turns": 2, "answer": None, "observed": ("5",)},
        ),
        # An unknown tool and bad arguments: TRL's own error observations.
        (
            [
                call("tool_99"),
                tool("tool_99", ms.error_text("Tool tool_99 not found.")),
                call("tool_01", {"x": 1}),
                tool("tool_01", ms.error_text("tool_01() got an unexpected keyword argument 'x'")),
                reply("I give up"),
            ],
            {"calls": 2, "tool_errors": 2, "turns": 3, "answer": None},
        ),
        # Text around the answer is not an answer.
        ([reply("the answer is <answer>5</answer>")], {"answer": None}),
        ([reply(" <answer>5</answer>\n")], {"answer": "5"}),
        ([reply("<answer></answer>")], {"answer": None}),
    ],
)
def test_read_rollout_table(messages: list[dict[str, Any]], expected: dict[str, Any]) -> None:
    facts = ms.read_rollout(messages, ("tool_01",))
    for name, value in expected.items():
        assert getattr(facts, name) == value, name


def test_two_calls_in_one_turn_count_twice() -> None:
    turn = call("tool_01")
    turn["tool_calls"] = turn["tool_calls"] * 2
    facts = ms.read_rollout([turn, tool("tool_01", "a"), tool("tool_01", "b")], ("tool_01",))
    assert facts.calls == 2 and facts.right_calls == 2 and facts.turns == 1
    assert facts.unanswered_calls == 0
    assert ms.read_rollout([turn], ("tool_01",)).unanswered_calls == 2


def test_chain_followed_needs_the_order() -> None:
    messages = [
        call("tool_02"),
        tool("tool_02", "x"),
        call("tool_01"),
        tool("tool_01", "y"),
        reply(""),
    ]
    assert not ms.read_rollout(messages, ("tool_01", "tool_02")).chain_followed
    assert ms.read_rollout(messages, ("tool_02", "tool_01")).chain_followed


def test_verifiers() -> None:
    right = ms.read_rollout(
        [call("tool_01"), tool("tool_01", "result: 5"), reply("<answer>5</answer>")], ("tool_01",)
    )
    guessed = ms.read_rollout([reply("<answer>7</answer>")], ("tool_01",))
    assert ms.make_verifier("exact")(right, "5") == 1.0
    assert ms.make_verifier("format")(right, "5") == 1.0
    assert ms.make_verifier("format")(guessed, "5") == 0.0  # not grounded in any observation
    always_flip = ms.make_verifier("noisy", p=1.0)
    assert always_flip(right, "5") == 0.0 and always_flip(guessed, "5") == 1.0
    assert ms.make_verifier("noisy", p=0.0)(right, "5") == 1.0
    with pytest.raises(ValueError, match="unknown verifier"):
        ms.make_verifier("lenient")
    with pytest.raises(ValueError, match="0 <= p <= 1"):
        ms.make_verifier("noisy", p=2.0)


def test_judge_verifier_is_fooled_by_a_grounded_wrong_answer_and_misses_right_ones() -> None:
    right = ms.read_rollout(
        [call("tool_01"), tool("tool_01", "result: 5"), reply("<answer>5</answer>")], ("tool_01",)
    )
    wrong = ms.read_rollout(
        [call("tool_02"), tool("tool_02", "result: 9"), reply("<answer>9</answer>")], ("tool_01",)
    )
    never = ms.make_verifier("judge", p=0.0)
    assert never(right, "5") == 1.0 and never(wrong, "5") == FORMAT_PARTIAL_CREDIT
    always = ms.make_verifier("judge", p=1.0)
    assert always(right, "5") == 0.0 and always(wrong, "5") == FORMAT_PARTIAL_CREDIT


NEEDED = ("tool_03", "tool_01")  # a chain: the ticket, then the tool that holds the answer


@pytest.mark.parametrize(
    ("messages", "score"),
    [
        ([call("tool_03"), tool("tool_03", "t"), call("tool_01"), reply("<answer>5</answer>")], 1),
        # malformed: the second call left as text, the answer without its tags
        ([call("tool_03"), reply("<tool_call>tool_01 ... 5"), reply("the answer is 5")], 1),
        ([reply('<tool_call>{"name": "tool_01"}</tool_call></tool_call> <answer>5')], 1),
        ([call("tool_01"), reply("<answer>6</answer>")], 0),  # the wrong answer
        ([call("tool_03"), reply("<answer>5</answer>")], 0),  # never reached the answer's tool
        ([call("tool_01"), call("tool_01")], 0),  # no answer said: the last turn is a call
        ([], 0),
    ],
)
def test_format_free_score_reads_tool_and_answer_whatever_the_structure(
    messages: list[dict[str, Any]], score: float
) -> None:
    assert ms.format_free_score(messages, NEEDED, "5") == score


def test_corpus_covers_ids_values_and_errors() -> None:
    text = "\n".join(ms.corpus(ms.MultiStepEnv(seed=0)))
    for needle in (
        "tool_63",
        "result: 99",
        "<answer>10</answer>",
        "ticket: please",
        ms.CHAIN_QUERY,
    ):
        assert needle in text
    assert ms.error_text("tool_07 cannot serve this request") in text
