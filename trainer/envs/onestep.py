"""The Escalation tool-selection env: pick the one tool whose capability matches a query."""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from rollout_lens.server.core.task_vocab import TOOL_COUNT, VARIANTS
from rollout_lens.trainer.envs import verifiers

REPLY_FORMATS = ("tag", "bracket", "json")

# (capability, training query, held-out paraphrases). Each training query shares more words with
# its target's capability than with all but at most three other tools, so top-4 retrieval always
# lists the target whatever the id permutation does to tie-breaks (checked for every seed tested).
_TASKS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (
        "evaluate an arithmetic expression",
        "evaluate 17 * 38",
        ("what is 17 times 38", "use arithmetic to evaluate 17 times 38"),
    ),
    (
        "look up a fact in an encyclopedia",
        "look up who wrote hamlet",
        ("find out who wrote the play hamlet", "which encyclopedia fact says who wrote hamlet"),
    ),
    (
        "translate text between languages",
        "translate good morning into french",
        ("how do you say good morning in french", "translate the text thank you to german"),
    ),
    (
        "get the weather forecast for a city",
        "get the weather forecast for paris",
        ("will it rain in paris tomorrow", "what does the forecast say for paris this weekend"),
    ),
    (
        "convert between units of measure",
        "convert 5 miles to metric units",
        ("how many kilometers are in 5 miles", "what is 5 miles in units of kilometers"),
    ),
    (
        "send an email message",
        "send an email to alice about the meeting",
        ("email alice that the meeting moved", "write alice an email message about the meeting"),
    ),
    (
        "search the web for recent news",
        "search for recent news about the mars rover",
        ("what happened lately with the mars rover", "find the latest news on the mars rover"),
    ),
    (
        "set a reminder for a time",
        "set a reminder to call mom at 6 pm",
        ("remind me to call mom at 6 pm", "create a reminder to call mom this evening"),
    ),
    (
        "look up a word in a dictionary",
        "define the word ephemeral using a dictionary",
        ("what does ephemeral mean", "find ephemeral in a dictionary"),
    ),
    (
        "play a song by an artist",
        "play the song yesterday by the beatles",
        ("put on the beatles track yesterday", "play yesterday by the beatles"),
    ),
    (
        "book a table at a restaurant",
        "book a table for two at an italian restaurant",
        ("reserve dinner for two at an italian restaurant", "get us a table at luigi's tonight"),
    ),
    (
        "get the current price of a stock",
        "get the current stock price of apple",
        ("how much is one apple share right now", "what is the price of apple shares today"),
    ),
)

# Distractors that share words with the queries: the confusable neighbours a shortlist surfaces.
_NEAR_MISSES = (
    "miscellaneous tool number 17",
    "miscellaneous tool number 38",
    "miscellaneous tool number 5",
    "simplify an algebraic expression",
    "look up a phone number in a directory",
    "look up a word in a thesaurus",
    "detect the language of a text",
    "get the weather history for a city",
    "get the population of a city",
    "convert a document between file formats",
    "convert between time zones",
    "convert an amount between currencies",
    "send a text message to a phone",
    "schedule a meeting in a calendar",
    "search the web for images",
    "set a timer for a duration",
    "set an alarm for the morning",
    "play a video from a channel",
    "book a flight to a city",
    "get the current exchange rate of a currency",
)

# Fillers that share few words with any query (the format warm-up asks for them: envs.warmup).
FILLERS = (
    "resize an image to new dimensions",
    "compress files into an archive",
    "generate a random password",
    "check the spelling of a sentence",
    "count the words in a document",
    "summarize a long article",
    "find a route between two places",
    "scan a barcode",
    "record a voice memo",
    "roll a dice",
    "flip a coin",
    "list files in a folder",
    "rename a file on disk",
    "shorten a long link",
    "generate a qr code",
    "track a parcel delivery",
    "show the phase of the moon",
    "find nearby petrol stations",
    "calculate a mortgage payment",
    "check the status of a server",
    "start a stopwatch",
    "tell a random joke",
    "suggest a recipe from ingredients",
    "test internet connection speed",
    "extract text from a scanned image",
    "open a support ticket",
    "post to a chat channel",
    "rate a movie",
    "sort a list of numbers",
    "validate a postal address",
    "order a taxi ride",
    "pay a utility bill",
)

CAPABILITIES: tuple[str, ...] = tuple(cap for cap, _, _ in _TASKS) + _NEAR_MISSES + FILLERS
assert len(CAPABILITIES) == TOOL_COUNT == len(set(CAPABILITIES))

_INSTRUCTIONS = {
    "tag": "Reply with only <tool>ID</tool> for the one tool whose capability matches the query.",
    "bracket": "Reply with only [ID] for the one tool whose capability matches the query.",
    "json": 'Reply with only {"tool": "ID"} for the one tool whose capability matches the query.',
}
_REPLY_TEMPLATES = {"tag": "<tool>{}</tool>", "bracket": "[{}]", "json": '{{"tool": "{}"}}'}
_ID = r"(tool_\d{2})"
_REPLY_PATTERNS = {
    "tag": re.compile(rf"\s*<tool>{_ID}</tool>\s*"),
    "bracket": re.compile(rf"\s*\[{_ID}\]\s*"),
    "json": re.compile(rf'\s*\{{\s*"tool"\s*:\s*"{_ID}"\s*\}}\s*'),
}
_WORD = re.compile(r"\w+")


@dataclass(frozen=True)
class Tool:
    """One tool: an opaque id and the capability it is listed with."""

    id: str
    capability: str


@dataclass(frozen=True)
class Query:
    """A natural-language request and the capability that serves it."""

    text: str
    capability: str
    hint: str


@dataclass(frozen=True)
class Example:
    """One prompt with its target, ready for a rollout."""

    query: str
    prompt: str
    target: str
    tool_ids: tuple[str, ...]
    target_listed: bool
    hint: str
    reply_format: str = "tag"


def tokens(text: str) -> frozenset[str]:
    """Lowercase word tokens, the unit of the retrieval's overlap score."""
    return frozenset(_WORD.findall(text.lower()))


def reply(tool_id: str, reply_format: str = "tag") -> str:
    """The well-formed reply naming `tool_id` in a reply format."""
    return _REPLY_TEMPLATES[_check_format(reply_format)].format(tool_id)


def _check_format(reply_format: str) -> str:
    if reply_format not in REPLY_FORMATS:
        raise ValueError(f"reply_format must be one of {REPLY_FORMATS}, got {reply_format!r}")
    return reply_format


def render_prompt(listed: Sequence[Tool], query_text: str, reply_format: str = "tag") -> str:
    """The user message listing `listed` tools for a query, in the seed's format."""
    listing = "\n".join(f"- {t.id}: {t.capability}" for t in listed)
    return f"Tools:\n{listing}\nQuery: {query_text}\n{_INSTRUCTIONS[_check_format(reply_format)]}"


def _hint(capability: str) -> str:
    return f"Hint: the query needs the tool that can {capability}."


class EscalationEnv:
    """64 tools behind opaque ids; prompts list all of them (leaky) or the top k (patched)."""

    def __init__(self, *, seed: int = 0, variant: str = "patched", k: int = 4) -> None:
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= TOOL_COUNT:
            raise ValueError(f"k must be an integer from 1 to {TOOL_COUNT}, got {k!r}")
        self.seed, self.variant, self.k = seed, variant, k
        # The id -> capability map is a seeded permutation, so ids carry no meaning across seeds.
        order = list(CAPABILITIES)
        random.Random(seed).shuffle(order)
        self.tools: tuple[Tool, ...] = tuple(
            Tool(f"tool_{i:02d}", cap) for i, cap in enumerate(order)
        )
        self._id_of = {t.capability: t.id for t in self.tools}
        self._leaky_order = list(self.tools)
        random.Random(f"{seed}:leaky").shuffle(self._leaky_order)
        self.train_queries: tuple[Query, ...] = tuple(
            Query(text, cap, _hint(cap)) for cap, text, _ in _TASKS
        )
        self.heldout_queries: tuple[Query, ...] = tuple(
            Query(text, cap, _hint(cap)) for cap, _, paraphrases in _TASKS for text in paraphrases
        )

    def target_id(self, query: Query) -> str:
        """The id of the tool whose capability serves `query`."""
        return self._id_of[query.capability]

    def shortlist(self, query_text: str, k: int) -> list[Tool]:
        """Top-k tools by word overlap with the query; ties go to the lower id."""
        q = tokens(query_text)
        return sorted(self.tools, key=lambda t: (-len(q & tokens(t.capability)), t.id))[:k]

    def example(self, query: Query, *, reply_format: str = "tag") -> Example:
        """The prompt for `query` under this env's variant."""
        return self._example(query, self.variant, reply_format)

    def _example(self, query: Query, variant: str, reply_format: str) -> Example:
        if variant == "leaky":
            listed = self._leaky_order
        else:
            listed = self.shortlist(query.text, self.k)
            # Retrieval ranks the target high; shuffle so list position is not a shortcut.
            random.Random(f"{self.seed}:{query.text}").shuffle(listed)
        prompt = render_prompt(listed, query.text, reply_format)
        target = self.target_id(query)
        ids = tuple(t.id for t in listed)
        return Example(query.text, prompt, target, ids, target in ids, query.hint, reply_format)

    def stream(self, n: int, *, seed: int = 0) -> Iterator[Example]:
        """`n` training examples, queries drawn with `random.Random(seed)`."""
        rng = random.Random(seed)
        for _ in range(n):
            yield self.example(rng.choice(self.train_queries))

    def recall(self) -> float:
        """Share of training queries whose target makes their top-k shortlist."""
        hits = sum(
            self.target_id(q) in {t.id for t in self.shortlist(q.text, self.k)}
            for q in self.train_queries
        )
        return hits / len(self.train_queries)


def parse_vote_format(completion: str, reply_format: str) -> str | None:
    """The id a completion names in `reply_format`; None unless it is exactly one such call."""
    match = _REPLY_PATTERNS[_check_format(reply_format)].fullmatch(completion)
    return match.group(1) if match else None


def parse_vote(completion: str) -> str | None:
    """The id named by a `<tool>ID</tool>` reply; None when malformed."""
    return parse_vote_format(completion, "tag")


_ANY_ID = re.compile(r"tool_\d\d")


def lenient_vote(completion: str) -> str | None:
    """The first tool id a completion names, whatever the structure around it: the format-free
    reading, which a collapse of the tags does not hide."""
    match = _ANY_ID.search(completion)
    return match.group(0) if match else None


def true_score(vote: str | None, target: str) -> float:
    """1.0 for an exact match with the target, else 0.0."""
    return 1.0 if vote is not None and vote == target else 0.0


def format_valid(completion: str, tool_ids: Sequence[str], reply_format: str = "tag") -> bool:
    """Whether the completion is a well-formed reply naming one of the listed ids."""
    return parse_vote_format(completion, reply_format) in tool_ids


Verifier = Callable[[str, Example], float]


def _plausible(completion: str, example: Example) -> bool:
    """A well-formed reply naming a listed id: the format verifier's partial credit."""
    return parse_vote_format(completion, example.reply_format) in example.tool_ids


def _true_score(completion: str, example: Example) -> float:
    return true_score(parse_vote_format(completion, example.reply_format), example.target)


SCORING = verifiers.Scoring(true_score=_true_score, plausible=_plausible)


def make_verifier(name: str, *, p: float = 0.1, seed: int = 0) -> Verifier:
    """A verifier of replies by name (trainer.envs.verifiers); `p` and `seed` only matter to
    "noisy" and "judge"."""
    return verifiers.make(name, SCORING, p=p, seed=seed)


def corpus(env: EscalationEnv) -> list[str]:
    """All text a tokenizer for this env must cover: prompts of both variants, replies, hints."""
    texts: list[str] = []
    for query in env.train_queries + env.heldout_queries:
        for variant in VARIANTS:
            for reply_format in REPLY_FORMATS:
                texts.append(env._example(query, variant, reply_format).prompt)
        texts.append(query.hint)
    texts.extend(reply(t.id, fmt) for t in env.tools for fmt in REPLY_FORMATS)
    return texts
