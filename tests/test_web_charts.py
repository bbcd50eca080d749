"""Pure builders of the dashboard (no server, no database): series, buckets, summaries, views."""

from __future__ import annotations

import math

import pytest

from server import charts, figures, viewer
from server.app import fmt_num, token_text, visible_text


@pytest.mark.parametrize(
    ("steps", "max_points", "width"),
    [
        (100, 600, 1),
        (600, 600, 1),
        (601, 600, 2),
        (10_000, 600, 20),
        (10_000, None, 1),
        (120, 20, 10),
        (5_000_000, 600, 10_000),
    ],
)
def test_bucket_width_is_the_smallest_1_2_5_width_that_fits(
    steps: int, max_points: int | None, width: int
) -> None:
    assert charts.bucket_width(steps, max_points) == width
    if max_points:
        assert math.ceil(steps / width) + 1 <= max_points or width == 1


def test_series_shaping_drops_empty_series() -> None:
    rows = [(1, 0.5, None), (2, 0.7, None)]
    assert charts.raw_series(["a", "b"], rows) == {"a": {"x": [1, 2], "y": [0.5, 0.7]}}
    bucketed = charts.bucketed_series(["a", "b"], [(1, 0.5, 0.1, 0.9, None, None, None)])
    assert bucketed == {"a": {"x": [1], "y": [0.5], "lo": [0.1], "hi": [0.9]}}


def test_bucket_table_names_step_ranges() -> None:
    table = charts.bucket_table([(0, 25, 1.0, 0.9, 1.0), (1, 3, 0.0, 0.5, None)])
    assert table["start"] == [1, 26] and table["end"] == [25, 50] and table["n"] == [25, 3]
    assert table["true_accuracy"] == [1.0, 0.0]


def test_run_summary_uses_the_shared_definitions() -> None:
    steps = list(range(1, 101))
    accuracy = [0.0] * 30 + [1.0] * 70
    run = {"id": 1, "name": "r", "current_step": 100, "device_minutes": 2.0, "cost": 0.1}
    summary = charts.run_summary(run, steps, accuracy, [0.5] * 100)
    assert summary["converged_at"] == 53  # trailing 25-step mean first ≥ 0.9 at step 53
    assert summary["stability"] == 0.0  # every bucket from step 53's on is 1.0
    wobbly = charts.run_summary(run, steps, accuracy[:75] + [0.6] * 25, [0.5] * 100)
    assert wobbly["stability"] == pytest.approx(0.4)
    assert summary["final_accuracy"] == 1.0 and summary["final_reward"] == 0.5
    never = charts.run_summary(run, steps, [0.5] * 100, [0.5] * 100)
    assert never["converged_at"] is None and never["stability"] is None


def test_config_diff_shows_only_what_differs() -> None:
    runs = [
        {
            "id": 1,
            "model": "tiny",
            "variant": "leaky",
            "k": None,
            "seed": 4,
            "config": {"lr": 3e-4, "opt": {"beta": 0.9}},
        },
        {
            "id": 2,
            "model": "tiny",
            "variant": "patched",
            "k": 4,
            "seed": 4,
            "config": {"lr": 3e-4, "opt": {"beta": 0.8}, "extra": True},
        },
    ]
    diff = charts.config_diff(runs)
    rows = {r["key"]: r for r in diff["rows"]}
    assert set(rows) == {"variant", "k", "opt.beta", "extra"}
    assert rows["extra"]["values"] == ["—", "true"] and rows["extra"]["differs"] == [False, True]
    assert rows["k"]["values"] == ["null", "4"]
    assert diff["same"] == 6  # model, seed, lr, and three columns both lack
    assert charts.config_rows({"a": {"b": 1}, "c": "x"}) == [("a.b", "1"), ("c", '"x"')]


def _rollout(completion: str, ids: list[int], probs: list[float], **extra):  # type: ignore[no-untyped-def]
    control = {
        "<tool>": [0.0] * len(ids),
        "</tool>": [0.0] * len(ids),
        "</assistant>": [0.0] * len(ids),
    }
    control.update(extra.pop("control", {}))
    return {
        "completion": completion,
        "completion_ids": ids,
        "token_logprobs": [math.log(p) for p in probs],
        "control_token_probs": control,
        "meta": extra.pop("meta", {}),
        "prompt": "p",
    } | extra


def test_token_texts_prefer_recorded_tokens_then_the_text_then_ids() -> None:
    recorded = _rollout(
        "<tool>tool_07</tool>",
        [5, 107, 6, 2],
        [0.9] * 4,
        meta={"tokens": ["<tool>", "tool_07", "</tool>", "</assistant>"]},
    )
    assert viewer.token_texts(recorded) == (["<tool>", "tool_07", "</tool>", "</assistant>"], True)
    split = _rollout("<tool>tool_07</tool>", [5, 107, 6], [0.9] * 3)
    assert viewer.token_texts(split) == (["<tool>", "tool_07", "</tool>"], True)
    # The end-of-turn token is not in decoded text; its probability names it.
    eot = _rollout(
        "<tool>tool_07</tool>",
        [5, 107, 6, 2],
        [0.9, 0.8, 0.95, 0.7],
        control={"</assistant>": [0, 0, 0, 0.7]},
    )
    assert viewer.token_texts(eot) == (["<tool>", "tool_07", "</tool>", "</assistant>"], True)
    unknown = _rollout("something else entirely", [11, 12], [0.5, 0.5])
    assert viewer.token_texts(unknown) == (["⟨11⟩", "⟨12⟩"], False)


def test_group_view_votes_and_near_misses() -> None:
    rollouts = []
    for i, vote in enumerate(["tool_07", "tool_07", None, "tool_03"]):
        r = _rollout(
            "<tool>x</tool>", [5, 9, 6], [0.9, 0.5, 0.9], control={"</assistant>": [0.0, 0.45, 0.0]}
        )
        rollouts.append(
            r
            | {
                "group": 0,
                "index": i,
                "vote": vote,
                "target": "tool_07",
                "true_score": float(vote == "tool_07"),
            }
        )
    (group,) = viewer.group_views(rollouts)
    assert [(v["vote"], v["count"], v["rollouts"]) for v in group["votes"]] == [
        ("tool_07", 2, [0, 1]),
        ("tool_03", 1, [3]),
        (None, 1, [2]),
    ]
    assert group["votes"][0]["is_target"] and group["agree"] == 2 and group["correct"] == 2
    rollout = group["rollouts"][0]
    assert rollout["near_misses"] == [
        [],
        ["</assistant>"],
        [],
    ]  # 0.45 end-of-turn where an id was sampled
    cells = viewer.token_cells(rollout)
    assert cells[1]["cls"] == "tok p5 near-miss" and "near miss: </assistant>" in cells[1]["title"]
    rows = viewer.control_rows(rollout)
    assert rows[0][0] == "sampled" and rows[3] == (
        "</assistant>",
        [("c0", "0.00"), ("c4", "0.45"), ("c0", "0.00")],
    )
    assert [viewer.probability_bin(p) for p in (None, 0.0, 0.05, 0.5, 0.99, 1.0)] == [
        0,
        0,
        0,
        5,
        9,
        9,
    ]
    assert (viewer.prob_text(0.001), viewer.prob_text(None), viewer.prob_text(0.5, 3)) == (
        "<0.01",
        "—",
        "0.500",
    )


def test_text_filters_escape_and_show_control_characters() -> None:
    shown = visible_text("<b>\x07")
    assert str(shown) == '&lt;b&gt;<span class="cc" title="control character U+0007">␇</span>'
    assert str(token_text(" a\n")) == '<span class="sp">·</span>a↵'
    assert str(token_text("")) == '<span class="cc">∅</span>'
    assert (fmt_num(None), fmt_num(0.5), fmt_num(3), fmt_num(0.00001)) == (
        "—",
        "0.500",
        "3",
        "1.00e-05",
    )


def test_run_figures_cover_the_recorded_series() -> None:
    names = [
        "reward_mean",
        "true_accuracy",
        "loss",
        "ctrl/<tool>/max",
        "ctrl/<tool>/mean",
        "probe/eot_after_open/mean",
        "probe/eot_after_open/p90",
        "state/healthy_call",
        "state/collapse",
        "trl/reward",
        "retrieval_recall",
    ]
    figs = figures.run_figures(["<tool>"], names)
    assert [f["id"] for f in figs["main"]] == ["reward", "buckets", "votes", "format", "control"]
    assert [f["id"] for f in figs["structure"]] == ["probes", "states"]
    assert [f["id"] for f in figs["optimization"]] == ["s-loss"]
    assert [(g["title"], [f["title"] for f in g["figures"]]) for g in figs["other"]] == [
        ("other", ["retrieval_recall"]),
        ("probe", ["probe/eot_after_open/p90"]),
        ("trl", ["trl/reward"]),
    ]
    control = figs["main"][-1]
    assert control["wide"] and control["alerts"] == ["control_token_spike"]
    names_shown = [t["name"] for t in control["data"] if "name" in t]
    assert names_shown == ["&lt;tool&gt; max", "&lt;tool&gt; mean"]  # Plotly reads tags in labels
    parts = [t["meta"]["part"] for t in figs["main"][0]["data"]]
    assert parts == ["lo", "hi", "y", "lo", "hi", "y"]
    assert figs["main"][0]["data"][1]["fill"] == "tonexty"


def test_compare_figures_overlay_runs() -> None:
    runs = [
        {"id": 1, "name": "a", "control_tokens": ["<tool>"]},
        {"id": 2, "name": "b", "control_tokens": ["<tool>"]},
    ]
    data = {"x": [1, 2], "y": [0.1, 0.2]}
    series = {
        "1": {"series": {"true_accuracy": data, "ctrl/<tool>/mean": data}},
        "2": {"series": {"true_accuracy": data}},
    }
    figs = figures.compare_figures(runs, series, ["true_accuracy", "vote_agreement"])
    assert [f["title"] for f in figs["main"]] == ["True accuracy"]
    assert {t["meta"]["run"] for t in figs["main"][0]["data"]} == {1, 2}
    assert [t["y"] for t in figs["main"][0]["data"] if t["meta"]["part"] == "lo"] == [
        [0.1, 0.2],
        [0.1, 0.2],
    ]
    assert [f["title"] for f in figs["control"]] == ["<tool>"]
