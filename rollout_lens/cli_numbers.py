"""Whole-number options of the commands, range-checked by argparse as they are parsed: a run id,
step or count past what the databases store is refused naming the option (exit status 2), never
an OverflowError from the driver."""

from __future__ import annotations

import argparse
from collections.abc import Callable

MAX_INT32 = 2**31 - 1  # ids, steps and counts are 32-bit columns


def whole(lo: int, hi: int = MAX_INT32) -> Callable[[str], int]:
    """An argparse type: a whole number from lo to hi."""

    def parse(text: str) -> int:
        try:
            value = int(text) if len(text) <= 20 else None
        except ValueError:
            value = None
        if value is None or not lo <= value <= hi:
            raise argparse.ArgumentTypeError(
                f"a whole number from {lo} to {hi:,}, not {text[:40]!r}"
            )
        return value

    parse.__name__ = "whole number"  # argparse names the type in its message
    return parse


RUN_ID = whole(1)
COUNT = whole(0)
POSITIVE = whole(1)
