"""The mismatch lens as the pages draw it (pure): the token view's log-ratio shades against the
bands mismatch.outside counts, the hover and stats-row text against brute force, the JSON twin's
figures, and the mismatch chart section against the series a run recorded."""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import pytest
from rollout_lens.server.core import mismatch as mm
from rollout_lens.server.core.alerts import AlertThresholds
from rollout_lens.server.core.records import RolloutRecord
from rollout_lens.server.core.step_views import RolloutView
from rollout_lens.server.webapp.pages import cells, plotly_figures, viewer

from tests.factories import make_tool_rollouts, with_generator

EDGES = [0.0, 0.01, 0.1, math.log(2), math.log(5), 700.0]
VALUES = sorted({s * (e + d) for e in EDGES for d in (-1e-9, 0.0, 1e-9) for s in (-1, 1)})
VALUES += [random.Random(47).uniform(-4, 4) for _ in range(200)]


@pytest.mark.parametrize("log_r", VALUES)
def test_a_shade_is_its_band_as_mismatch_counts_it(log_r: float) -> None:
    shade = cells.ratio_class(log_r)
    beyond = [bool(mm.outside(np.array([log_r]), band)[0]) for band in mm.BANDS]
    if abs(log_r) <= 0.01:
        assert shade == "r0"
        return
    assert shade[:2] == ("rp" if log_r > 0 else "rn")
    level = int(shade[2:])
    assert (level >= 3) == beyond[0] and (level == 4) == beyond[1]
    assert (level >= 2) == (abs(log_r) > 0.1)
    text = cells.ratio_text(log_r)
    assert text.startswith(f"log r={log_r:+.3f} (r=")
    widest = [b for b, out in zip(mm.BANDS, beyond, strict=True) if out]
    if widest:
        assert text.endswith(f"outside [1/{widest[-1]:g}, {widest[-1]:g}]")
    else:
        assert "outside" not in text


@pytest.mark.parametrize("missing", [None, math.nan, math.inf, -math.inf])
def test_nothing_to_compare_is_neutral(missing: float | None) -> None:
    assert cells.ratio_class(missing) == cells.RATIO_NONE == "rx"
    assert cells.ratio_text(missing) == "log r: — (no generator logprob to compare)"


def test_the_legend_names_every_shade_once_from_low_to_high_ratios() -> None:
    classes = [c for c, _ in cells.RATIO_SCALE]
    assert classes == [*(f"rn{i}" for i in (4, 3, 2, 1)), "r0", *(f"rp{i}" for i in (1, 2, 3, 4))]
    labels = [text for _, text in cells.RATIO_SCALE]
    low, high = f"1/{mm.BANDS[1]:g}", f"{mm.BANDS[1]:g}"
    assert labels[0] == f"<{low}" and labels[-1] == f">{high}"
    assert labels[1] == f"{low}–1/{mm.BANDS[0]:g}" and labels[-2] == f"{mm.BANDS[0]:g}–{high}"


def _view(record: RolloutRecord, **extra: Any) -> RolloutView:
    """A recorded rollout as the read side would return it (through its JSON)."""
    control = record.control_probs
    return RolloutView.from_data(
        {
            "prompt": record.prompt,
            "completion": record.completion,
            "completion_ids": record.completion_ids.tolist(),
            "tokens": record.tokens,
            "token_logprobs": record.token_logprobs.tolist(),
            "generator_logprobs": None
            if record.generator_logprobs is None
            else record.generator_logprobs.tolist(),
            "control_token_probs": {
                t: control.array[:, k].tolist() for k, t in enumerate(control.tokens)
            },
            "meta": record.meta,
        }
        | extra
    )


def _single(n: int, seed: int, *, none_every: int = 0) -> RolloutRecord:
    rng = random.Random(seed)
    (record,) = make_tool_rollouts(1)
    ids = [rng.randrange(50, 900) for _ in range(n)]
    record.meta = {}
    record.completion = " ".join(f"w{i}" for i in ids)
    record.completion_ids = ids
    record.tokens = [f" w{i}" for i in ids]
    record.token_logprobs = [math.log(rng.uniform(0.01, 1.0)) for _ in ids]
    record.control_probs = None
    return with_generator([record], rng, spread=2.0, none_every=none_every)[0]


def test_each_cell_says_both_probabilities_and_its_log_ratio() -> None:
    record = _single(40, 1, none_every=7)
    shown = viewer.shown_rollout(_view(record), "p", None)
    trainer, generator = record.token_logprobs, record.generator_logprobs
    assert generator is not None
    for i, cell in enumerate(shown.cells):
        assert (cell["first"], cell["last"]) == (i, i)
        head, ratio = cell["title"].split("\n")[:2]
        p, q = math.exp(trainer[i]), math.exp(generator[i])
        if math.isnan(generator[i]):
            assert head.endswith(f"trainer p={cells.prob_text(p, 3)} · generator p=—")
            assert ratio == cells.ratio_text(None) and cell["cls"].endswith(" rx")
            continue
        log_r = trainer[i] - generator[i]
        assert head.endswith(
            f"trainer p={cells.prob_text(p, 3)} · generator p={cells.prob_text(q, 3)}"
        )
        assert ratio == cells.ratio_text(log_r)
        shade = cells.probability_bin(p)
        assert cell["cls"] == f"tok p{shade} {cells.ratio_class(log_r)}"


def test_a_character_over_several_tokens_has_their_summed_log_ratio() -> None:
    side = cells.GeneratorSide(probs=[0.5, 0.25, None], log_ratios=[0.3, -0.1, None])
    assert side.at(0, 1) == (0.125, pytest.approx(0.2))
    assert side.at(1, 2) == (None, None)  # a token of it has nothing to compare
    built = cells.generator_side(
        np.log([0.5, 0.4, 0.3]), np.log([0.25, 0.4]), 3, sampled=[True, False, True]
    )
    assert built.probs == [pytest.approx(0.25), None, None]  # not sampled; past the array
    assert built.log_ratios == [pytest.approx(math.log(2)), None, None]


def test_without_a_generator_side_a_cell_is_as_before() -> None:
    record = _single(12, 2)
    record.generator_logprobs = None
    shown = viewer.shown_rollout(_view(record), "p", None)
    assert shown.mismatch_stats == [] and shown.mismatch is None
    for cell in shown.cells:
        assert cell["cls"].split() == ["tok", cell["cls"].split()[1]]  # its probability alone
        assert "generator" not in cell["title"] and "log r" not in cell["title"]
        assert cell["title"].split("\n")[0].split(" · ")[-1].startswith("p=")


def test_tool_results_stay_not_sampled_and_neutral() -> None:
    rng = random.Random(3)
    for record in with_generator(make_tool_rollouts(2), rng, spread=1.5):
        shown = viewer.shown_rollout(_view(record), "p", None)
        assert shown.sampled is not None
        for cell, sampled in zip(shown.cells, shown.sampled, strict=True):
            if sampled:
                assert "generator p=" in cell["title"] and "log r" in cell["title"]
            else:
                assert cell["cls"] == "tok tool-tok"
                assert cell["title"].endswith("tool result: not sampled, not trained")


def _brute(trainer: list[float], generator: list[float]) -> tuple[int, float, float]:
    """The tokens compared, max |Δlogp| and the sequence ratio, in plain loops."""
    diffs = [t - g for t, g in zip(trainer, generator, strict=True) if not math.isnan(g)]
    return len(diffs), max(abs(d) for d in diffs), math.exp(math.fsum(diffs))


def test_the_stats_row_and_the_json_carry_the_rollouts_figures() -> None:
    record = _single(60, 4, none_every=5)
    assert record.generator_logprobs is not None
    n, biggest, ratio = _brute(record.token_logprobs.tolist(), record.generator_logprobs.tolist())
    view = _view(record)
    (diff, seq) = viewer.mismatch_stats(view)
    assert diff[:2] == ("max |Δlogp|", f"{biggest:.3g}") and f"over its {n} compared" in diff[2]
    assert seq[:2] == ("seq. ratio", f"{ratio:.3g}") and "Π p_trainer / p_generator" in seq[2]
    sent = viewer.rollout_json(view, 100)["mismatch"]
    assert sent["tokens"] == n
    assert sent["abs_diff_max"] == pytest.approx(biggest) and sent["seq_ratio"] == pytest.approx(
        ratio
    )
    # a generator that gave no logprob at all: the figures are unknown, and say so
    record.generator_logprobs = [math.nan] * len(record.completion_ids)
    blank = _view(record)
    assert [(label, value) for label, value, _ in viewer.mismatch_stats(blank)] == [
        ("max |Δlogp|", "—"),
        ("seq. ratio", "—"),
    ]
    assert viewer.rollout_json(blank, 100)["mismatch"] is None
    record.generator_logprobs = None  # a path without a generator side: no key at all
    assert "mismatch" not in viewer.rollout_json(_view(record), 100)


def test_the_mismatch_section_only_where_the_run_recorded_its_series() -> None:
    plain = plotly_figures.run_figures(["<tool>"], ["reward_mean", "loss"])
    assert plain["mismatch"] == []
    figs = plotly_figures.run_figures(["<tool>"], ["reward_mean", *mm.NAMES])
    assert [f["id"] for f in figs["mismatch"]] == [
        "mismatch-diff",
        "mismatch-k3",
        "mismatch-seq",
        "mismatch-bands",
    ]
    drawn = [t["meta"]["series"] for f in figs["mismatch"] for t in f["data"]]
    assert set(drawn) == set(mm.NAMES)
    assert not [g for g in figs["other"] if g["title"] == "mismatch"]  # not twice
    (k3,) = [f for f in figs["mismatch"] if f["id"] == "mismatch-k3"]
    assert k3["alerts"] == ["mismatch"]
    (seq,) = [f for f in figs["mismatch"] if f["id"] == "mismatch-seq"]
    assert [t["meta"]["series"] for t in seq["data"] if t["meta"]["part"] == "y"] == [
        mm.SEQ_RATIO_MIN,
        mm.SEQ_RATIO_MEAN,
        mm.SEQ_RATIO_MAX,
    ]
    some = plotly_figures.run_figures(["<tool>"], [mm.K3_KL])
    assert [f["id"] for f in some["mismatch"]] == ["mismatch-k3"]
    (section,) = [s for s in plotly_figures.RUN_SECTIONS if s["id"] == "mismatch"]
    assert not section["always"] and section["title"] == "Training–inference mismatch"
    text = section["text"]
    assert f"≥ {AlertThresholds().mismatch_k3:g}" in text
    assert all(f"[1/{b:g}, {b:g}]" in text for b in mm.BANDS)


def test_compare_overlays_each_mismatch_figure_where_a_run_has_it() -> None:
    runs = [{"id": i, "name": f"r{i}", "control_tokens": []} for i in (1, 2)]
    data = {"x": [1, 2], "y": [0.01, 0.02]}
    series = {
        "1": {"series": {name: data for name in mm.NAMES}},
        "2": {"series": {mm.K3_KL: data}},
    }
    figs = plotly_figures.compare_figures(runs, series, ["reward_mean"])
    titles = {f["title"]: f for f in figs["mismatch"]}
    assert len(titles) == len(mm.NAMES)
    k3 = titles["k3 KL(generator ‖ trainer)"]
    assert sorted({t["meta"]["run"] for t in k3["data"]}) == [1, 2]
    assert k3["layout"]["yaxis"]["rangemode"] == "tozero"  # not a share's 0…1
    assert {t["meta"]["run"] for t in titles["|Δlogp| mean"]["data"]} == {1}
    nothing = plotly_figures.compare_figures(runs, {"1": {"series": {}}, "2": {"series": {}}}, [])
    assert nothing["mismatch"] == []
