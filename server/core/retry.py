"""One backoff for every retry: the recorder's writer thread (which schedules its next try
rather than sleep: trainer/recorder/writer.py), a worker's writes outside the step stream
(`with_retries` there) and the alert webhooks (server/webapp/alert_hooks.py).

A Backoff waits `first` seconds after the first failure, twice as long after each next one up
to `most`, and says when to give up: after `give_up_after` seconds of failing, or after `tries`
tries in all. `retry` is the blocking loop around it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

FIRST_SECONDS = 0.5
MOST_SECONDS = 15.0


@dataclass
class Backoff:
    """The delays between tries, and how long (and how often) it has failed since it last
    succeeded."""

    first: float = FIRST_SECONDS
    most: float = MOST_SECONDS
    give_up_after: float | None = None  # seconds of failing, at most
    tries: int | None = None  # tries in all, at most
    down_since: float | None = None  # the first failure since the last success (monotonic)
    attempts: int = 0  # failures since the last success
    delay: float = 0.0  # the wait after the latest failure (before give_up_after's cap)

    def failed(self) -> float | None:
        """A try failed: the seconds to wait before the next, or None: time to give up."""
        now = time.monotonic()
        self.attempts += 1
        if self.down_since is None:
            self.down_since = now
            self.delay = self.first
        else:
            self.delay = min(self.delay * 2, self.most)
        waited = now - self.down_since
        if self.tries is not None and self.attempts >= self.tries:
            return None
        if self.give_up_after is None:
            return self.delay
        if waited >= self.give_up_after:
            return None
        return min(self.delay, self.give_up_after - waited)

    def waited(self) -> float:
        """Seconds since the first failure (0 when none)."""
        return 0.0 if self.down_since is None else time.monotonic() - self.down_since

    def succeeded(self) -> float | None:
        """A try succeeded: how long it had been failing (None when it had not), and start
        again from `first`."""
        down = None if self.down_since is None else self.waited()
        self.down_since, self.attempts, self.delay = None, 0, 0.0
        return down


def retry(
    action: Callable[[], T],
    *,
    backoff: Backoff,
    retryable: Callable[[Exception], bool],
    sleep: Callable[[float], None] = time.sleep,
    on_failure: Callable[[Exception, Backoff], None] | None = None,
) -> T:
    """`action()` until it succeeds. An exception `retryable` accepts is retried after the
    backoff's delay (`on_failure` hears of it first); past the backoff's bounds, or not
    retryable, it is raised (`backoff.attempts` tells how many tries failed)."""
    while True:
        try:
            result = action()
        except Exception as exc:
            if not retryable(exc):
                raise
            delay = backoff.failed()
            if on_failure is not None:
                on_failure(exc, backoff)
            if delay is None:
                raise
            sleep(delay)
            continue
        return result
