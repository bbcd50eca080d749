"""What a run says about one completion besides the training reward: its vote, true score and
format, from a task's judge or from a user's functions."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("rollout_lens")


@dataclass(frozen=True)
class Completion:
    """One rollout as a judge sees it."""

    text: str  # as recorded (a conversation: the whole of it as the model saw it)
    messages: Any  # as TRL handed it to the reward functions: a string or a list of messages
    row: dict[str, Any]  # the dataset row's small columns (not the prompt)
    prompt: Any  # the prompt as the dataset gave it
    truncated: bool  # generation stopped before an end-of-turn token


@dataclass(frozen=True)
class Judgement:
    """A completion's vote, true score and format; None where the run cannot tell."""

    vote: str | None = None
    true_score: float | None = None
    format_valid: bool | None = None
    format_state: str | None = None  # a vocab.FormatState; None: read from the call tags
    format_free: float | None = None  # the answer read leniently, whatever the structure


Judge = Callable[[Completion], Judgement]

# Completion → value functions a user may pass for what TRL does not know. Each is called as
# fn(completion_text, row) where row holds the dataset columns of the prompt (not the prompt).
TextFn = Callable[[str, dict[str, Any]], Any]


class FunctionJudge:
    """A Judge from a user's functions (any of them None: that judgement is unknown). A function
    that raises leaves its judgement empty for that completion and is reported once."""

    def __init__(
        self,
        *,
        vote: TextFn | None = None,
        true_score: TextFn | None = None,
        format_valid: TextFn | None = None,
        format_free: TextFn | None = None,
    ) -> None:
        self.functions = {
            "vote": vote,
            "true_score": true_score,
            "format_valid": format_valid,
            "format_free": format_free,
        }
        self._failed: set[str] = set()

    def given(self, name: str) -> bool:
        return self.functions[name] is not None

    def __call__(self, completion: Completion) -> Judgement:
        said = {key: self._call(key, completion) for key in self.functions}
        return Judgement(
            vote=None if said["vote"] is None else str(said["vote"]),
            true_score=number(said["true_score"]),
            format_valid=None if said["format_valid"] is None else bool(said["format_valid"]),
            format_free=number(said["format_free"]),
        )

    def _call(self, key: str, completion: Completion) -> Any:
        fn = self.functions[key]
        if fn is None:
            return None
        try:
            return fn(completion.text, completion.row)
        except Exception as exc:  # noqa: BLE001 - a user's function must not stop recording
            if key not in self._failed:
                self._failed.add(key)
                log.warning(
                    "Rollout Lens: the %s function raised (recorded as empty): %s", key, exc
                )
            return None


def number(value: Any) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def message_text(completion: Any) -> str:
    """TRL gives a string, or for conversational prompts a list of messages."""
    if isinstance(completion, str):
        return completion
    return "".join(str(message.get("content", "")) for message in completion)
