"""What a prompt's groups say, as pure rules: a group's figures (solved by majority, zero spread,
agreement, votes), a prompt's history folded group by group (first solved, last failed, flips),
and what tells a prompt apart (its query, its last user turn, its chat messages).

A group is *solved by majority* when more than half of its rollouts that have a true score are
truly correct (true score ≥ 1, as the step viewer counts `correct`); unknown (None) when none has
a true score. It *failed* when it has true scores and is not solved. A *flip* is a group whose
state (solved or failed) differs from the prompt's previous group with a known state, in (step,
group) order. *Zero spread*: every rollout got the same verifier reward (no gradient;
trainer.recorder.metrics.is_zero_std). *Agreement*: the share of the group voting for its
modal vote (a malformed vote, None, never agrees).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

SPREAD_EPS = 1e-9  # rewards closer than this are equal (metrics.is_zero_std)
CORRECT = 1.0  # a true score at least this is truly correct
STUCK_SHARE = 0.5  # `stuck`: at least this share of its groups without spread, never solved
FLIPPING_FLIPS = 2  # `flipping`: at least this many flips (learned once is one flip)
LABEL_CHARS = 500  # a prompt's stored label (its query, else its last user turn): its head
MALFORMED = "None"  # a malformed vote's key in a {vote: count} object (JSON keys are text)

Votes = list[tuple[str | None, int]]  # (vote, count), most first, malformed last


@dataclass(frozen=True)
class GroupFigures:
    """One group's figures from its rollouts' rewards, true scores and votes."""

    size: int
    reward_mean: float | None
    reward_min: float | None
    reward_max: float | None
    reward_n: int  # rewards that are numbers
    true_n: int  # rollouts with a true score
    true_mean: float | None
    correct: int
    solved: bool | None
    zero_spread: bool
    agreement: float | None
    votes: Votes


def _finite(values: Iterable[float | None]) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(v)]


def _count_votes(votes: Iterable[str | None]) -> Votes:
    """(vote, count) pairs: most first, ties by vote, malformed (None) last."""
    counts = Counter(votes)
    return sorted(counts.items(), key=lambda kv: (kv[0] is None, -kv[1], kv[0] or ""))


def group_figures(
    rewards: Sequence[float | None],
    true_scores: Sequence[float | None],
    votes: Sequence[str | None],
) -> GroupFigures:
    """A group's figures (see the module docstring) from its rollouts' values, any order."""
    size = len(rewards)
    got = _finite(rewards)
    known = _finite(true_scores)
    correct = sum(1 for s in known if s >= CORRECT)
    counted = _count_votes(votes)
    agree = max((c for v, c in counted if v is not None), default=0)
    return GroupFigures(
        size=size,
        reward_mean=sum(got) / len(got) if got else None,
        reward_min=min(got) if got else None,
        reward_max=max(got) if got else None,
        reward_n=len(got),
        true_n=len(known),
        true_mean=sum(known) / len(known) if known else None,
        correct=correct,
        solved=(2 * correct > len(known)) if known else None,
        zero_spread=(max(got) - min(got) < SPREAD_EPS) if got else True,
        agreement=agree / size if size else None,
        votes=counted,
    )


@dataclass
class PromptFold:
    """A prompt's groups folded in (step, group) order: what the prompts list shows of it."""

    groups: int = 0
    rollouts: int = 0
    first_step: int | None = None
    last_step: int | None = None
    last_group: int | None = None
    reward_sum: float = 0.0
    reward_n: int = 0
    true_sum: float = 0.0
    true_n: int = 0
    solved_groups: int = 0
    solved_at: int | None = None  # first step a group of it was solved by majority
    last_solved: int | None = None
    last_failed: int | None = None  # last step a group of it failed
    state: bool | None = None  # the last known group's: solved (True) or failed (False)
    flips: int = 0
    zero_spread: int = 0  # groups with zero reward spread
    votes: dict[str | None, int] = field(default_factory=dict)

    def follows(self, step: int, group: int) -> bool:
        """Whether (step, group) comes after every group folded in (else fold again)."""
        return self.last_step is None or (step, group) > (self.last_step, self.last_group or 0)

    def add(self, step: int, group: int, g: GroupFigures) -> None:
        """Fold in the next group (follows(step, group) must hold)."""
        self.groups += 1
        self.rollouts += g.size
        if self.first_step is None:
            self.first_step = step
        self.last_step, self.last_group = step, group
        if g.reward_mean is not None:
            self.reward_sum += g.reward_mean * g.reward_n
            self.reward_n += g.reward_n
        if g.true_mean is not None:
            self.true_sum += g.true_mean * g.true_n
            self.true_n += g.true_n
        if g.solved is not None:
            if self.state is not None and self.state != g.solved:
                self.flips += 1
            self.state = g.solved
            if g.solved:
                self.solved_groups += 1
                self.last_solved = step
                if self.solved_at is None:
                    self.solved_at = step
            else:
                self.last_failed = step
        if g.zero_spread:
            self.zero_spread += 1
        for vote, count in g.votes:
            self.votes[vote] = self.votes.get(vote, 0) + count

    @property
    def reward_mean(self) -> float | None:
        return self.reward_sum / self.reward_n if self.reward_n else None

    @property
    def true_mean(self) -> float | None:
        return self.true_sum / self.true_n if self.true_n else None

    @property
    def zero_spread_share(self) -> float | None:
        return self.zero_spread / self.groups if self.groups else None

    def vote_pairs(self) -> Votes:
        return _count_votes_from(self.votes)


def _count_votes_from(counts: dict[str | None, int]) -> Votes:
    """A {vote: count} dict as _count_votes orders it."""
    return sorted(counts.items(), key=lambda kv: (kv[0] is None, -kv[1], kv[0] or ""))


def votes_object(pairs: Iterable[Sequence[Any]]) -> dict[str, int]:
    """(vote, count) pairs as a JSON object, in their order, a malformed vote under MALFORMED."""
    return {MALFORMED if v is None else str(v): int(c) for v, c in pairs}


def forgotten(solved_at: int | None, last_failed: int | None) -> bool:
    """Solved by majority, then failed at a later step."""
    return solved_at is not None and last_failed is not None and last_failed > solved_at


# --- what tells a prompt apart -----------------------------------------------------------------

# Chat templates as rendered text: a turn's opening (its role the group) and its end (its role
# put in for {}: the tiny models' tags close by their role's name). ChatML (Qwen, SmolLM), Llama 3,
# Gemma, Phi-3; a prompt in none of them is one user turn.
_TEMPLATES = (
    (re.compile(r"<\|im_start\|>(\w+)\n"), "<|im_end|>"),
    (re.compile(r"<\|start_header_id\|>(\w+)<\|end_header_id\|>\n\n"), "<|eot_id|>"),
    (re.compile(r"<start_of_turn>(\w+)\n"), "<end_of_turn>"),
    (re.compile(r"<\|(system|user|assistant)\|>\n?"), "<|end|>"),
    # tags named by their role, closed by the same name (the tiny models' <user>…</user>
    # <assistant>, their <tool_response> turns)
    (re.compile(r"<(system|user|assistant|tool_response)>"), "</{}>"),
)
_ROLES = {"model": "assistant", "tool_response": "tool"}  # Gemma's; the tiny models'


def _turns(text: str, opening: re.Pattern[str], end: str) -> list[tuple[str, str]]:
    """(role, text) of each turn: an opening, then its text up to the turn's end, else to the
    text's end. What one regex `opening(.*?)(?:end|$)` finds, the turn's text found by
    str.find: a lazy repeat tried at every character took 0.1 ms a 4 KB prompt."""
    found = []
    at = 0
    while (opened := opening.search(text, at)) is not None:
        close = end.format(opened.group(1))
        stop = text.find(close, opened.end())
        if stop < 0:
            found.append((opened.group(1), text[opened.end() :]))
            break
        found.append((opened.group(1), text[opened.end() : stop]))
        at = stop + len(close)
    return found


def chat_messages(text: str) -> list[dict[str, str]]:
    """A rendered prompt's turns as chat messages ({role, content}), as a TRL dataset's
    `prompt` column holds them; an empty generation turn at its end is left out. A text in no
    known template is one user message."""
    for opening, end in _TEMPLATES:
        found = _turns(text, opening, end)
        if found:
            messages = [
                {"role": _ROLES.get(role, role), "content": content.strip("\n")}
                for role, content in found
            ]
            while messages and messages[-1]["role"] == "assistant" and not messages[-1]["content"]:
                messages.pop()
            if messages:
                return messages
    return [{"role": "user", "content": text}]


def last_user_turn(text: str) -> str:
    """The prompt's last user message (chat_messages), else its whole text."""
    users = [m["content"] for m in chat_messages(text) if m["role"] == "user"]
    return users[-1] if users else text


def recorded_query(meta: dict[str, Any]) -> str | None:
    """The query a rollout's meta names (the env's `query`, or its dataset row's), as the step
    viewer labels a group; None when it names none."""
    value = meta.get("query")
    if not isinstance(value, str) or not value.strip():
        row = meta.get("row")
        value = row.get("query") if isinstance(row, dict) else None
    return value if isinstance(value, str) and value.strip() else None
