"""Waiting for an event, never measuring one: a test asserts what happened, not how fast.

Both helpers have a bound, and it is a hang detector (a generous multiple of the expected wait,
so that a loaded machine never reaches it), not a speed target: speed is bench/'s job."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

T = TypeVar("T")


def until(
    check: Callable[[], T],
    what: str,
    timeout: float = 30.0,
    poll: float = 0.05,
    seen: Callable[[], object] | None = None,
) -> T:
    """Poll `check` until it returns something truthy, and return that; fail naming `what`
    (and what `seen` returns then: the state the test was waiting on)."""
    deadline = time.monotonic() + timeout
    while not (found := check()):
        if time.monotonic() > deadline:
            state = f": {seen()!r}" if seen is not None else ""
            pytest.fail(f"still waiting for {what} after {timeout:g} s{state}")
        time.sleep(poll)
    return found


def returns(call: Callable[[], T], what: str, timeout: float = 60.0) -> T:
    """Run `call` on a thread and wait for it to return (its exception is raised here); a call
    still running after `timeout` fails the test as a hang."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # handed to the test's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, name=f"returns: {what}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        pytest.fail(f"{what} hung: still running after {timeout:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
