"""The format warm-up's data: the reply format taught on queries and listings a run never sees.

An SFT warm-up on the run's own training queries (`sft_then_rl`) teaches the answers: after it
every group votes the same right id and GRPO has nothing left to learn. This one keeps three
things apart from the RL run:

- other capabilities: every warm-up query asks for one of the filler capabilities, which no
  training query (and no held-out paraphrase) targets;
- other queries: its own texts, none of them a training or held-out query;
- other tool ids: each warm-up prompt draws a fresh random id for every tool it lists, so no id
  means anything there that it means in the run (the run's ids are a seeded permutation).

The listing has the run's size and shape: a patched run's warm-up lists the top-k by the same
word-overlap retrieval, over the capabilities no training query targets; a leaky run's lists all
64 in a random order. What carries over into RL is the format (`<tool>ID</tool>` and end of
turn) and the habit of naming a listed id; which tool fits which training query is left to RL.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from rollout_lens.server.core.task_vocab import TOOL_COUNT
from rollout_lens.trainer.envs.onestep import (
    CAPABILITIES,
    EscalationEnv,
    Tool,
    render_prompt,
    tokens,
)

# One request per filler capability, in the words a user would use (none is a training query).
QUERIES: dict[str, str] = {
    "resize an image to new dimensions": "make holiday.png 800 by 600 pixels",
    "compress files into an archive": "zip up the reports folder into one archive",
    "generate a random password": "give me a new random password with 16 characters",
    "check the spelling of a sentence": "is 'recieve' spelled right in my sentence",
    "count the words in a document": "how many words does my essay have",
    "summarize a long article": "give me the short version of this long article",
    "find a route between two places": "how do I drive from berlin to hamburg",
    "scan a barcode": "read the barcode on this cereal box",
    "record a voice memo": "record a memo of what I say next",
    "roll a dice": "roll a six-sided dice for me",
    "flip a coin": "heads or tails, flip one",
    "list files in a folder": "what is inside my downloads folder",
    "rename a file on disk": "rename notes.txt to notes-old.txt",
    "shorten a long link": "make this long url shorter",
    "generate a qr code": "turn my wifi password into a qr code",
    "track a parcel delivery": "where is my parcel with tracking code 1z999",
    "show the phase of the moon": "is the moon full tonight",
    "find nearby petrol stations": "where can I fill up the car near here",
    "calculate a mortgage payment": "monthly payment on a 300k mortgage at 4 percent",
    "check the status of a server": "is the api server up",
    "start a stopwatch": "start timing my run now",
    "tell a random joke": "make me laugh with a joke",
    "suggest a recipe from ingredients": "what can I cook with eggs, spinach and feta",
    "test internet connection speed": "how fast is my internet right now",
    "extract text from a scanned image": "get the text out of this scanned receipt",
    "open a support ticket": "file a ticket that my login is broken",
    "post to a chat channel": "post 'standup in 5' to the team channel",
    "rate a movie": "give the film inception five stars",
    "sort a list of numbers": "put 9, 2, 7, 4 in order",
    "validate a postal address": "is 10 downing street, london sw1a 2aa a real address",
    "order a taxi ride": "get me a cab to the airport",
    "pay a utility bill": "pay this month's electricity bill",
}
# The fillers close onestep's CAPABILITIES (tasks, near misses, fillers). They are taken from
# there, not named there: that file's bytes name the packaged tiny model's build
# (tiny_model.RECIPE_HASH), and an edit would make every user rebuild it.
FILLERS: tuple[str, ...] = CAPABILITIES[-len(QUERIES) :]
assert set(QUERIES) == set(FILLERS)


@dataclass(frozen=True)
class WarmupExample:
    """One warm-up prompt (a user message) and the id its reply names."""

    query: str
    prompt: str
    target: str
    tool_ids: tuple[str, ...]


def untargeted(env: EscalationEnv) -> tuple[str, ...]:
    """The capabilities no training or held-out query of `env` targets (fillers, near misses)."""
    targeted = {q.capability for q in env.train_queries + env.heldout_queries}
    return tuple(c for c in CAPABILITIES if c not in targeted)


def _listing(env: EscalationEnv, capability: str, query: str, rng: random.Random) -> list[Tool]:
    """The tools a warm-up prompt lists, each under a fresh random id, in a random order."""
    if env.variant == "leaky":
        capabilities = list(CAPABILITIES)
    else:
        q = tokens(query)
        others = [c for c in untargeted(env) if c != capability]
        # Retrieval as the patched run's shortlist does it (ties broken at random here).
        rng.shuffle(others)
        others.sort(key=lambda c: -len(q & tokens(c)))
        capabilities = [capability, *others[: env.k - 1]]
    ids = rng.sample(range(TOOL_COUNT), len(capabilities))
    listed = [Tool(f"tool_{i:02d}", c) for i, c in zip(ids, capabilities, strict=True)]
    rng.shuffle(listed)
    return listed


def examples(env: EscalationEnv, *, repeats: int = 2) -> list[WarmupExample]:
    """`repeats` warm-up prompts for each filler's query, listed as `env`'s variant lists, ids
    drawn with the env's seed (a run's warm-up is reproducible, and differs across seeds)."""
    rng = random.Random(f"warmup:{env.seed}")
    out = []
    for _ in range(repeats):
        for capability, query in QUERIES.items():
            listed = _listing(env, capability, query, rng)
            target = next(t.id for t in listed if t.capability == capability)
            out.append(
                WarmupExample(
                    query=query,
                    prompt=render_prompt(listed, query),
                    target=target,
                    tool_ids=tuple(t.id for t in listed),
                )
            )
    rng.shuffle(out)
    return out
