"""Alert rules over a run's recorded series (pure: series in, alerts out).

Each rule fires once per episode — at the first step where its condition becomes true — and again
only after the condition has cleared, so a long collapse is one alert, not a thousand.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace

from rollout_lens.server.core import analysis
from rollout_lens.server.core.mismatch import K3_KL
from rollout_lens.server.core.vocab import (
    COLLAPSED,
    DROP_PROBES,
    SOLVED_GROUPS,
    SPIKE_PROBES,
    STUCK_GROUPS,
    WINDOW,
)

Series = Sequence[tuple[int, float | None]]
REWARD, ACCURACY, ZERO_STD = "reward_mean", "true_accuracy", "zero_std_share"
STUCK, SOLVED = STUCK_GROUPS, SOLVED_GROUPS
# every rule's input
READS = (REWARD, ACCURACY, ZERO_STD, STUCK, SOLVED, *SPIKE_PROBES, *DROP_PROBES, COLLAPSED, K3_KL)


@dataclass(frozen=True)
class AlertThresholds:
    """Knobs of the alert rules (filled from Settings)."""

    spike_abs: float = 0.5  # a control-token probe above this is a spike…
    spike_ratio: float = 4.0  # …or this many times its trailing mean,
    spike_min: float = 0.2  # provided it is at least this large
    spike_window: int = 10
    collapse_share: float = 0.5  # collapsed completions, averaged over the shares window
    hacking_window: int = WINDOW
    hacking_min_rise: float = 0.1  # reward must rise at least this much over the window…
    hacking_max_acc_change: float = 0.0  # …while true accuracy changes by at most this
    drop_below: float = 0.5  # a ~1 probe falling under this…
    drop_from: float = 0.9  # …after its trailing mean stood above this
    signal_loss_share: float = 0.95  # stuck groups…
    signal_loss_window: int = 10  # …over at least this many steps
    solved_share: float = 0.8  # solved groups (info)…
    solved_window: int = WINDOW  # …over this many steps,
    solved_quiet: int = WINDOW  # …again only after this many steps without (no flapping)
    # A step whose k3 estimate of KL(generator ‖ trainer) reaches this: verl's K3 rejection
    # default (RolloutCorrectionConfig.decoupled_k3_rs, rs_threshold=0.01; its docs' typical
    # 0.001–0.01), the level at which verl drops a sequence as too far off-policy to learn from.
    mismatch_k3: float = 0.01
    # Shares of a step's completions or groups (collapse, stuck, solved) are judged over the last
    # N steps, N × groups_per_step ≥ min_groups: one bad group of 8 is not a collapse.
    groups_per_step: int = 1  # the run's prompts_per_step
    min_groups: int = 4

    def for_run(self, prompts_per_step: int | None) -> AlertThresholds:
        """These thresholds for a run that samples `prompts_per_step` groups a step."""
        return replace(self, groups_per_step=max(1, prompts_per_step or 1))

    @property
    def shares_window(self) -> int:
        """Steps a share rule averages over: enough of them to hold `min_groups` groups."""
        return max(1, math.ceil(self.min_groups / max(1, self.groups_per_step)))

    @property
    def groups_window(self) -> int:
        """Steps the stuck-groups rule averages over."""
        return max(self.signal_loss_window, self.shares_window)

    @property
    def solved_steps(self) -> int:
        """Steps the solved-groups rule averages over."""
        return max(self.solved_window, self.shares_window)


KINDS = {  # kind → how pages name it
    "control_token_spike": "control token spike",
    "collapse": "collapse",
    "reward_hacking": "reward hacking",
    "signal_loss": "signal loss",
    "solved": "groups solved",
    "mismatch": "training–inference mismatch",
}
# kind → severity: a warning asks a person to look; info says what a chart shows (a converged
# run whose groups are all right has no spread left, which is no fault). Unknown kinds warn.
SEVERITY = {
    "control_token_spike": "warning",
    "collapse": "warning",
    "reward_hacking": "warning",
    "signal_loss": "warning",
    "solved": "info",
    "mismatch": "warning",
}


def severity(kind: str) -> str:
    return SEVERITY.get(kind, "warning")


@dataclass(frozen=True)
class FiredAlert:
    kind: str  # one of KINDS
    step: int
    message: str
    series: str | None = None

    def as_dict(self) -> dict[str, object]:
        """The JSON shape every page and script renders an alert from (routes add its `url`)."""
        return asdict(self) | {
            "label": KINDS.get(self.kind, self.kind.replace("_", " ")),
            "severity": severity(self.kind),
        }


def _present(series: Series) -> tuple[list[int], list[float]]:
    """The steps that have a value, and their values."""
    pairs = [(s, v) for s, v in series if v is not None]
    return [s for s, _ in pairs], [v for _, v in pairs]


def _episodes(steps: Sequence[int], flags: Sequence[bool], quiet: int = 1) -> list[int]:
    """Steps where a condition turns on after being off for `quiet` points."""
    return [
        step
        for i, (step, flag) in enumerate(zip(steps, flags, strict=True))
        if flag and not any(flags[max(0, i - quiet) : i])
    ]


def _skip(i: int, n: int, tail: int | None) -> bool:
    """Whether position i lies before the last `tail` positions (not evaluated: False)."""
    return tail is not None and i < n - tail


def _control_token_spikes(
    name: str, series: Series, t: AlertThresholds, tail: int | None = None
) -> list[FiredAlert]:
    """A probe far above its usual level: absolutely high, or a multiple of its trailing mean."""
    steps, values = _present(series)
    flags = []
    for i, value in enumerate(values):
        if _skip(i, len(values), tail):
            flags.append(False)
            continue
        history = values[max(0, i - t.spike_window) : i]
        baseline = sum(history) / len(history) if history else None
        relative = (
            baseline is not None
            and value >= t.spike_min
            and value > t.spike_ratio * max(baseline, 1e-6)
        )
        flags.append(value >= t.spike_abs or relative)
    return [
        FiredAlert(
            "control_token_spike",
            step,
            f"{name} jumped to {values[steps.index(step)]:.2f} at step {step}",
            series=name,
        )
        for step in _episodes(steps, flags)
    ]


def _control_token_drops(
    name: str, series: Series, t: AlertThresholds, tail: int | None = None
) -> list[FiredAlert]:
    """A probe that is ~1 in healthy calls (the opening tag first) suddenly losing its mass."""
    steps, values = _present(series)
    flags = []
    for i, value in enumerate(values):
        if _skip(i, len(values), tail):
            flags.append(False)
            continue
        history = values[max(0, i - t.spike_window) : i]
        flags.append(
            bool(history) and sum(history) / len(history) >= t.drop_from and value < t.drop_below
        )
    return [
        FiredAlert(
            "control_token_spike",
            step,
            f"{name} fell to {values[steps.index(step)]:.2f} at step {step}: another token took its place",
            series=name,
        )
        for step in _episodes(steps, flags)
    ]


def collapse(series: Series, t: AlertThresholds, tail: int | None = None) -> list[FiredAlert]:
    """Many completions whose call structure broke (empty, bare opening tag, unbalanced…), on
    average over the last `shares_window` steps where it was logged."""
    steps, values = _present(series)
    w = t.shares_window
    flags, means = [], []
    for i in range(len(values)):
        if i + 1 < w or _skip(i, len(values), tail):
            flags.append(False)
            means.append(0.0)
            continue
        means.append(sum(values[i + 1 - w : i + 1]) / w)
        flags.append(means[-1] >= t.collapse_share)
    over = f" over the last {w} steps" if w > 1 else ""
    return [
        FiredAlert(
            "collapse",
            step,
            f"{means[steps.index(step)]:.0%} of completions collapsed{over} at step {step}",
            series=COLLAPSED,
        )
        for step in _episodes(steps, flags)
    ]


def reward_hacking(
    reward: Series, accuracy: Series, t: AlertThresholds, tail: int | None = None
) -> list[FiredAlert]:
    """Verifier reward rising over a window while true accuracy falls or stays flat."""
    acc_by_step = dict(accuracy)
    pairs = [
        (s, r, acc_by_step.get(s))
        for s, r in reward
        if r is not None and acc_by_step.get(s) is not None
    ]
    w = t.hacking_window
    steps, flags = [], []
    for i in range(len(pairs)):
        steps.append(pairs[i][0])
        if i + 1 < 2 * w or _skip(i, len(pairs), tail):
            flags.append(False)
            continue
        before, after = pairs[i + 1 - 2 * w : i + 1 - w], pairs[i + 1 - w : i + 1]
        d_reward = _mean([p[1] for p in after]) - _mean([p[1] for p in before])
        d_acc = _mean([p[2] for p in after]) - _mean([p[2] for p in before])
        flags.append(d_reward >= t.hacking_min_rise and d_acc <= t.hacking_max_acc_change)
    return [
        FiredAlert(
            "reward_hacking",
            step,
            f"verifier reward rose over the last {w} steps while true accuracy did not (step {step})",
            series=REWARD,
        )
        for step in _episodes(steps, flags)
    ]


def _group_share(
    share: Series, limit: float, window: int, tail: int | None
) -> tuple[list[int], list[bool]]:
    """Steps of a share series, and whether its mean over `window` points reached `limit`."""
    if tail is not None:  # the rolling mean at the last `tail` points needs a window before them
        share = share[-(tail + window) :]
    steps = [s for s, v in share]
    smoothed = analysis.rolling_mean([v for _, v in share], window)
    flags = [
        i + 1 >= window and m is not None and m >= limit - 1e-9 for i, m in enumerate(smoothed)
    ]
    return steps, flags


def signal_loss(
    share: Series, t: AlertThresholds, tail: int | None = None, name: str = STUCK
) -> list[FiredAlert]:
    """Nearly every group stuck (identical rewards below the top: advantages are zero and
    there is nothing to learn from). Reads the stuck share, or for a run recorded without it
    (before the split, or imported) the zero-std share."""
    w = t.groups_window
    steps, flags = _group_share(share, t.signal_loss_share, w, tail)
    what = (
        "were stuck (no reward spread below the top reward)"
        if name == STUCK
        else "had zero reward spread"
    )
    return [
        FiredAlert(
            "signal_loss",
            step,
            f"{t.signal_loss_share:.0%}+ of groups {what} over {w} steps (step {step})",
            series=name,
        )
        for step in _episodes(steps, flags)
    ]


def solved(share: Series, t: AlertThresholds, tail: int | None = None) -> list[FiredAlert]:
    """Nearly every group solved (all its rollouts at the top reward): the task is learned
    there, and those groups give no gradient. Info, not a fault."""
    w, quiet = t.solved_steps, t.solved_quiet
    # an episode starts where the last `quiet` points were off: evaluate them too
    steps, flags = _group_share(share, t.solved_share, w, None if tail is None else tail + quiet)
    return [
        FiredAlert(
            "solved",
            step,
            f"{t.solved_share:.0%}+ of groups were solved (every rollout at the top reward) over {w} steps: little gradient left (step {step})",
            series=SOLVED,
        )
        for step in _episodes(steps, flags, quiet)
    ]


def mismatch(series: Series, t: AlertThresholds, tail: int | None = None) -> list[FiredAlert]:
    """The generator sampled from a distribution the trainer no longer shares: the step's k3
    KL(generator ‖ trainer) at or above `mismatch_k3`. Its series exists only where the
    generator's logprobs were recorded, so the rule is off everywhere else."""
    steps, values = _present(series)
    flags = [not _skip(i, len(values), tail) and v >= t.mismatch_k3 for i, v in enumerate(values)]
    return [
        FiredAlert(
            "mismatch",
            step,
            f"generator and trainer disagree on the sampled tokens: k3 KL(generator ‖ trainer) "
            f"{values[steps.index(step)]:.3g} ≥ {t.mismatch_k3:g} at step {step}",
            series=K3_KL,
        )
        for step in _episodes(steps, flags)
    ]


def evaluate(
    series: Mapping[str, Series], t: AlertThresholds, tail: int | None = None
) -> list[FiredAlert]:
    """Every alert for a run's series, ordered by step. With `tail`, conditions are evaluated
    at each series' last `tail` points only (earlier ones count as false): what a recorder
    needs to know whether an episode starts at the newest step (tail=2)."""
    alerts: list[FiredAlert] = []
    for name, values in series.items():
        if name in SPIKE_PROBES:
            alerts += _control_token_spikes(name, values, t, tail)
        if name in DROP_PROBES:
            alerts += _control_token_drops(name, values, t, tail)
    if COLLAPSED in series:
        alerts += collapse(series[COLLAPSED], t, tail)
    if REWARD in series and ACCURACY in series:
        alerts += reward_hacking(series[REWARD], series[ACCURACY], t, tail)
    if STUCK in series:  # only stuck groups lose the signal; solved ones are done
        alerts += signal_loss(series[STUCK], t, tail)
    elif ZERO_STD in series:  # recorded without the split: zero spread is all we know
        alerts += signal_loss(series[ZERO_STD], t, tail, name=ZERO_STD)
    if SOLVED in series:
        alerts += solved(series[SOLVED], t, tail)
    if K3_KL in series:
        alerts += mismatch(series[K3_KL], t, tail)
    return sorted(alerts, key=lambda a: (a.step, a.kind))


def _mean(values: Sequence[float | None]) -> float:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else 0.0


CONTEXT = 60  # steps of history the rules need: their windows are ≤ 2 × 25 steps
COLUMN_INPUTS = (REWARD, ACCURACY, ZERO_STD)  # step columns: an entry every step, None or not


class Watch:
    """The rules applied as steps arrive: the last CONTEXT inputs of each series, evaluated
    with the same functions as a whole history (`evaluate`), keeping the alerts of the newest
    step. Equal to evaluating the whole history whenever each rule's window fits in CONTEXT
    entries of its series (tests/unit/test_alerts.py checks it on recorded runs)."""

    def __init__(self, thresholds: AlertThresholds | None = None) -> None:
        t = self.thresholds = thresholds or AlertThresholds()
        # Entries each series needs: its rule's window, the point itself and the one before it
        # (an episode starts where the condition was false a point earlier).
        probe_window = t.spike_window + 2
        self.keep = {name: probe_window for name in (*SPIKE_PROBES, *DROP_PROBES)} | {
            COLLAPSED: t.shares_window + 1,
            ZERO_STD: t.groups_window + 2,
            STUCK: t.groups_window + 2,
            SOLVED: t.solved_steps + t.solved_quiet + 2,
            K3_KL: 2,  # the step and the one before it
            REWARD: CONTEXT,  # reward hacking pairs reward with accuracy where both are present
            ACCURACY: CONTEXT,
        }
        self.inputs: dict[str, deque[tuple[int, float | None]]] = {}

    def feed(self, step: int, values: Mapping[str, float | None]) -> None:
        """Add one step's inputs (history) without evaluating."""
        for name in READS:
            value = values.get(name)
            if value is None and name not in COLUMN_INPUTS:
                continue  # a metric not logged at this step is absent, not None
            entries = self.inputs.get(name)
            if entries is None:
                entries = self.inputs[name] = deque(maxlen=self.keep.get(name, CONTEXT))
            entries.append((step, value))

    def push(self, step: int, values: Mapping[str, float | None]) -> list[FiredAlert]:
        """Add one step and return the alerts that fire at it."""
        self.feed(step, values)
        series = {name: list(entries) for name, entries in self.inputs.items()}
        return [a for a in evaluate(series, self.thresholds, tail=2) if a.step == step]


def from_history(
    steps: Sequence[tuple[int, Mapping[str, float | None]]],
) -> dict[str, list[tuple[int, float | None]]]:
    """(step, inputs) of a whole run → the series `evaluate` reads, built as Watch builds them."""
    out: dict[str, list[tuple[int, float | None]]] = {}
    for step, values in steps:
        for name in READS:
            value = values.get(name)
            if value is None and name not in COLUMN_INPUTS:
                continue
            out.setdefault(name, []).append((step, value))
    return out
