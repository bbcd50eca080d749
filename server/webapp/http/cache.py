"""A small thread-safe LRU of encoded responses, keyed by a run's version token.

A chart series of a run that has not changed is the same bytes every time: a finished run never
changes, and a training run changes only with a new step (which changes its version). Serving
those bytes from memory makes a reload cost the same whatever the run's length; the first load
after a change still reads the steps (see bench/pages.py for both figures).
"""

from __future__ import annotations

import threading
from collections import OrderedDict


class ResponseCache:
    """Up to `size` bodies; the least recently used goes first. size=0 caches nothing."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes | None:
        with self._lock:
            body = self._items.get(key)
            if body is not None:
                self._items.move_to_end(key)
            return body

    def put(self, key: str, body: bytes) -> None:
        if self.size <= 0:
            return
        with self._lock:
            self._items[key] = body
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)
