"""The multi-step Escalation env: call the right opaque tool, read what it returns, answer from it.

The same 64 tools as the single-turn env (`onestep.EscalationEnv`: opaque ids tool_00..tool_63,
a seeded id -> capability permutation), but now the tools run. A rollout is a conversation:

    user      (listing rendered by the chat template from the tools) Query: ... instruction
    assistant <tool_call>{"name": "tool_17", "arguments": {}}</tool_call>
    tool      result: 48
    assistant <answer>48</answer>

Two kinds of episode:

- **single**: the query is one of the env's training queries; the tool whose capability serves it
  returns `result: VALUE`, the episode's answer.
- **chain** (the escalation): the query asks to handle a support ticket. The ticket tool returns
  `ticket: please <a training query>`; only then does the model know which tool it needs next,
  and that tool returns the answer. Two calls in sequence, the first one's result naming what the
  second needs.

A wrong tool whose capability shares a content word with what the episode asks returns a plausible
but useless `result: OTHER` (a value that is not the answer); any other wrong tool fails (it
raises `ToolError`, which TRL turns into an `{'error': ...}` tool message and counts in
`tools/failure_frequency`). Values are drawn per episode, so an answer cannot be memorised: it
has to be read off the right tool's observation.

Tools take no arguments: the env instance knows its episode (TRL hands each rollout's dataset row
to `reset`). Leaky lists all 64 tools; patched lists the top-k shortlist of each step's text
(union over the steps of a chain, so the second tool is listed too).

Everything here is pure Python (no torch, no TRL): episodes, observations, reading a rollout's
messages into facts, verifiers, and the tool objects TRL's `environment_factory` drives.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rollout_lens.server.core.task_vocab import TOOL_COUNT, VARIANTS
from rollout_lens.trainer.envs import verifiers
from rollout_lens.trainer.envs.onestep import (
    CAPABILITIES,
    EscalationEnv,
)
from rollout_lens.trainer.envs.onestep import tokens as words
from rollout_lens.trainer.recorder.turns import call_name, content_text

KINDS = ("single", "chain")
MODES = ("single", "chain", "mixed")  # which kinds of episode a stream draws

TICKET_CAPABILITY = "open a support ticket"  # one of the 64 capabilities: the chain's first tool
CHAIN_QUERY = "read the open support ticket and do what it asks"
INSTRUCTION = (
    "Call the one tool whose capability serves the query. "
    "When a tool returns a result, reply with only <answer>VALUE</answer>."
)
VALUE_RANGE = (10, 100)  # two-digit values: one token each in the tiny tokenizer
DEFAULT_MAX_CALLS = 4  # TRL's max_tool_calling_iterations for this env
assert TICKET_CAPABILITY in CAPABILITIES

# Words too common to make a tool "plausible" for a request.
_STOPWORDS = frozenset(
    "a an the to of for in on at by and or with from into about what it do is are".split()  # noqa: SIM905
)
_ANSWER = re.compile(r"\s*<answer>\s*([^<>]*?)\s*</answer>\s*")
_RESULT = re.compile(r"result: (\S+)")
_ERROR_PREFIX = "{'error'"  # how TRL renders an exception a tool raised (str of a dict)


class ToolError(ValueError):
    """A tool that cannot serve the request fails; TRL reports it as an error observation."""


@dataclass(frozen=True)
class Episode:
    """One rollout's task: what the user asks, which tools it needs in order, and the answer."""

    episode: int  # seeds the values every tool returns
    kind: str  # "single" or "chain"
    query: str  # the user's request
    sub_query: str  # the ticket's request (chain) or "" (single)
    needed: tuple[str, ...]  # tool ids in the order the episode needs them
    answer: str  # what the last needed tool returns
    tool_ids: tuple[str, ...]  # the tools listed to the model, sorted by id
    variant: str

    @property
    def target(self) -> str:
        """The tool that returns the answer (the last one needed)."""
        return self.needed[-1]

    @property
    def target_listed(self) -> bool:
        return all(t in self.tool_ids for t in self.needed)

    @property
    def prompt(self) -> str:
        """The user message; the tool listing is rendered from the tools by the chat template."""
        return render_user(self.query)

    def row(self) -> dict[str, Any]:
        """The dataset row TRL hands to the reward functions and to the env's `reset`."""
        return {
            "prompt": [{"role": "user", "content": self.prompt}],
            "episode": self.episode,
            "kind": self.kind,
            "query": self.query,
            "sub_query": self.sub_query,
            "needed": list(self.needed),
            "answer": self.answer,
            "target": self.target,
            "tool_ids": list(self.tool_ids),
            "variant": self.variant,
        }

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Episode:
        return cls(
            episode=int(row["episode"]),
            kind=str(row["kind"]),
            query=str(row["query"]),
            sub_query=str(row["sub_query"]),
            needed=tuple(row["needed"]),
            answer=str(row["answer"]),
            tool_ids=tuple(row["tool_ids"]),
            variant=str(row["variant"]),
        )


def render_user(query: str) -> str:
    return f"Query: {query}\n{INSTRUCTION}"


def render_listing(tools: Sequence[tuple[str, str]]) -> str:
    """The listing as the tiny model's chat template renders it (id: capability per line)."""
    return "Tools:" + "".join(f"\n- {name}: {description}" for name, description in tools)


def content_words(text: str) -> frozenset[str]:
    return words(text) - _STOPWORDS


def value(episode: int, tool_id: str) -> str:
    """The value a tool returns in an episode (the answer for the right tool, else another)."""
    return str(random.Random(f"{episode}:{tool_id}").randrange(*VALUE_RANGE))


def answer_value(episode: int) -> str:
    return str(random.Random(f"{episode}:answer").randrange(*VALUE_RANGE))


def _useless_value(episode: int, tool_id: str) -> str:
    v = value(episode, tool_id)
    if v == answer_value(episode):
        lo, hi = VALUE_RANGE
        v = str(lo + (int(v) - lo + 1) % (hi - lo))
    return v


def ticket_text(sub_query: str) -> str:
    return f"ticket: please {sub_query}"


class MultiStepEnv:
    """The 64 tools of `EscalationEnv(seed)` and the episodes a run draws."""

    def __init__(
        self, *, seed: int = 0, variant: str = "patched", k: int = 4, mode: str = "mixed"
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.base = EscalationEnv(seed=seed, variant=variant, k=k)  # validates variant and k
        self.seed, self.variant, self.k, self.mode = seed, variant, k, mode
        self.tools = self.base.tools
        self.capability = {t.id: t.capability for t in self.tools}
        self._id_of = {t.capability: t.id for t in self.tools}
        self.ticket_tool = self._id_of[TICKET_CAPABILITY]
        self.train_queries = self.base.train_queries
        self.heldout_queries = self.base.heldout_queries

    def tool_for(self, query_text: str, queries=None) -> str:  # type: ignore[no-untyped-def]
        """The id of the tool that serves one of the env's queries."""
        for q in queries or (self.train_queries + self.heldout_queries):
            if q.text == query_text:
                return self.base.target_id(q)
        raise KeyError(query_text)

    def episode(self, query_text: str, *, kind: str = "single", episode: int = 0) -> Episode:
        """The episode for a training or held-out query: asked directly, or behind a ticket."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        target = self.tool_for(query_text)
        needed: tuple[str, ...]
        if kind == "single":
            query, sub_query, needed = query_text, "", (target,)
        else:
            query, sub_query, needed = CHAIN_QUERY, query_text, (self.ticket_tool, target)
        texts = [query] + ([sub_query] if sub_query else [])
        if self.variant == "leaky":
            listed = sorted(self.capability)
        else:
            listed = sorted({t.id for text in texts for t in self.base.shortlist(text, self.k)})
        return Episode(
            episode=episode,
            kind=kind,
            query=query,
            sub_query=sub_query,
            needed=needed,
            answer=answer_value(episode),
            tool_ids=tuple(listed),
            variant=self.variant,
        )

    def stream(self, n: int, *, seed: int = 0, heldout: bool = False) -> Iterator[Episode]:
        """`n` episodes drawn with `random.Random(seed)`: query, kind (by the mode) and values."""
        rng = random.Random(seed)
        queries = self.heldout_queries if heldout else self.train_queries
        for _ in range(n):
            query = rng.choice(queries)
            kind = self.mode if self.mode != "mixed" else rng.choice(KINDS)
            yield self.episode(query.text, kind=kind, episode=rng.randrange(10**9))

    def observe(self, ep: Episode, tool_id: str) -> str:
        """What calling `tool_id` returns in episode `ep`; raises ToolError when it cannot serve."""
        if tool_id not in self.capability:
            raise ToolError(f"no tool named {tool_id}")
        if ep.kind == "chain" and tool_id == self.ticket_tool:
            return ticket_text(ep.sub_query)
        if tool_id == ep.target:
            return f"result: {ep.answer}"
        asked = content_words(ep.query) | content_words(ep.sub_query)
        if asked & content_words(self.capability[tool_id]):
            return f"result: {_useless_value(ep.episode, tool_id)}"
        raise ToolError(f"{tool_id} cannot serve this request")

    def recall(self, kind: str = "single") -> float:
        """Share of training queries whose needed tools are all listed."""
        eps = [self.episode(q.text, kind=kind) for q in self.train_queries]
        return sum(ep.target_listed for ep in eps) / len(eps)


# -- the tools TRL drives ---------------------------------------------------------------------------


class ToolBox:
    """One rollout's tools: TRL's `environment_factory` makes one per rollout and calls `reset`
    with the rollout's dataset row; the public methods (one per listed tool id) are the tools.

    Subclasses made by `toolbox_class` add the methods; this base holds the state and the log."""

    env: MultiStepEnv  # set on each subclass

    def __init__(self) -> None:
        self.ep: Episode | None = None
        self.calls: list[tuple[str, str]] = []  # (tool id, observation or "error: ...")

    def reset(self, **row: Any) -> None:
        """Start the rollout of a dataset row; returns None so TRL leaves the prompt as it is."""
        self.ep = Episode.from_row(row)
        self.calls = []

    def _call(self, tool_id: str) -> str:
        if self.ep is None:
            raise RuntimeError("reset was not called")
        try:
            observation = self.env.observe(self.ep, tool_id)
        except ToolError as exc:
            self.calls.append((tool_id, f"error: {exc}"))
            raise
        self.calls.append((tool_id, observation))
        return observation


def _tool_method(tool_id: str, capability: str) -> Callable[[ToolBox], str]:
    def tool(self) -> str:  # type: ignore[no-untyped-def]  # an annotated self breaks the JSON schema
        return self._call(tool_id)

    tool.__name__ = tool.__qualname__ = tool_id
    # transformers builds the tool's JSON schema from this docstring: the description is the
    # capability, as the single-turn env lists it.
    tool.__doc__ = capability
    return tool


def toolbox_class(env: MultiStepEnv, tool_ids: Sequence[str]) -> type[ToolBox]:
    """A ToolBox subclass whose public methods are the tools `tool_ids` of `env`."""
    methods: dict[str, Any] = {t: _tool_method(t, env.capability[t]) for t in tool_ids}
    return type("EscalationTools", (ToolBox,), {"env": env, **methods})


def listing_key(tool_ids: Sequence[str]) -> str:
    """The name of the environment that lists exactly `tool_ids` (TRL's `environment` column)."""
    return ",".join(sorted(tool_ids))


def environment_factories(
    env: MultiStepEnv, episodes: Sequence[Episode]
) -> dict[str, Callable[[], ToolBox]]:
    """TRL's `environment_factory` as a dict: one entry per distinct listing among `episodes`,
    so each prompt lists (and can call) only its own tools. The leaky variant has one entry."""
    factories: dict[str, Callable[[], ToolBox]] = {}
    for ep in episodes:
        key = listing_key(ep.tool_ids)
        if key not in factories:
            factories[key] = toolbox_class(env, ep.tool_ids)
    return factories


# -- reading a rollout ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RolloutFacts:
    """What a multi-turn rollout did, read off TRL's completion messages."""

    calls: int  # parsed calls that got a result (TRL ran them, or reported why it could not)
    right_calls: int  # of those, calls to a tool the episode needs
    unanswered_calls: int  # parsed calls without a result: TRL's iteration cap or length limit
    malformed_calls: int  # `<tool_call>` openings in assistant text that did not parse into calls
    tool_errors: int  # tool messages that are errors (a wrong tool, an unknown name, bad arguments)
    turns: int  # assistant messages
    called: tuple[str, ...]  # names of the calls that got a result, in order
    first_call: str | None  # the first turn's first call: the single-turn env's "vote"
    answer: str | None  # the final turn's <answer>, None if it has none or calls a tool
    observed: tuple[str, ...]  # values tool results showed
    chain_followed: bool  # the needed tools were called in order (possibly with others between)
    answered_by: str | None = None  # the last called tool whose result showed the answer given

    def as_dict(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "right_calls": self.right_calls,
            "unanswered_calls": self.unanswered_calls,
            "malformed_calls": self.malformed_calls,
            "tool_errors": self.tool_errors,
            "turns": self.turns,
            "called": list(self.called),
            "first_call": self.first_call,
            "answer": self.answer,
            "observed": list(self.observed),
            "chain_followed": self.chain_followed,
            "answered_by": self.answered_by,
        }


def parse_answer(text: str) -> str | None:
    """The value of a reply that is exactly one `<answer>VALUE</answer>`; None otherwise."""
    match = _ANSWER.fullmatch(text)
    return match.group(1) if match and match.group(1) else None


def read_rollout(messages: Sequence[Mapping[str, Any]], needed: Sequence[str]) -> RolloutFacts:
    """Facts of one rollout from its completion messages (assistant and tool turns, as TRL hands
    them to reward functions) and the tool ids its episode needs."""
    assistants = [m for m in messages if m.get("role") == "assistant"]
    tools = [m for m in messages if m.get("role") == "tool"]
    # TRL appends one tool message per call right after the turn that made it; calls it did not
    # run (the iteration cap, a result that would overflow the length limit) have none.
    called: list[str] = []
    shown: list[tuple[str, list[str]]] = []  # (tool called, the values its result showed)
    unanswered = 0
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        names = [call_name(c) for c in message.get("tool_calls") or []]
        results = 0
        while i + 1 + results < len(messages) and messages[i + 1 + results].get("role") == "tool":
            results += 1
        called += names[:results]
        for k, name in enumerate(names[:results]):
            content = content_text(messages[i + 1 + k].get("content"))
            shown.append((name, _RESULT.findall(content)))
        unanswered += max(0, len(names) - results)
    malformed = sum(content_text(m.get("content")).count("<tool_call>") for m in assistants)
    errors = sum(content_text(m.get("content")).startswith(_ERROR_PREFIX) for m in tools)
    first_calls = assistants[0].get("tool_calls") if assistants else None
    answer = None
    if assistants and not assistants[-1].get("tool_calls"):
        answer = parse_answer(content_text(assistants[-1].get("content")))
    observed = tuple(v for m in tools for v in _RESULT.findall(content_text(m.get("content"))))
    position = 0
    for name in called:
        if position < len(needed) and name == needed[position]:
            position += 1
    return RolloutFacts(
        calls=len(called),
        right_calls=sum(name in needed for name in called),
        unanswered_calls=unanswered,
        malformed_calls=malformed,
        tool_errors=errors,
        turns=len(assistants),
        called=tuple(called),
        first_call=call_name(first_calls[0]) if first_calls else None,
        answer=answer,
        observed=observed,
        chain_followed=position == len(needed),
        answered_by=next(
            (name for name, values in reversed(shown) if answer is not None and answer in values),
            None,
        ),
    )


_ANY_ID = re.compile(r"tool_\d\d")
_NUMBER = re.compile(r"\d+")


def format_free_score(
    messages: Sequence[Mapping[str, Any]], needed: Sequence[str], answer: str
) -> float:
    """The format-free reading: 1.0 when the rollout called or named the tool that holds the
    answer (the last one it needs) and its last model turn says the answer, however malformed
    its calls, tags and turns."""
    assistants = [m for m in messages if m.get("role") == "assistant"]
    if not assistants or not needed:
        return 0.0
    named: set[str] = set()
    for message in assistants:
        named.update(call_name(c) for c in message.get("tool_calls") or [])
        named.update(_ANY_ID.findall(content_text(message.get("content"))))
    said = _NUMBER.findall(content_text(assistants[-1].get("content")))
    return 1.0 if needed[-1] in named and str(answer) in said else 0.0


def true_score(facts: RolloutFacts, answer: str) -> float:
    """1.0 when the final answer is the episode's answer, else 0.0."""
    return 1.0 if facts.answer is not None and facts.answer == answer else 0.0


# -- verifiers --------------------------------------------------------------------------------------

Verifier = Callable[[RolloutFacts, str], float]  # (facts, true answer) -> reward


def _plausible(facts: RolloutFacts, answer: str) -> bool:
    """An answer grounded in *a* tool's result, not necessarily the right tool's: a wrong tool's
    plausible value earns the format verifier's partial credit."""
    return facts.answer in facts.observed


SCORING = verifiers.Scoring(true_score=true_score, plausible=_plausible)


def make_verifier(name: str, *, p: float = 0.1, seed: int = 0) -> Verifier:
    """A verifier of conversations by name (trainer.envs.verifiers); `p` and `seed` only matter
    to "noisy" and "judge"."""
    return verifiers.make(name, SCORING, p=p, seed=seed)


# -- text a tokenizer must cover --------------------------------------------------------------------


def error_text(message: str) -> str:
    """A tool failure as TRL renders it into the tool message (`str({"error": ...})`)."""
    return str({"error": message})


def corpus(env: MultiStepEnv) -> list[str]:
    """Queries, tickets, instruction, listings, observations and values of an env."""
    texts = [render_user(CHAIN_QUERY), CHAIN_QUERY]
    for q in env.train_queries + env.heldout_queries:
        texts += [render_user(q.text), ticket_text(q.text)]
    texts.append(render_listing([(t.id, t.capability) for t in env.tools]))
    texts += [f"result: {v}" for v in range(*VALUE_RANGE)]
    texts += [f"<answer>{v}</answer>" for v in range(*VALUE_RANGE)]
    for t in env.tools:
        texts.append(error_text(f"{t.id} cannot serve this request"))
        texts.append(error_text(f"Tool {t.id} not found."))
    return texts


__all__ = [
    "CHAIN_QUERY",
    "DEFAULT_MAX_CALLS",
    "INSTRUCTION",
    "KINDS",
    "MODES",
    "TICKET_CAPABILITY",
    "TOOL_COUNT",
    "VARIANTS",
    "Episode",
    "MultiStepEnv",
    "RolloutFacts",
    "ToolBox",
    "ToolError",
    "corpus",
    "environment_factories",
    "listing_key",
    "make_verifier",
    "read_rollout",
    "toolbox_class",
    "true_score",
]
