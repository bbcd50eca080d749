"""Wrong tokens, limited per client address: after a few, each further one locks the address
out for a growing time (1 s, 2 s, 4 s, … up to 5 minutes), during which its sign-ins and Bearer
tokens are answered 429 with Retry-After, unchecked.

A correct token is never slowed: nothing sleeps (a locked-out guess is answered at once, so a
guesser holds no connection open either), other addresses' failures do not count against it,
and a success clears its address. State is in-process, one small entry per address, at most
MAX_ADDRESSES of them (the least recently failing one is dropped first); an address with no
failure for FORGET_AFTER_S starts afresh. Behind a reverse proxy every client has the proxy's
address: run uvicorn with --proxy-headers (and --forwarded-allow-ips) so that each has its own.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

FREE_FAILURES = 5  # wrong tokens an address may send before the first lockout (typos)
FIRST_LOCKOUT_S = 1.0
MAX_LOCKOUT_S = 300.0
FORGET_AFTER_S = 3600.0
MAX_ADDRESSES = 10_000


@dataclass
class _Failures:
    count: int
    last: float
    locked_until: float


class FailureLimiter:
    """Failed token attempts per client address (thread-safe: the Guard and the sign-in route
    share one)."""

    def __init__(self) -> None:
        self._by_address: OrderedDict[str, _Failures] = OrderedDict()
        self._lock = threading.Lock()

    def retry_after(self, address: str) -> int:
        """Whole seconds until `address` may try a token again (0: now)."""
        with self._lock:
            entry = self._by_address.get(address)
            wait = 0.0 if entry is None else entry.locked_until - time.monotonic()
        return math.ceil(wait) if wait > 0 else 0

    def failed(self, address: str) -> None:
        """Count a wrong token from `address`; past FREE_FAILURES it is locked out, each time
        twice as long as the last (up to MAX_LOCKOUT_S)."""
        now = time.monotonic()
        with self._lock:
            entry = self._by_address.pop(address, None)
            if entry is None or now - entry.last > FORGET_AFTER_S:
                entry = _Failures(count=0, last=now, locked_until=0.0)
            entry.count += 1
            entry.last = now
            over = entry.count - FREE_FAILURES
            if over > 0:
                entry.locked_until = now + min(MAX_LOCKOUT_S, FIRST_LOCKOUT_S * 2 ** (over - 1))
            self._by_address[address] = entry  # the most recent at the end
            while len(self._by_address) > MAX_ADDRESSES:
                self._by_address.popitem(last=False)

    def succeeded(self, address: str) -> None:
        """A right token from `address`: its failures are forgotten."""
        with self._lock:
            self._by_address.pop(address, None)

    def __len__(self) -> int:
        """How many addresses it remembers (at most MAX_ADDRESSES)."""
        return len(self._by_address)


def client_address(scope: Mapping[str, Any]) -> str:
    """The client's address as the server saw it ("unknown" when the server gives none)."""
    client = scope.get("client")
    if isinstance(client, tuple | list) and client:
        return str(client[0])
    return "unknown"


def too_many_message(seconds: int) -> str:
    """The 429's words: what happened, how long to wait, and that guessing on costs more."""
    return (
        f"too many wrong tokens from this address: try again in {seconds} s (each further "
        "wrong token doubles the wait, up to 5 minutes)"
    )
