"""A terminal progress bar for `rollout-lens train`: step, reward and true accuracy."""

from __future__ import annotations

from collections import deque

from rollout_lens.server.core.records import StepRecord
from rollout_lens.server.core.vocab import WINDOW
from tqdm import tqdm


class ProgressBar:
    """tqdm bar fed by StepRecords (from the writer thread), with 25-step running means."""

    def __init__(self, total: int, *, disabled: bool = False) -> None:
        self._bar = tqdm(total=total, unit="step", disable=disabled, dynamic_ncols=True)
        self._reward: deque[float] = deque(maxlen=WINDOW)
        self._acc: deque[float] = deque(maxlen=WINDOW)

    def update(self, record: StepRecord) -> None:
        """One step was recorded."""
        for series, key in ((self._reward, "reward_mean"), (self._acc, "true_accuracy")):
            value = record.values.get(key)
            if value is not None:
                series.append(value)
        self._bar.set_postfix(
            reward=f"{_avg(self._reward):.2f}", true_acc=f"{_avg(self._acc):.2f}", refresh=False
        )
        self._bar.update(record.step - self._bar.n)

    def write(self, line: str) -> None:
        """A log line that does not break the bar."""
        self._bar.write(line)

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self._bar.close()


def _avg(values: deque[float]) -> float:
    return sum(values) / len(values) if values else 0.0
