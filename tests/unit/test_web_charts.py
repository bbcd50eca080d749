"""Pure builders of the dashboard (no server, no database): series, buckets, summaries, views."""

from __future__ import annotations

import math
from typing import Any

import pytest
from rollout_lens.server.core.display import fmt_num
from rollout_lens.server.core.step_views import RolloutView
from rollout_lens.server.webapp.http.templating import token_text, visible_text
from rollout_lens.server.webapp.pages import cells as token_view
from rollout_lens.server.webapp.pages import plotly_figures, viewer
from rollout_lens.server.webapp.queries import chart_data


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
    assert chart_data.bucket_width(steps, max_points) == width
    if max_points:
        assert math.ceil(steps / width) + 1 <= max_points or width == 1


def test_series_shaping_drops_empty_series() -> None:
    rows = [(1, 0.5, None), (2, 0.7, None)]
    assert chart_data.raw_series(["a", "b"], rows) == {"a": {"x": [1, 2], "y": [0.5, 0.7]}}
    bucketed = chart_data.bucketed_series(["a", "b"], [(1, 0.5, 0.1, 0.9, None, None, None)])
    assert bucketed == {"a": {"x": [1], "y": [0.5], "lo": [0.1], "hi": [0.9]}}


def test_bucket_table_names_step_ranges() -> None:
    table = chart_data.bucket_table([(0, 25, 1.0, 0.9, 1.0), (1, 3, 0.0, 0.5, None)])
    assert table["start"] == [1, 26] and table["end"] == [25, 50] and table["n"] == [25, 3]
    assert table["true_accuracy"] == [1.0, 0.0]


def _buckets(accuracy: list[float]) -> dict[str, list]:
    """bucket_table of per-step accuracies from step 1 (as queries.bucket_means reads them)."""
    rows = [
        (i // 25, len(accuracy[i : i + 25]), sum(accuracy[i : i + 25]) / len(accuracy[i : i + 25]))
        for i in range(0, len(accuracy), 25)
    ]
    return chart_data.bucket_table([(i, n, acc, 0.5, 1.0) for i, n, acc in rows])


def test_run_summary_reads_buckets_and_the_summary_columns() -> None:
    accuracy = [0.0] * 30 + [1.0] * 70
    run = {
        "id": 1,
        "name": "r",
        "current_step": 100,
        "device_minutes": 2.0,
        "cost": 0.1,
        "recent_true_accuracy": 1.0,
        "recent_reward": 0.5,
    }
    summary = chart_data.run_summary(run, _buckets(accuracy))
    assert summary["converged_at"] == 75  # steps 51–75: the first bucket with a mean ≥ 0.9
    assert summary["stability"] == 0.0  # every bucket from there on is 1.0
    wobbly = chart_data.run_summary(run, _buckets(accuracy[:75] + [0.6] * 25))
    assert wobbly["stability"] == pytest.approx(0.4)
    assert summary["final_accuracy"] == 1.0 and summary["final_reward"] == 0.5
    never = chart_data.run_summary(run, _buckets([0.5] * 100))
    assert never["converged_at"] is None and never["stability"] is None
    # A bucket still filling cannot converge yet: steps 51–60 of a run at step 60.
    live = chart_data.run_summary(run | {"current_step": 60}, _buckets([0.0] * 50 + [1.0] * 10))
    assert live["converged_at"] is None


def test_chart_series_round_to_what_a_chart_shows_and_drop_bands_on_request() -> None:
    entry = {
        "x": [1, 11],
        "y": [0.123456789, 0.000123456],
        "lo": [0.1, 0.0],
        "hi": [0.987654321, 0.5],
    }
    shown = chart_data.chart_series({"a": entry}, bands=True)["a"]
    assert shown == {"x": [1, 11], "y": [0.1235, 0.0001], "lo": [0.1, 0.0], "hi": [0.9877, 0.5]}
    assert chart_data.chart_series({"a": entry}, bands=False) == {
        "a": {"x": [1, 11], "y": [0.1235, 0.0001]}
    }
    small = chart_data.chart_series({"p": {"x": [1, 2], "y": [0.00123456, None]}}, bands=True)
    assert small == {"p": {"x": [1, 2], "y": [0.001235, None]}}  # digits of its own scale
    big = chart_data.chart_series({"n": {"x": [1], "y": [123456.7]}}, bands=False)
    assert big["n"]["y"] == [123500.0]


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
    diff = chart_data.config_diff(runs)
    rows = {r["key"]: r for r in diff["rows"]}
    assert set(rows) == {"variant", "k", "opt.beta", "extra"}
    assert rows["extra"]["values"] == ["—", "true"] and rows["extra"]["differs"] == [False, True]
    assert rows["k"]["values"] == ["null", "4"]
    assert diff["same"] == 6  # model, seed, lr, and three columns both lack
    assert chart_data.config_rows({"a": {"b": 1}, "c": "x"}) == [("a.b", "1"), ("c", '"x"')]


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


def _texts(rollout: dict[str, Any]) -> tuple[list[str], bool]:
    cells, exact = token_view.token_spans(RolloutView.from_data(rollout))
    assert [(c.first, c.last) for c in cells] == [(i, i) for i in range(len(cells))]
    return [c.text for c in cells], exact


def test_token_spans_prefer_recorded_tokens_then_the_text_then_ids() -> None:
    recorded = _rollout(
        "<tool>tool_07</tool>",
        [5, 107, 6, 2],
        [0.9] * 4,
        tokens=["<tool>", "tool_07", "</tool>", "</assistant>"],
    )
    assert _texts(recorded) == (["<tool>", "tool_07", "</tool>", "</assistant>"], True)
    split = _rollout("<tool>tool_07</tool>", [5, 107, 6], [0.9] * 3)
    assert _texts(split) == (["<tool>", "tool_07", "</tool>"], True)
    # The end-of-turn token is not in decoded text; its probability names it.
    eot = _rollout(
        "<tool>tool_07</tool>",
        [5, 107, 6, 2],
        [0.9, 0.8, 0.95, 0.7],
        control={"</assistant>": [0, 0, 0, 0.7]},
    )
    assert _texts(eot) == (["<tool>", "tool_07", "</tool>", "</assistant>"], True)
    unknown = _rollout("something else entirely", [11, 12], [0.5, 0.5])
    assert _texts(unknown) == (["⟨11⟩", "⟨12⟩"], False)


def test_a_character_split_over_tokens_is_one_cell_with_their_ids_and_product() -> None:
    """Byte-level pieces ' 🎉' over three tokens (SmolLM2's) and 'ok': two cells; the emoji's
    cell has the three ids, the product of their probabilities, and the control-token
    probability at its first token; the table has a column a cell."""
    pieces = ["ĠðŁ", "İ", "ī", "Ġok"]
    rollout = _rollout(
        " 🎉 ok",
        [11100, 224, 10391, 3],
        [0.5, 0.8, 0.9, 0.7],
        control={"</assistant>": [0.1, 0.2, 0.25, 0.05]},
        tokens=[" ", "", "🎉", " ok"],
        token_pieces=pieces,
    ) | {"group": 0, "index": 0, "vote": None, "target": None, "true_score": None}
    (group,) = viewer.group_views([RolloutView.from_data(rollout)])
    view = group["rollouts"][0]
    cells = view.cells  # token_view.token_cells, within the page's budget
    assert [(c["text"], c["first"], c["last"]) for c in cells] == [(" 🎉", 0, 2), (" ok", 3, 3)]
    assert cells[0]["title"].startswith("#0–2 · ids 11100, 224, 10391 · p=0.360")
    assert "p(</assistant>)=0.100" in cells[0]["title"] and cells[0]["cls"] == "tok p3"
    rows = view.control_rows
    assert rows[0] == ("sampled", [("p3", "0.36"), ("p7", "0.70")])
    assert rows[3] == ("</assistant>", [("c1", "0.10"), ("c0", "0.05")])


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
    (group,) = viewer.group_views([RolloutView.from_data(r) for r in rollouts])
    assert [(v["vote"], v["count"], v["rollouts"]) for v in group["votes"]] == [
        ("tool_07", 2, [0, 1]),
        ("tool_03", 1, [3]),
        (None, 1, [2]),
    ]
    assert group["votes"][0]["is_target"] and group["agree"] == 2 and group["correct"] == 2
    rollout = group["rollouts"][0]
    assert rollout.near_misses == [
        [],
        ["</assistant>"],
        [],
    ]  # 0.45 end-of-turn where an id was sampled
    cells = rollout.cells
    assert cells[1]["cls"] == "tok p5 near-miss" and "near miss: </assistant>" in cells[1]["title"]
    rows = rollout.control_rows
    assert rows[0][0] == "sampled" and rows[3] == (
        "</assistant>",
        [("c0", "0.00"), ("c4", "0.45"), ("c0", "0.00")],
    )
    assert [token_view.probability_bin(p) for p in (None, 0.0, 0.05, 0.5, 0.99, 1.0)] == [
        0,
        0,
        0,
        5,
        9,
        9,
    ]
    assert (
        token_view.prob_text(0.001),
        token_view.prob_text(None),
        token_view.prob_text(0.5, 3),
    ) == (
        "<0.01",
        "—",
        "0.500",
    )


def test_text_filters_escape_and_show_control_characters() -> None:
    shown = visible_text("<b>\x07")
    assert str(shown) == '&lt;b&gt;<span class="cc" title="control character U+0007">␇</span>'
    assert str(token_text(" a\n")) == '<span class="sp">·</span>a↵'
    assert str(token_text("")) == '<span class="cc">∅</span>'
    zwj = '<span class="cc" title="invisible character U+200D">U+200D</span>'
    assert str(token_text("\u200d")) == zwj
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
    figs = plotly_figures.run_figures(["<tool>"], names)
    assert [f["id"] for f in figs["main"]] == ["reward", "buckets", "votes", "format", "control"]
    assert [f["id"] for f in figs["structure"]] == ["probes", "states"]
    assert [f["id"] for f in figs["optimization"]] == ["s-loss"]
    assert [(g["title"], [f["title"] for f in g["figures"]]) for g in figs["other"]] == [
        ("other", ["retrieval_recall"]),
        ("trl", ["trl/reward"]),
    ]
    # Every statistic of a probe goes to its own detail chart, not to "other".
    assert [f["id"] for f in figs["probes"]] == ["probe-eot_after_open"]
    assert figs["evaluation"] == []
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
    figs = plotly_figures.compare_figures(runs, series, ["true_accuracy", "vote_agreement"])
    assert [f["title"] for f in figs["main"]] == ["True accuracy"]
    traces = figs["main"][0]["data"]
    assert [(t["meta"]["run"], t["meta"]["part"]) for t in traces] == [
        (run, part) for run in (1, 2) for part in ("lo", "hi", "y")
    ]
    assert all(t["x"] == [] and t["y"] == [] for t in traces)  # the page's script fills them
    assert [f["title"] for f in figs["control"]] == ["<tool>"]
    lines = plotly_figures.compare_figures(runs, series, ["true_accuracy"], bands=False)
    assert [t["meta"]["part"] for t in lines["main"][0]["data"]] == ["y", "y"]


def test_probe_details_group_each_probe_with_its_statistics_and_splits() -> None:
    names = {
        f"probe/eot_after_open/{part}"
        for part in ("mean", "p90", "max", "reward1/mean", "reward0/mean", "supervised/mean")
    } | {"probe/target_logprob/mean", "probe/target_logprob/p90"}
    figs = plotly_figures.probe_details(names)
    assert [f["id"] for f in figs] == ["probe-eot_after_open", "probe-target_logprob"]
    eot = figs[0]
    lines = [t for t in eot["data"] if t["meta"]["part"] == "y"]
    assert [t["name"] for t in lines] == [
        "mean",
        "p90",
        "max",
        "mean, reward 1",
        "mean, reward 0",
        "mean, supervised",
    ]
    assert [t["line"]["dash"] for t in lines[:3]] == ["solid", "dash", "dot"]
    assert eot["alerts"] == ["control_token_spike"] and eot["layout"]["showlegend"] is False
    assert eot["title"] == "End-of-turn after the opening tag"
    assert "autorangeoptions" not in figs[1]["layout"]["yaxis"]  # log-probabilities: not 0–1


def test_evaluation_and_sft_charts_and_the_series_a_config_promises() -> None:
    assert chart_data.expected_series(None) == []
    assert chart_data.expected_series({"eval_every": 0, "supervision": "none"}) == []
    assert chart_data.expected_series({"eval_every": 25, "supervision": "interleaved_sft"}) == [
        "eval/id",
        "eval/format_ood",
        "eval/content_ood",
        "sft/loss",
    ]
    figs = plotly_figures.evaluation({"eval/id", "eval/content_ood", "sft/loss"})
    assert [f["id"] for f in figs] == ["eval", "sft"]
    shown = [(t["name"], t["mode"]) for t in figs[0]["data"] if t["meta"]["part"] == "y"]
    assert shown == [("in-distribution", "lines+markers"), ("content-OOD", "lines+markers")]
    run = plotly_figures.run_figures([], ["reward_mean", "eval/id", "sft/loss", "sft/examples"])
    assert [f["id"] for f in run["evaluation"]] == ["eval", "sft"]
    assert [g["title"] for g in run["other"]] == ["sft"]  # sft/examples: not charted elsewhere


def test_compare_figures_add_evaluation_and_collapse_overlays() -> None:
    runs = [{"id": i, "name": f"r{i}", "control_tokens": []} for i in (1, 2)]
    data = {"x": [25, 50], "y": [0.5, 0.75]}
    series = {
        "1": {"series": {"eval/id": data, "state/collapse": data}},
        "2": {"series": {"eval/id": data}},
    }
    figs = plotly_figures.compare_figures(runs, series, ["true_accuracy"])
    assert [f["title"] for f in figs["evaluation"]] == ["Evaluation: in-distribution"]
    assert [f["title"] for f in figs["collapse"]] == ["Share of collapsed completions"]
    modes = {t["mode"] for t in figs["evaluation"][0]["data"] if t["meta"]["part"] == "y"}
    assert modes == {"lines+markers"}


@pytest.mark.parametrize(
    ("live", "text"),
    [
        ({"status": "queued", "queue_position": 1}, "Queued, 1st in line: waiting for a worker"),
        (
            {"status": "queued", "queue_position": 3},
            "Queued, 3rd in line (2 ahead): waiting for a worker",
        ),
        (
            {"status": "queued", "queue_position": 12},
            "Queued, 12th in line (11 ahead): waiting for a worker",
        ),
        ({"status": "running", "current_step": 4}, "Step 4 of 100 · measuring speed…"),
        ({"status": "running"}, "Step 0 of 100 · the first step is under way…"),
        (
            {
                "status": "running",
                "phase": "building the multi-turn model: warm-up step 300 of 800 (about 3 min)",
            },
            "Building the multi-turn model: warm-up step 300 of 800 (about 3 min)",
        ),
        (
            {"status": "running", "current_step": 40, "steps_per_second": 2.0, "eta_seconds": 30},
            "Step 40 of 100 · 2.00 steps/s · ETA 30 s",
        ),
        (
            {
                "status": "running",
                "current_step": 1,
                "steps_per_second": 0.01,
                "eta_seconds": 9900,
                "cancel_requested": True,
            },
            "Step 1 of 100 · 0.01 steps/s · ETA 2 h 45 min · stopping (cancel requested)",
        ),
        (  # the demo's or `train`'s own process took it: starting, not waiting for a worker
            {"status": "queued", "queue_position": 1, "phase": "starting: loading torch and TRL"},
            "Starting: loading torch and TRL",
        ),
        ({"status": "completed", "current_step": 100}, "Completed all 100 steps"),
        (
            {"status": "cancelled", "current_step": 7, "checkpoint_step": 5},
            "Cancelled at step 7 of 100 · last checkpoint at step 5",
        ),
        ({"status": "failed", "current_step": 0}, "Failed at step 0 of 100"),
    ],
)
def test_live_summary_says_where_a_run_stands(live: dict, text: str) -> None:
    assert chart_data.live_summary({"current_step": 0, "total_steps": 100} | live) == text


def test_steps_per_second_from_recent_steps() -> None:
    from datetime import datetime, timedelta

    t0 = datetime(2025, 1, 1, 12, 0, 0)
    recent = [(30, t0 + timedelta(seconds=10)), (25, t0 + timedelta(seconds=5)), (20, t0)]
    assert chart_data.steps_per_second(recent) == pytest.approx(1.0)
    assert chart_data.steps_per_second(recent[:1]) is None
    assert chart_data.steps_per_second([(2, t0), (1, t0)]) is None  # no measurable time yet
    assert (
        chart_data.duration_text(3725) == "1 h 02 min"
        and chart_data.duration_text(61) == "1 min 01 s"
    )


def test_buckets_are_drawn_over_the_steps_they_hold() -> None:
    # A 30-step run: steps 1–25 closed, 26–30 still filling (5 of 25).
    geometry = chart_data.bucket_geometry([1, 26], [25, 5])
    assert geometry == {
        "x0": [1, 26],
        "x1": [25, 30],
        "center": [13.0, 28.0],
        "partial": [False, True],
    }
    # A 10-step run is one partial bucket over steps 1–10, not a dot at step 1.
    assert chart_data.bucket_geometry([1], [10]) == {
        "x0": [1],
        "x1": [10],
        "center": [5.5],
        "partial": [True],
    }
    table = chart_data.bucket_table([(0, 25, 1.0, 0.9, 1.0), (1, 1, 0.0, 0.5, None)])
    assert table["x1"] == [25, 26] and table["center"] == [13.0, 26.0]
    assert table["partial"] == [False, True]


def test_kl_and_loss_say_what_beta_zero_means() -> None:
    names = ["loss", "kl", "grad_norm"]
    at_zero = plotly_figures.run_figures([], names, {"kl_coef": 0.0, "num_iterations": 1})
    by_id = {f["id"]: f for f in at_zero["optimization"]}
    assert by_id["s-kl"]["empty"] == "not computed (β = 0)"
    assert "0 by construction" in by_id["s-loss"]["help"]
    assert by_id["s-grad_norm"]["empty"] == ""
    with_kl = plotly_figures.run_figures([], names, {"kl_coef": 0.04, "num_iterations": 1})
    assert all(f["empty"] == "" and f["help"] == "" for f in with_kl["optimization"])
    # A run recorded from a user's own script has no launch config: nothing is claimed.
    assert all(f["empty"] == "" for f in plotly_figures.run_figures([], names)["optimization"])


def test_k_reads_the_same_in_the_config_panel_as_on_the_card() -> None:
    leaky = {"variant": "leaky", "k": None, "config": {"variant": "leaky", "k": 4, "lr": 1}}
    assert dict(chart_data.config_rows(chart_data.shown_config(leaky)))["k"] == "null"
    patched = {"variant": "patched", "k": 4, "config": {"variant": "patched", "k": 4}}
    assert dict(chart_data.config_rows(chart_data.shown_config(patched)))["k"] == "4"
    assert chart_data.shown_config({"config": None}) is None
