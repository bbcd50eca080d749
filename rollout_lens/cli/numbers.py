"""Options of the commands, checked as they are read: whole numbers range-checked by argparse (a
run id, step or count past what the databases store is refused naming the option, exit status
2, never an OverflowError from the driver), and a reading command's filters as its query model,
each refusal naming its flag."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from rollout_lens.server.core.errors import InvalidInput

Query = TypeVar("Query", bound=BaseModel)

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


def flags_query(model: type[Query], given: dict[str, Any]) -> Query:
    """The query model of these options' values; InvalidInput naming each refused `--flag`."""
    try:
        return model(**given)
    except ValidationError as exc:
        problems = "; ".join(
            f"--{str(e['loc'][0]).replace('_', '-')}: {e['msg']}" for e in exc.errors()
        )
        raise InvalidInput(problems) from None


def two_places(value: float | None) -> str:
    """A table cell's number: two decimal places, a dash where it is unknown."""
    return "—" if value is None else f"{value:.2f}"
