"""The step viewer's marks, pure (server.webapp.pages.stepview): how a tool-calling rollout's vote reads (new runs
and runs recorded before `meta.first_call`), tool results as formatted JSON, the format badge,
folded control-token tables' one line, and hints."""

from __future__ import annotations

import json
from typing import Any

import pytest
from rollout_lens.server.core.read_models import GroupHeader
from rollout_lens.server.core.step_views import RolloutView
from rollout_lens.server.webapp.pages import badges, turns
from rollout_lens.server.webapp.queries import group_header

from tests.factories import make_multiturn_group


def _dicts(legacy: bool) -> list[dict[str, Any]]:
    """make_multiturn_group's records as the viewer gets rollouts (serialize.rollout_dict keys
    it reads)."""
    return [
        {
            "group": r.group,
            "index": r.index,
            "prompt": r.prompt,
            "vote": r.vote,
            "target": r.target,
            "true_score": r.true_score,
            "meta": r.meta,
        }
        for r in make_multiturn_group(legacy=legacy)
    ]


def _header(members: list[dict[str, Any]]) -> GroupHeader:
    """group_header.group_header of these rollouts as the read side's typed views."""
    return group_header.group_header([RolloutView.from_data(m) for m in members])


def test_a_new_runs_vote_is_the_answer_and_the_tool_that_gave_it() -> None:
    right, out_of_calls, wrong, silent = (
        group_header.answer_vote(r["vote"], r["meta"]) for r in _dicts(legacy=False)
    )
    assert right == {
        "legacy": False,
        "vote": "tool_59",
        "answer": "<answer>48</answer>",
        "answer_value": "48",
        "source": "tool_59",
        "first_call": "tool_00",
    }
    assert out_of_calls is not None and out_of_calls["answer"] is None
    assert out_of_calls["source"] is None and out_of_calls["first_call"] == "tool_00"
    assert wrong is not None and (wrong["source"], wrong["answer_value"]) == ("tool_12", "31")
    # answered with no tool: the vote is the answer text, not a tool
    assert silent is not None and silent["vote"] == "<answer>77</answer>"
    assert silent["source"] is None and silent["first_call"] is None
    assert silent["answer_value"] == "77"


def test_a_vote_names_a_tool_only_when_the_rollout_called_it() -> None:
    meta = make_multiturn_group()[2].meta  # called tool_12, answered <answer>31</answer>
    for vote in ("31", "<answer>31</answer>", "tool_59"):  # the value, the text, a tool not called
        view = group_header.answer_vote(vote, meta)
        assert view is not None and view["source"] is None and view["answer_value"] == "31"
    members = _dicts(legacy=False)
    members[2]["vote"] = "31"
    labels = {r["vote"]: r.get("label") for r in _header(members)["votes"]}
    assert labels == {
        "tool_59": None,
        "31": "answer 31",
        "<answer>77</answer>": "answer 77",
        None: None,
    }


def test_a_run_recorded_before_votes_with_its_first_call_derived_from_its_turns() -> None:
    views = [group_header.answer_vote(r["vote"], r["meta"]) for r in _dicts(legacy=True)]
    assert all(v is not None and v["legacy"] for v in views)
    assert [v["first_call"] for v in views if v] == ["tool_00", "tool_00", "tool_12", None]
    assert [v["vote"] for v in views if v] == ["tool_00", "tool_00", "tool_12", None]
    assert all(v["source"] is None for v in views if v)  # nothing claims a tool gave the answer
    assert views[0] is not None and views[0]["answer_value"] == "48"


def test_a_single_turn_rollout_has_no_answer_vote() -> None:
    assert group_header.answer_vote("tool_03", {"query": "q"}) is None
    assert group_header.answer_vote(None, None) is None
    # turns that are not a list are not turns
    assert group_header.answer_vote("tool_03", {"turns": "tool_00"}) is None


def test_first_call_skips_tool_stretches_and_turns_without_calls() -> None:
    turns = [
        {"role": "model", "start": 0, "end": 2, "calls": []},
        {"role": "tool", "start": 2, "end": 3, "calls": [{"name": "tool_09", "result": "x"}]},
        {"role": "model", "start": 3, "end": 5, "calls": [{"name": "tool_04"}, {"name": "t"}]},
    ]
    assert group_header.first_call(turns) == "tool_04"
    assert group_header.first_call([]) is None


def test_group_votes_first_calls_and_answers_of_a_multiturn_group() -> None:
    header = _header(_dicts(legacy=False))
    assert header["vote_kind"] == "answer"
    votes = {row["vote"]: row for row in header["votes"]}
    assert votes["tool_59"]["is_target"] and votes["tool_59"]["rollouts"] == [0]
    assert votes["<answer>77</answer>"]["label"] == "answer 77"  # not a tool: said so
    assert "label" not in votes["tool_59"]
    assert [(r["vote"], r["rollouts"]) for r in header["first_calls"]] == [
        ("tool_00", [0, 1]),
        ("tool_12", [2]),
        (None, [3]),
    ]
    legacy = _header(_dicts(legacy=True))
    assert legacy["vote_kind"] == "first_call" and legacy["first_calls"] == []
    assert legacy["votes"][0]["vote"] == "tool_00" and legacy["votes"][0]["count"] == 2


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ('{"result": 31, "unit": "km"}', {"result": 31, "unit": "km"}),
        (
            "{'error': 'tool_47 cannot serve this request'}",
            {"error": "tool_47 cannot serve this request"},
        ),  # fmt: skip
        ("  [1, 2.5, 'three', None, True]\n", [1, 2.5, "three", None, True]),
        ("{'nested': {'a': (1, 2)}, 'ü': '<b>'}", {"nested": {"a": [1, 2]}, "ü": "<b>"}),
        ('[{"k": null}]', [{"k": None}]),
    ],
)
def test_tool_results_that_are_json_or_python_literals_read_as_formatted_json(
    text: str, value: Any
) -> None:
    shown = turns.result_json(text)
    assert shown is not None
    assert json.loads(shown) == value
    assert shown == json.dumps(value, indent=2, ensure_ascii=False)


@pytest.mark.parametrize(
    "text",
    [
        "result: 48",
        "42",  # JSON, but not an object or array: the text is already what it says
        '"a string"',
        "{'error': 'cut off by the recorder…",
        "{__import__('os').system('touch /tmp/pwned')}",  # not a literal: never evaluated
        "[x for x in range(10)]",
        "{1, 2, 3}",  # a set: no JSON for it
        "{b'bytes': 1}",
        "{(1, 2): 'tuple key'}",
        "[" * 19_000,  # too deep for either parser: refused, not a crash
        "{'a': " * 2_500 + "1" + "}" * 2_500,  # deep, within the length parsed
        "[" + "1," * 20_000 + "1]",  # longer than RESULT_PARSE_CHARS: shown as text
        "",
    ],
)
def test_other_tool_results_stay_text(text: str) -> None:
    assert turns.result_json(text) is None


def test_turn_views_format_results_and_fold_tables_to_their_maxima() -> None:
    rollout = {
        "meta": make_multiturn_group()[0].meta,
        "token_logprobs": [-0.1] * 32,
        "control_view": {
            "<tool>": [0.9 if i % 7 == 0 else 0.1 for i in range(32)],
            "</assistant>": [None] * 32,  # nothing recorded: left out of the line
        },
    }
    cells = [{"text": str(i), "first": i, "last": i, "cls": "tok", "title": ""} for i in range(32)]
    views = turns.turn_views(
        rollout["meta"],
        rollout["token_logprobs"],
        rollout["control_view"],
        cells,
        [("sampled", [])],
    )
    assert views is not None
    tool_results = [c for v in views if v["role"] == "tool" for c in v["calls"]]
    assert tool_results[2]["result_json"] == '{\n  "error": "tool_47 cannot serve this request"\n}'
    assert tool_results[3]["result_json"] is None  # "result: 48"
    model = [v for v in views if v["role"] == "model"]
    # turn 1 is positions 0–4: <tool> peaks at 0 (0.90); turn 2 is 7–11: first 0.90 at 7
    assert model[0]["control_summary"] == [("<tool>", "0.90", 0)]
    assert model[1]["control_summary"] == [("<tool>", "0.90", 7)]
    assert [v["state"]["state"] for v in model] == ["healthy_call"] * 4 + ["no_call"]
    # an answer turn without a call is how a tool-calling rollout ends: grey, not a warning
    assert model[4]["state"]["tone"] == "none"


def test_control_summary_takes_the_first_of_equal_maxima_and_stays_in_range() -> None:
    control: dict[str, list[float | None]] = {"a": [0.5, 0.7, 0.7, 0.99], "b": [0.1]}
    assert turns.control_summary(control, 0, 3) == [("a", "0.70", 1), ("b", "0.10", 0)]
    assert turns.control_summary(control, 2, 10) == [("a", "0.99", 3)]
    assert turns.control_summary(control, 4, 8) == []


def test_the_format_badge_is_the_state_coloured_by_meaning_and_says_why_not_valid() -> None:
    group = make_multiturn_group()
    # ran out of calls: every call well-formed (healthy, green), not valid for lack of an answer
    out = badges.format_badge(False, "healthy_call", group[1].meta, max_calls=4)
    assert (out["state"], out["tone"], out["valid"]) == ("healthy_call", "ok", False)
    assert out["problem"]["label"] == "ran out of calls"
    assert "4 tool results" in out["problem"]["title"]
    # without the run's limit, or under it, only that it ended on a call
    assert badges.format_badge(False, "healthy_call", group[1].meta)["problem"]["label"] == (
        "no final answer"
    )
    assert badges.format_badge(False, "healthy_call", group[1].meta, 8)["problem"]["label"] == (
        "no final answer"
    )
    # a right rollout: nothing more to say
    right = badges.format_badge(True, "healthy_call", group[0].meta, 4)
    assert right["problem"] is None and right["tone"] == "ok"
    # single-turn: the state's own tone; a broken state explains itself
    assert badges.format_badge(False, "collapse", {})["tone"] == "bad"
    assert badges.format_badge(False, "collapse", {})["problem"] is None
    assert badges.format_badge(False, "text_pollution", {})["tone"] == "warn"
    odd = badges.format_badge(False, "healthy_call", {})
    assert odd["problem"]["label"] == "not format-valid"
    # no state recorded: valid / invalid; an importer's unchecked and an unknown state are grey
    assert badges.format_badge(True, None, None)["state"] == "valid"
    assert badges.format_badge(False, None, None)["tone"] == "bad"
    assert badges.format_badge(True, "unchecked", None)["tone"] == "none"
    assert badges.format_badge(True, "<b>new</b>", None)["tone"] == "none"


def test_a_hint_is_labelled_once_and_says_who_saw_it() -> None:
    assert group_header.hint_body("Hint: the query needs X.") == "the query needs X."
    assert group_header.hint_body("  HINT :no space") == "no space"
    assert group_header.hint_body("Hint:") == "Hint:"  # nothing after it: left as it is
    assert group_header.hint_body("Use the hint: X") == "Use the hint: X"
    assert group_header.hint_body(None) == ""
    # the dataset's hint: in meta (launched runs) or in the row the callback kept
    header = _header(_dicts(legacy=False))
    assert header["hint"] == "the ticket tool names the tool needed next."
    assert header["hint_shown_to"] == []
    members = _dicts(legacy=False)
    members[3]["meta"] = {"supervised": "hint", "hint_shown": "Hint: shown one."}
    members[0]["meta"] = {"hint": "Hint: in meta."} | {"turns": []}
    header = _header(members)
    assert header["hint"] == "in meta." and header["hint_shown_to"] == [3]


def test_the_call_limit_is_the_runs_max_calls_or_trls_iterations() -> None:
    assert badges.call_limit({"max_calls": 4, "max_tool_calling_iterations": 9}) == 4
    assert badges.call_limit({"max_tool_calling_iterations": 9}) == 9  # a recorded GRPOConfig
    assert badges.call_limit({"max_tool_calling_iterations": None}) is None
    assert badges.call_limit({"max_calls": True}) is None
    assert badges.call_limit(None) is None
