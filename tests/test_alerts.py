"""Alert rules as pure functions, table-driven."""

from __future__ import annotations

from typing import Any

import pytest
from rollout_lens.server.alerts import AlertThresholds, evaluate

T = AlertThresholds()


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
        ({"state/collapse": _series([0.0] * 10 + [0.75] * 10)}, [("collapse", 11)]),
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
    ],
)
def test_alert_rules(series: dict[str, Any], expected: list[tuple[str, int]]) -> None:
    alerts = evaluate(series, T)
    assert [(a.kind, a.step) for a in alerts] == expected
    assert all(str(a.step) in a.message for a in alerts)


def test_missing_values_are_skipped() -> None:
    series = {"state/collapse": [(1, None), (2, 0.9), (3, None), (4, 0.9)]}
    assert [(a.kind, a.step) for a in evaluate(series, T)] == [("collapse", 2)]


def test_probes_that_are_high_in_a_healthy_call_do_not_fire() -> None:
    healthy = _series([0.0] * 5 + [0.99] * 20)
    series = {
        f"probe/{name}/mean": healthy
        for name in ("open_first", "close_after_id", "eot_after_close")
    }
    assert evaluate(series, T) == []
