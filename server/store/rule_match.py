"""Which of TEXT_RULES rebuilds each of a step's completions from the run's token texts, found
in numpy passes over the step's token ids. `arrays.pieces_rule` is the rule and the tests'
oracle: it joins a rollout's texts and compares, a rule at a time.

A rule turns each piece into bytes (tokentext.piece_bytes; JOIN's are the piece's UTF-8) and
their concatenation into the text (JOIN: as it is; the others: decoded as strict UTF-8), so a
rule rebuilds a completion exactly when its pieces' bytes, end to end, are the completion's
bytes — for a rule that decodes, its strict UTF-8 (a text holding a lone surrogate is JOIN's
alone), and for SENTENCEPIECE_STRIPPED, a space and then them. The run's pieces' bytes are held
by rule, each piece's as little-endian 64-bit words (zero-padded): every token's k-th word is
compared with the 8 bytes of the completion at the token's offset + 8k (masked to the token's
bytes), all the step's tokens at once, and only in the rollouts whose byte count is the rule's.

At 512 rollouts × 1,000 tokens a step, gathering each token's text as a str (its reference
count touched wherever the run's dict put it) and joining them a rollout at a time was a
quarter of a step's commit (bench.scale).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from rollout_lens.server.core.tokentext import (
    JOIN,
    SENTENCEPIECE,
    SENTENCEPIECE_STRIPPED,
    TEXT_RULES,
    piece_bytes,
)
from rollout_lens.server.store.arrays import MAX_DROPPED, byte_words

# arrays.pieces_rule's order: fewer tokens left out first, then each rule in turn
_ORDER = [(dropped, rule) for dropped in range(MAX_DROPPED + 1) for rule in TEXT_RULES]
# a word's low `c` bytes (c = 0…8)
_MASKS = np.array([(1 << (8 * c)) - 1 for c in range(9)], dtype=np.uint64)


class _Table:
    """One rule's bytes of the run's pieces, by token id: each piece's byte count, its first 8
    bytes as a word (zero-padded), and where the words of the rest (zero-padded) start in
    `rest` (most pieces are a word or less)."""

    def __init__(self, rule: int, size: int) -> None:
        self.rule = rule
        self.lengths = np.zeros(size, dtype=np.int32)
        self.head = np.zeros(size, dtype="<u8")
        self.first = np.zeros(size, dtype=np.int32)
        self.rest = np.zeros(0, dtype="<u8")

    def learn(self, ids: Sequence[int], pieces: Sequence[str]) -> None:
        found = [piece_bytes(piece, self.rule) for piece in pieces]
        lengths = np.fromiter(map(len, found), dtype=np.int64, count=len(found))
        self.lengths[ids] = lengths
        self.head[ids] = np.frombuffer(b"".join(b[:8].ljust(8, b"\0") for b in found), dtype="<u8")
        n_rest = np.maximum(lengths - 1, 0) // 8
        self.first[ids] = len(self.rest) + np.cumsum(n_rest) - n_rest
        padded = b"".join(b[8:] + bytes(-len(b) % 8) for b in found if len(b) > 8)
        self.rest = np.concatenate((self.rest, np.frombuffer(padded, dtype="<u8")))


class PieceTables:
    """The run's pieces' bytes under each rule (built the first time a step needs the rule),
    for the token ids below `size`: `texts` is the run's dict, which `learn` is told about."""

    def __init__(self, texts: Mapping[int, str], size: int) -> None:
        self.texts = texts
        self.size = size
        self._tables: dict[int, _Table] = {}

    def learn(self, ids: Sequence[int]) -> None:
        """These ids' texts (below `size`) are new in `texts` (a table built later reads them
        there)."""
        if not self._tables:
            return
        pieces = [self.texts[i] for i in ids]
        for table in self._tables.values():
            table.learn(ids, pieces)

    def _table(self, rule: int) -> _Table:
        base = SENTENCEPIECE if rule == SENTENCEPIECE_STRIPPED else rule  # the same bytes
        table = self._tables.get(base)
        if table is None:
            table = self._tables[base] = _Table(base, self.size)
            ids = [i for i in self.texts if 0 <= i < self.size]
            table.learn(ids, [self.texts[i] for i in ids])
        return table

    def rules(
        self, ids: np.ndarray, bounds: np.ndarray, texts: Sequence[str], usable: np.ndarray
    ) -> list[int | None]:
        """arrays.pieces_rule of each text whose tokens `ids[bounds[i]:bounds[i + 1]]` are all in
        the tables where `usable[i]`; None where it is not (ids elsewhere are never read: 0 is
        fine)."""
        counts = np.diff(bounds)
        n = len(texts)
        encoded = [t.encode("utf-8", "surrogatepass") for t in texts]
        text_bytes = np.fromiter(map(len, encoded), dtype=np.int64, count=n)
        strict = np.fromiter(map(_strict_utf8, texts), dtype=bool, count=n)
        found = np.zeros(n, dtype=np.int64)  # 0: no rule yet (a rule's id is at least 1)
        lengths: dict[int, np.ndarray] = {}  # each token's byte count, by table
        kept: _Kept | None = None  # the tokens before the last `dropped` of their rollout
        for dropped, rule in _ORDER:
            todo = usable & (found == 0) & (counts > dropped)
            if rule != JOIN:
                todo &= strict
            if not todo.any():
                continue
            table = self._table(rule)
            if table.rule not in lengths:
                lengths[table.rule] = table.lengths[ids]
            if dropped and (kept is None or kept.dropped != dropped):
                kept = _Kept(bounds, counts, dropped)
            sizes = (
                lengths[table.rule] if kept is None else np.where(kept.mask, lengths[table.rule], 0)
            )
            sums = np.cumsum(sizes)
            before = np.concatenate(([0], sums))[bounds]
            space = int(rule == SENTENCEPIECE_STRIPPED)
            todo &= before[1:] - before[:-1] == text_bytes + space
            if todo.any():
                same = _Compared(
                    table, ids, sizes, sums - sizes, bounds, None if kept is None else kept.mask
                )
                found[same.rollouts(todo, encoded, space)] = rule + 8 * dropped
        return [int(rule) or None for rule in found.tolist()]


class _Kept:
    """The tokens before the last `dropped` of each rollout (of more than `dropped` tokens)."""

    def __init__(self, bounds: np.ndarray, counts: np.ndarray, dropped: int) -> None:
        self.dropped = dropped
        self.mask = np.ones(int(bounds[-1]), dtype=bool)
        for back in range(1, dropped + 1):
            self.mask[bounds[1:][counts >= back] - back] = False


def _strict_utf8(text: str) -> bool:
    """Whether `text` has a strict UTF-8 form (no lone surrogate): what a decoded text has."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class _Compared:
    """A step's tokens under one table: each one's byte count (0 where it is left out: `kept`
    says where, None where none is) and its offset in all the rollouts' bytes, end to end."""

    def __init__(
        self,
        table: _Table,
        ids: np.ndarray,
        sizes: np.ndarray,
        starts: np.ndarray,
        bounds: np.ndarray,
        kept: np.ndarray | None,
    ) -> None:
        self.table, self.ids, self.sizes, self.starts = table, ids, sizes, starts
        self.bounds, self.kept = bounds, kept

    def rollouts(self, candidates: np.ndarray, encoded: Sequence[bytes], space: int) -> np.ndarray:
        """Which `candidates` (a mask of rollouts whose tokens' byte count is their text's, with
        `space`: a space before it) have their tokens' bytes, end to end, equal to it: every
        token's first word compared at once, then the longer tokens' next words."""
        rollouts = np.flatnonzero(candidates)
        if len(rollouts) == len(candidates):
            tokens, ids, sizes, starts = None, self.ids, self.sizes, self.starts
        else:
            tokens = np.flatnonzero(np.repeat(candidates, np.diff(self.bounds)))
            ids, sizes = self.ids[tokens], self.sizes[tokens]
            starts = np.cumsum(sizes) - sizes  # each token's offset in the candidates' texts
        lead = b" " if space else b""
        stream = b"".join([lead + encoded[i] for i in rollouts.tolist()] + [bytes(8)])
        words = byte_words(np.frombuffer(stream, dtype=np.uint8))
        table = self.table
        wrong = words[starts] & _MASKS[np.minimum(sizes, 8)] != table.head[ids]
        if self.kept is not None:  # a token left out is not compared
            wrong &= self.kept if tokens is None else self.kept[tokens]
        longer = np.flatnonzero(sizes > 8)
        first = table.first[ids[longer]]
        k = 1
        while len(longer):
            left = np.minimum(sizes[longer] - 8 * k, 8)
            got = words[starts[longer] + 8 * k] & _MASKS[left]
            wrong[longer] |= got != table.rest[first + k - 1]
            more = sizes[longer] > 8 * (k + 1)
            longer, first = longer[more], first[more]
            k += 1
        at = np.flatnonzero(wrong)
        if tokens is not None:
            at = tokens[at]
        candidates = candidates.copy()
        candidates[np.searchsorted(self.bounds, at, side="right") - 1] = False
        return candidates
