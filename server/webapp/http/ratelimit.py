"""Wrong tokens, limited per client address and token bucket: after a few wrong tokens that fall
in one bucket, each further one locks that bucket of that address out for a growing time (1 s,
2 s, 4 s, … up to 5 minutes), during which its tokens are answered 429 with Retry-After,
unchecked.

A token's bucket is a keyed hash of the token sent (BUCKETS of them; the key is random per
process, so no one can tell which tokens share a bucket). A guesser spreads over every bucket and
is slowed in each; the right token sits in one bucket that wrong guesses reach only by chance, so
someone sharing the user's address (loopback, NAT, a proxy) cannot lock it out with a few wrong
tokens: they would have to keep all BUCKETS locked (thousands of wrong tokens). A right token
does not clear its bucket (that would tell a watcher which bucket it is in).

Nothing sleeps: a locked-out attempt is answered at once, so a guesser holds no connection open
and a right token is never slowed. State is in-process, one small entry per address and bucket
that failed, at most MAX_ENTRIES of them (the least recently failing one is dropped first); an
entry with no failure for FORGET_AFTER_S starts afresh. The address is the connection's peer:
`serve` trusts X-Forwarded-For only with --proxy-headers (and from --forwarded-allow-ips).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

FREE_FAILURES = 5  # wrong tokens a bucket of an address may take before its first lockout
FIRST_LOCKOUT_S = 1.0
MAX_LOCKOUT_S = 300.0
FORGET_AFTER_S = 3600.0
BUCKETS = 256  # how a guesser's tokens are spread: a right token shares its bucket with 1/256
MAX_ENTRIES = 100_000  # (address, bucket) pairs remembered: a few MB


@dataclass
class _Failures:
    count: int
    last: float
    locked_until: float


class FailureLimiter:
    """Failed token attempts per client address and token bucket (thread-safe: the Guard and the
    sign-in route share one)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock  # seconds, only ever compared with itself
        self._entries: OrderedDict[tuple[str, int], _Failures] = OrderedDict()
        self._lock = threading.Lock()
        self._key = secrets.token_bytes(32)

    def bucket(self, token: str) -> int:
        """The bucket a token falls in (a keyed hash: the same token, the same bucket)."""
        digest = hmac.new(self._key, token.encode("utf-8", "replace"), hashlib.sha256).digest()
        return int.from_bytes(digest[:4], "big") % BUCKETS

    def retry_after(self, address: str, token: str) -> int:
        """Whole seconds until `token` may be tried from `address` again (0: now)."""
        key = (address, self.bucket(token))
        with self._lock:
            entry = self._entries.get(key)
            wait = 0.0 if entry is None else entry.locked_until - self.clock()
        return math.ceil(wait) if wait > 0 else 0

    def failed(self, address: str, token: str) -> None:
        """Count a wrong `token` from `address`; past FREE_FAILURES in its bucket, the bucket is
        locked out, each time twice as long as the last (up to MAX_LOCKOUT_S)."""
        key = (address, self.bucket(token))
        now = self.clock()
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None or now - entry.last > FORGET_AFTER_S:
                entry = _Failures(count=0, last=now, locked_until=0.0)
            entry.count += 1
            entry.last = now
            over = entry.count - FREE_FAILURES
            if over > 0:
                entry.locked_until = now + min(MAX_LOCKOUT_S, FIRST_LOCKOUT_S * 2 ** (over - 1))
            self._entries[key] = entry  # the most recent at the end
            while len(self._entries) > MAX_ENTRIES:
                self._entries.popitem(last=False)

    def __len__(self) -> int:
        """How many (address, bucket) entries it remembers (at most MAX_ENTRIES)."""
        return len(self._entries)


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
