"""Alert rules as pure functions, table-driven."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from rollout_lens.server.core import mismatch as mm
from rollout_lens.server.core.alerts import (
    KINDS,
    SEVERITY,
    AlertThresholds,
    FiredAlert,
    Watch,
    evaluate,
)
from rollout_lens.server.core.vocab import BELONGS, MISPLACED, NEUTRAL_PROBES, POSITIONAL_PROBES

T = AlertThresholds()  # one group per step: share rules average over 4 steps
T8 = T.for_run(8)  # eight groups per step: one step holds enough groups


def _series(values: list[float | None], start: int = 1) -> list[tuple[int, float | None]]:
    return [(start + i, v) for i, v in enumerate(values)]


@pytest.mark.parametrize(
    ("series", "expected"),
    [
        # a steady low probe, then a jump: one alert at the jump
        (
            {"probe/eot_after_open/mean": _series([0.01] * 20 + [0.3] + [0.01] * 5)},
            [("control_token_spike", 21)],
        ),
        # absolutely high for a stretch: one alert at its start, another when it comes back
        (
            {"probe/eot_after_open/mean": _series([0.0] * 5 + [0.9] * 5 + [0.0] * 5 + [0.8])},
            [("control_token_spike", 6), ("control_token_spike", 16)],
        ),
        # small wiggles never fire
        ({"probe/eot_after_open/mean": _series([0.01, 0.03, 0.02, 0.05, 0.04] * 6)}, []),
        # an unpositioned max is not a probe: it is ~1 wherever end-of-turn ends a reply
        ({"ctrl/</assistant>/max": _series([1.0] * 30)}, []),
        # the opening tag losing its place at the first position (the tiny model's collapse)
        (
            {"probe/open_first/mean": _series([1.0] * 20 + [0.03] * 5)},
            [("control_token_spike", 21)],
        ),
        ({"probe/open_first/mean": _series([0.3, 0.2, 0.4] * 5)}, []),  # never high: still learning
        # one group a step: a share needs 4 steps (4 groups) behind it before it is a collapse
        ({"state/collapse": _series([0.0] * 10 + [0.75] * 10)}, [("collapse", 13)]),
        ({"state/collapse": _series([0.1, 0.4, 0.2])}, []),
        (
            {"reward_mean": _series([0.2] * 25 + [0.8] * 25), "true_accuracy": _series([0.5] * 50)},
            [("reward_hacking", 50)],
        ),
        (
            {
                "reward_mean": _series([0.2] * 25 + [0.8] * 25),
                "true_accuracy": _series([0.2] * 25 + [0.8] * 25),
            },
            [],
        ),
        ({"zero_std_share": _series([0.0] * 10 + [1.0] * 12)}, [("signal_loss", 20)]),
        ({"zero_std_share": _series([1.0, 0.0] * 15)}, []),
        # mismatch: k3 KL(generator ‖ trainer) reaching 0.01 (verl's K3 rejection default); one
        # alert an episode, again once it has cleared
        (
            {"mismatch/k3_kl": _series([0.001] * 5 + [0.02] * 3 + [0.002] * 3 + [0.01])},
            [("mismatch", 6), ("mismatch", 12)],
        ),
        ({"mismatch/k3_kl": _series([0.0, 0.004, 0.0099, 0.001] * 5)}, []),
        # no generator logprobs: no k3 series, whatever the other figures
        ({"mismatch/abs_diff_max": _series([3.0] * 10)}, []),
    ],
)
def test_alert_rules(series: dict[str, Any], expected: list[tuple[str, int]]) -> None:
    alerts = evaluate(series, T)
    assert [(a.kind, a.step) for a in alerts] == expected
    assert all(str(a.step) in a.message for a in alerts)


def test_missing_values_are_skipped() -> None:
    series = {"state/collapse": [(1, None), (2, 0.9), (3, None), (4, 0.9)]}
    assert [(a.kind, a.step) for a in evaluate(series, T8)] == [("collapse", 2)]
    series = {"state/collapse": [(s, None if s % 2 else 0.9) for s in range(1, 11)]}
    assert [(a.kind, a.step) for a in evaluate(series, T)] == [("collapse", 8)]  # 4th logged


def test_probes_that_are_high_in_a_healthy_call_do_not_fire() -> None:
    healthy = _series([0.0] * 5 + [0.99] * 20)
    series = {
        f"probe/{name}/mean": healthy
        for name in ("open_first", "close_after_id", "eot_after_close")
    }
    assert evaluate(series, T) == []


def _probe(name: str) -> str:
    return f"probe/{name}/mean"


# (series, thresholds, expected (kind, step, severity))
SEVERITY_CASES = {
    # every control token where it does not belong: rising is a warning
    **{
        f"{name} rises": (
            {_probe(name): _series([0.01] * 15 + [0.7] * 3)},
            T,
            [("control_token_spike", 16, "warning")],
        )
        for name in MISPLACED
    },
    # every control token where it belongs: falling is a warning
    **{
        f"{name} falls": (
            {_probe(name): _series([0.98] * 15 + [0.2] * 3)},
            T,
            [("control_token_spike", 16, "warning")],
        )
        for name in BELONGS
    },
    # one bad group of 8 at one step of a 1-prompt run is not a collapse…
    "one bad group": ({"state/collapse": _series([0.0] * 10 + [1.0] + [0.0] * 10)}, T, []),
    # …but two bad groups in four steps reach the share
    "two of four groups": (
        {"state/collapse": _series([0.0] * 10 + [1.0, 0.0, 1.0, 0.0] + [0.0] * 6)},
        T,
        [("collapse", 13, "warning")],
    ),
    # with 8 groups a step, one step is a wide enough window
    "a step of 8 groups": (
        {"state/collapse": _series([0.0] * 10 + [0.75] + [0.0] * 10)},
        T8,
        [("collapse", 11, "warning")],
    ),
    # all 8 right in every group: no spread, but solved — info, not a warning
    "solved groups": (
        {
            "zero_std_share": _series([0.2] * 5 + [1.0] * 20),
            "groups/solved": _series([0.1] * 5 + [1.0] * 20),
            "groups/stuck": _series([0.1] * 5 + [0.0] * 20),
        },
        T,
        [("solved", 25, "info")],
    ),
    # a converged run dipping for a few steps is not solved anew: one info, not one per dip
    "solved, a dip, solved": (
        {"groups/solved": _series([1.0] * 30 + [0.0] * 8 + [1.0] * 40)},
        T,
        [("solved", 25, "info")],
    ),
    "…without the quiet period": (
        {"groups/solved": _series([1.0] * 30 + [0.0] * 8 + [1.0] * 40)},
        replace(T, solved_quiet=1),
        [("solved", 25, "info"), ("solved", 58, "info")],
    ),
    # all wrong (or all equal below the top): stuck — signal loss
    "stuck groups": (
        {
            "zero_std_share": _series([0.2] * 5 + [1.0] * 20),
            "groups/solved": _series([0.1] * 5 + [0.0] * 20),
            "groups/stuck": _series([0.1] * 5 + [1.0] * 20),
        },
        T,
        [("signal_loss", 15, "warning")],
    ),
    # half solved, half stuck: neither is nearly every group
    "half and half": (
        {
            "zero_std_share": _series([1.0] * 20),
            "groups/solved": _series([0.5] * 20),
            "groups/stuck": _series([0.5] * 20),
        },
        T,
        [],
    ),
    # a run recorded before the split: zero spread is all it has
    "zero-std only": (
        {"zero_std_share": _series([1.0] * 12)},
        T,
        [("signal_loss", 10, "warning")],
    ),
    # one stuck group among 4 a step, for 10 steps, is not signal loss
    "one stuck group of four": (
        {"groups/stuck": _series([0.25] * 20), "zero_std_share": _series([0.25] * 20)},
        T.for_run(4),
        [],
    ),
}


@pytest.mark.parametrize(
    ("series", "thresholds", "expected"),
    list(SEVERITY_CASES.values()),
    ids=list(SEVERITY_CASES),
)
def test_alert_severity(
    series: dict[str, Any], thresholds: AlertThresholds, expected: list[tuple[str, int, str]]
) -> None:
    alerts = [a.as_dict() for a in evaluate(series, thresholds)]
    assert [(a["kind"], a["step"], a["severity"]) for a in alerts] == expected


def test_every_kind_has_a_severity_and_every_positional_probe_is_watched() -> None:
    assert set(SEVERITY) == set(KINDS)
    assert set(SEVERITY.values()) <= {"warning", "info"}
    assert [k for k, s in SEVERITY.items() if s == "info"] == ["solved"]
    assert FiredAlert("something_new", 3, "step 3").as_dict()["severity"] == "warning"
    assert SEVERITY["mismatch"] == "warning"
    assert sorted((*BELONGS, *MISPLACED, *NEUTRAL_PROBES)) == sorted(POSITIONAL_PROBES)


@pytest.mark.parametrize(("groups", "window"), [(1, 4), (2, 2), (3, 2), (4, 1), (8, 1)])
def test_share_window_holds_enough_groups(groups: int, window: int) -> None:
    t = T.for_run(groups)
    assert t.shares_window == window
    assert t.shares_window * groups >= t.min_groups
    assert t.groups_window == max(t.signal_loss_window, window)


def test_mismatch_alert_from_recorded_sides() -> None:
    """The rule reads the figure core.mismatch computes from both sides: the same tokens on
    both sides never fire; a generator a little off (bf16-like noise) stays under the default;
    one far off (a stale policy) fires, at the step it first does."""
    rng = np.random.default_rng(0)
    trainer = np.log(rng.uniform(0.05, 1.0, size=(6, 40)))

    def k3_at(noise: float) -> float | None:
        sides = [mm.Sides(t, t + rng.normal(0.0, noise, size=t.shape)) for t in trainer]
        return mm.step_figures(sides).get(mm.K3_KL)

    series = _series([k3_at(0.0), k3_at(0.02), k3_at(0.02), k3_at(0.5), k3_at(0.5)])
    assert series[0][1] == 0.0
    assert [(a.kind, a.step, a.series) for a in evaluate({mm.K3_KL: series}, T)] == [
        ("mismatch", 4, mm.K3_KL)
    ]
    watch = Watch(T)
    fired = [a.step for step, value in series for a in watch.push(step, {mm.K3_KL: value})]
    assert fired == [4]  # step by step as a recorder evaluates: the same
    assert Watch(T).push(1, {"reward_mean": 0.5}) == []  # no generator side: nothing to judge
