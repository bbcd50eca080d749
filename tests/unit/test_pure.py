"""Pure functions: vote statistics, structural states, series summaries, array packing."""

from __future__ import annotations

import math

import pytest
from rollout_lens.server.core import analysis
from rollout_lens.server.store import layout
from rollout_lens.server.store.packing import pack_doubles, unpack_doubles
from rollout_lens.trainer.recorder import metrics
from rollout_lens.trainer.recorder.structure import FormatState, classify

LISTED = ["tool_07", "tool_27"]


@pytest.mark.parametrize(
    ("votes", "agreement", "entropy"),
    [
        (["a"] * 8, 1.0, 0.0),
        (["a"] * 4 + ["b"] * 4, 0.5, 1.0),
        (["a", "b", "c", "d", "e", "f", "g", "h"], 1 / 8, 3.0),
        ([None] * 8, 0.0, 0.0),
        (
            ["a", "a", "a", None, None, None, None, None],
            3 / 8,
            -(3 / 8 * math.log2(3 / 8) + 5 / 8 * math.log2(5 / 8)),
        ),
    ],
)
def test_vote_statistics(votes: list[str | None], agreement: float, entropy: float) -> None:
    assert metrics.vote_agreement(votes) == pytest.approx(agreement)
    assert metrics.vote_entropy(votes) == pytest.approx(entropy)


def test_zero_std_and_groups() -> None:
    assert metrics.is_zero_std([1.0] * 8) and not metrics.is_zero_std([1.0, 0.0])
    assert metrics.groups(list(range(16)), 8) == [list(range(8)), list(range(8, 16))]
    with pytest.raises(ValueError, match="groups of 8"):
        metrics.groups(list(range(10)), 8)


@pytest.mark.parametrize(
    ("completion", "state"),
    [
        ("<tool>tool_07</tool>", FormatState.healthy_call),
        ("  <tool> tool_27 </tool>\n", FormatState.healthy_call),
        ("<tool>tool_07</tool> because", FormatState.text_pollution),
        ("sure <tool>tool_07</tool>", FormatState.text_pollution),
        ("<tool>tool_99</tool>", FormatState.text_pollution),  # an id the prompt did not list
        ("<tool>tool_07</tool><tool>tool_27</tool>", FormatState.text_pollution),
        # a complete call, then text the length limit cut: a polluted call, not a collapse
        ("<tool>tool_07</tool>tool_07 tool_27 tool", FormatState.text_pollution),
        ("tool_07</tool>", FormatState.text_pollution),  # only a closing tag
        ("</tool>", FormatState.text_pollution),
        ("", FormatState.collapse),
        ("  \n", FormatState.collapse),
        ("<tool>", FormatState.collapse),
        ("<tool>tool_07", FormatState.collapse),  # cut inside the call
        ("<tool><tool><tool><tool>", FormatState.collapse),  # opening tags until the cut
        ("<tool>tool_07<tool>tool_07</tool>", FormatState.text_pollution),  # reopened, closed
        ("</tool>tool_07<tool>", FormatState.collapse),
        ("tool_07", FormatState.no_call),
        ("I would use the calculator", FormatState.no_call),
    ],
)
def test_structural_state(completion: str, state: FormatState) -> None:
    """The table of states (docs/recording/trl.md), on the Escalation reply format."""
    assert classify(completion, LISTED) is state


@pytest.mark.parametrize(
    ("text", "state"),
    [
        ("<call>f</call><|im_end|>", "healthy_call"),
        ("<call>f</call>\n<call>g</call><|im_end|>", "healthy_call"),  # every closed call counts
        ("<call>f</call> and then some text the limit c", "text_pollution"),
        ("</call><|im_end|>", "text_pollution"),  # only a closing tag
        ("<call><call><call><call>", "collapse"),  # opening tags repeated until the cut
        ("<call><|im_end|>", "collapse"),  # end-of-turn inside an open call
        ("<call>f<|im_end|>", "collapse"),
        ("<call>f", "collapse"),  # cut inside the call
        ("", "collapse"),
        ("<|im_end|>", "collapse"),
        ("no tool needed<|im_end|>", "no_call"),
        ("no tool needed and the limit c", "no_call"),
    ],
)
def test_a_completions_state_follows_the_table_with_any_tags(text: str, state: str) -> None:
    """A user's single-turn completion, with tags of the user's choosing and end-of-turn."""
    from rollout_lens.trainer.recorder.turns import completion_state

    assert completion_state(text, ("<call>", "</call>"), ["<|im_end|>"]) == state


def test_buckets_and_convergence() -> None:
    steps = list(range(1, 101))
    acc = [0.0] * 30 + [1.0] * 70
    assert analysis.buckets(steps, acc) == [(1, 0.0), (26, 0.8), (51, 1.0), (76, 1.0)]
    # converged: the end of the first closed bucket whose mean reaches 0.9 (26-50 holds 0.8)
    ends, means = analysis.bucket_ends(steps, acc)
    assert ends == [25, 50, 75, 100]
    assert analysis.converged_at(ends, means, 100) == 75
    assert analysis.converged_at(ends, means, 74) is None  # the bucket 51-75 is still open
    assert analysis.converged_at(*analysis.bucket_ends(steps, [0.5] * 100), 100) is None
    assert analysis.bucket_spread(ends, means, 75) == 0.0
    assert analysis.bucket_spread(ends, [1.0, 1.0, 0.0, 0.0], 25) == pytest.approx(1.0)
    assert analysis.bucket_spread(ends, means, None) is None
    assert analysis.final_mean([None, 1.0, 0.0]) == 0.5
    assert analysis.rolling_mean([None, 1.0, 0.0], window=2) == [None, 1.0, 0.5]


def test_packing_round_trips() -> None:
    values = [0.5, -1.25, math.inf, 1e-300]
    assert unpack_doubles(pack_doubles(values)) == values
    assert unpack_doubles(None) == [] and unpack_doubles(b"") == []
    assert len(pack_doubles([0.1] * 10)) == 80  # 8 bytes a value, not JSON text
    # a NaN's payload survives: layout tells "not logged" from "logged as None" by it
    packed = pack_doubles([layout.LOGGED_NONE, math.nan])
    assert pack_doubles(unpack_doubles(packed)) == packed


@pytest.mark.parametrize(
    ("state", "completion", "reason"),
    [
        ("text_pollution", "<tool>tool_33</tool>", "names tool_33, which the prompt does not list"),
        (
            "text_pollution",
            "<tool>tool_33</tool></assistant>",
            "names tool_33, which the prompt does not list",
        ),
        ("text_pollution", "sure! <tool>tool_01</tool>", "stray text around the call"),
        (
            "text_pollution",
            "<tool_call>get</tool_call>",
            "names get, which the prompt does not list",
        ),
        ("no_call", "the answer is 4", "no call at all (an answer, or text)"),
        ("collapse", "<tool>", "the call structure broke: empty, unbalanced tags, cut off"),
        ("healthy_call", "<tool>tool_01</tool>", ""),
    ],
)
def test_a_bad_state_says_why_beside_its_badge(state: str, completion: str, reason: str) -> None:
    """The words beside a state badge; a clean call that text_pollution marks is a tool the
    prompt did not list (trainer.recorder.structure.classify's rule, checked below)."""
    from rollout_lens.server.webapp.pages.state_reason import state_reason

    assert state_reason(state, completion, ("<tool>", "</tool>", "</assistant>")) == reason
    if state == "text_pollution" and completion.startswith("<tool>tool_33"):
        assert (
            classify(completion.removesuffix("</assistant>"), ["tool_01"])
            == FormatState.text_pollution
        )


def test_the_seeds_results_appear_only_as_the_seeds() -> None:
    """The built-in texts state what this product's tiny model does; the seed's results (leaky
    oscillates, patched converges in ~25 steps on Qwen2.5-1.5B) only attributed to the seed."""
    import re
    from pathlib import Path

    from rollout_lens.server.core.presets import PRESETS
    from rollout_lens.server.webapp.pages import plotly_figures

    from rollout_lens.cli.demo import HOW_TO_READ

    root = Path(__file__).resolve().parents[2]
    # The demo as the README tells it (its section, up to the next) and in full (docs/demo.md).
    readme = (root / "README.md").read_text()
    start = readme.index("## The demo")
    demo_section = readme[start : readme.index("\n## ", start + 1)]
    demo_page = (root / "docs" / "demo.md").read_text()
    figures = plotly_figures.run_figures(["<tool>", "</tool>"], ["reward_mean", "true_accuracy"])
    texts = [p.description for p in PRESETS.values()] + [HOW_TO_READ, demo_section, demo_page]
    texts += [
        f["help"]
        for group in figures.values()
        if isinstance(group, list)
        for f in group
        if isinstance(f, dict) and "help" in f
    ]
    texts.append((root / "web" / "templates" / "compare.html").read_text())
    claim = re.compile(r"oscillat|leaky run\S* swing|converges in (about|~) ?25", re.IGNORECASE)
    for text in texts:
        for sentence in re.split(r"(?<=[.;])\s+", text):
            if claim.search(sentence):
                assert "seed" in sentence, sentence
