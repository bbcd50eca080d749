"""The token view's pieces: a rollout's tokens as cells (token_spans), each cell's classes and
hover text (token_cells), the control-token table (control_rows), probabilities as text, and
where the rollout has a generator side its log-ratio shade (ratio_class, generator_side)."""

from __future__ import annotations

import bisect
import functools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from rollout_lens.server.core import tokentext
from rollout_lens.server.core.mismatch import BANDS
from rollout_lens.server.core.records import ControlProbs
from rollout_lens.server.core.step_views import RolloutView
from rollout_lens.server.webapp.queries.budget import SPLIT_CHARS_PER_TOKEN, VIEW_TOKENS
from typing_extensions import TypedDict

# The tiny model's pieces (tags, turn markers, ids, words with their leading space, punctuation,
# whitespace): when the completion splits into as many pieces as it has ids, piece i is token i.
_PIECES = re.compile(r"</?(?:tool|assistant|user)>|\n- |tool_\d+| ?(?!tool_\d)[^\W_]+|[^\w\s]|\s")


NEAR_MISS = 0.3  # a control token this likely where it was not sampled is a near format break


def _matching_control_token(prob: float, control: ControlProbs, position: int) -> str | None:
    """The control token whose probability equals the sampled token's (so it was the one sampled)."""
    for token, probs in control.items():
        if position < len(probs) and math.isclose(
            probs[position],
            prob,
            rel_tol=2e-3,
            abs_tol=1e-4,  # float16 both sides
        ):
            return token
    return None


def token_spans(
    rollout: RolloutView, limit: int = VIEW_TOKENS
) -> tuple[list[tokentext.Cell], bool]:
    """The first `limit` completion tokens as cells (tokentext.Cell: a text and the positions
    first…last it covers), and whether the texts are the real tokens.

    From the pieces the recorder stored (`token_pieces`, read by the rule that gave `tokens`):
    a cell a token, except that tokens carrying parts of one UTF-8 character share a cell. Else
    from `tokens` alone, or the completion text split as the tiny model's tokenizer splits it;
    else each position is labelled by its id (or by the control token that was sampled there,
    recognised by its probability). A completion longer than `limit` tokens is labelled, not
    split: splitting must read all of its text.
    """
    ids = rollout.completion_ids  # maybe only the first ones (tokens_total)
    total = rollout.tokens_total
    shown = min(total, limit, len(ids))
    stored = rollout.tokens  # each id's text, when the recorder stored its piece
    pieces = rollout.token_pieces
    if isinstance(stored, list) and len(stored) == len(ids):
        if isinstance(pieces, list) and len(pieces) == len(ids):
            rule = tokentext.matching_rule(pieces[:shown], stored[:shown])
            return tokentext.cells(pieces[:shown], rule, final=shown == total), True
        return _single(str(t) for t in stored[:shown]), True
    logprobs = rollout.token_logprobs
    control = rollout.control_token_probs

    def label(i: int) -> str:
        found = (
            _matching_control_token(math.exp(logprobs[i]), control, i)
            if i < len(logprobs)
            else None
        )
        return tokentext.piece_text(found) if found is not None else f"⟨{ids[i]}⟩"

    text = rollout.completion
    if total == len(ids) <= limit and len(text) <= limit * SPLIT_CHARS_PER_TOKEN:
        split = _split(text, len(ids) + 1)
        if split is not None and len(split) == len(ids):
            return _single(split), True
        # The end-of-turn token is special: decoding drops it from the text.
        if split is not None and len(split) == len(ids) - 1:
            return _single([*split, label(len(ids) - 1)]), True
    return _single(label(i) for i in range(shown)), False


def _single(texts: Iterable[str]) -> list[tokentext.Cell]:
    """A cell a token."""
    return [tokentext.Cell(text, i, i) for i, text in enumerate(texts)]


def _split(text: str, most: int) -> list[str] | None:
    """`text` as the tiny tokenizer's pieces, or None when it has more than `most` pieces or
    characters no piece matches (stops early: a hostile text costs no more than a short one)."""
    pieces: list[str] = []
    end = 0
    for match in _PIECES.finditer(text):
        if match.start() != end or len(pieces) == most:
            return None
        pieces.append(match.group())
        end = match.end()
    return pieces if end == len(text) else None


def probability_bin(p: float | None) -> int:
    """0–9: the shade class of a probability (CSS classes p0…p9, no inline styles)."""
    if p is None or not math.isfinite(p):
        return 0
    return min(9, max(0, int(p * 10)))


# |log r| at the edges of the log-ratio shades: within 1 %, within 10 %, inside the narrow
# band [1/2, 2], inside the wide one [1/5, 5], beyond it (mismatch.BANDS: the TIS/MIS bands).
RATIO_EDGES = (0.01, 0.1, math.log(BANDS[0]), math.log(BANDS[1]))
RATIO_NONE = "rx"  # no log r: no generator logprob, no trainer one
Shade = Literal["probability", "ratio"]  # what the page shades cells by (?shade=ratio: log r)


def ratio_class(log_r: float | None) -> str:
    """The log-ratio shade of a token (CSS classes, no inline styles): r0 where |log r| ≤ 0.01,
    rp1…rp4 where the trainer gave the token more probability than the generator (r > 1), rn1…rn4
    less; level 3 lies outside [1/2, 2], level 4 outside [1/5, 5] (as mismatch.outside counts
    them: strictly beyond); rx where there is nothing to compare."""
    if log_r is None or not math.isfinite(log_r):
        return RATIO_NONE
    level = bisect.bisect_left(RATIO_EDGES, abs(log_r))
    if level == 0:
        return "r0"
    return f"rp{level}" if log_r > 0 else f"rn{level}"


def _ratio_label(log_r: float) -> str:
    """r = exp(log r) as the legend writes a shade's edge: 1/5, 1/2, 0.90, 1.1, 2, 5."""
    r = math.exp(log_r)
    for band in BANDS:
        if math.isclose(r, band):
            return f"{band:g}"
        if math.isclose(r, 1 / band):
            return f"1/{band:g}"
    return f"{r:.2f}" if r < 1 else f"{r:.3g}"


def _ratio_scale() -> list[tuple[str, str]]:
    """The log-ratio legend: (class, the range of r it shades), from r < 1/5 to r > 5."""
    edges = [-e for e in reversed(RATIO_EDGES)] + list(RATIO_EDGES)
    labels = [_ratio_label(e) for e in edges]
    out = [(ratio_class(edges[0] - 1), f"<{labels[0]}")]
    for i, (a, b) in enumerate(zip(edges, edges[1:], strict=False)):
        text = f"≈1 (±{b:.0%})" if a < 0 < b else f"{labels[i]}–{labels[i + 1]}"
        out.append((ratio_class((a + b) / 2), text))
    out.append((ratio_class(edges[-1] + 1), f">{labels[-1]}"))
    return out


RATIO_SCALE = _ratio_scale()


# The bands as hover text says a log r lies outside them, the widest first.
_OUTSIDE = tuple((math.log(b), f" · outside [1/{b:g}, {b:g}]") for b in sorted(BANDS)[::-1])


def ratio_text(log_r: float | None) -> str:
    """A token's (or a cell's) log r for hover text: log r, r, and the widest band it lies
    outside of."""
    if log_r is None or not math.isfinite(log_r):
        return "log r: — (no generator logprob to compare)"
    size = abs(log_r)
    r = f"{math.exp(log_r):.3g}" if size < 700 else ("∞" if log_r > 0 else "0")
    out = f"log r={log_r:+.3f} (r={r})"
    for edge, note in _OUTSIDE:
        if size > edge:
            return out + note
    return out


@dataclass(frozen=True, slots=True)
class GeneratorSide:
    """A rollout's generator side at its shown positions, for its cells: the generator's
    probability of each sampled token and log r = trainer − generator logprob, None where
    there is nothing to compare (no generator logprob, no finite trainer one, a tool result)."""

    probs: list[float | None]
    log_ratios: list[float | None]

    def at(self, first: int, last: int) -> tuple[float | None, float | None]:
        """A cell's generator probability (the product of its tokens') and log r (the sum of
        theirs); None when one of its tokens has none."""
        if first == last:
            return self.probs[first], self.log_ratios[first]
        ratios = [v for v in self.log_ratios[first : last + 1] if v is not None]
        if len(ratios) <= last - first:
            return None, None
        return _cell_probability(self.probs, first, last), math.fsum(ratios)


def generator_side(
    trainer: np.ndarray, generator: np.ndarray, n: int, sampled: Sequence[bool] | None
) -> GeneratorSide:
    """The generator side of a rollout's first `n` positions from its logprob arrays (either
    may be shorter: the positions past it have nothing to compare); positions not `sampled`
    (tool results) have none."""
    both = np.full((2, n), np.nan)
    both[0, : min(n, len(trainer))] = trainer[:n]
    both[1, : min(n, len(generator))] = generator[:n]
    keep = np.isfinite(both).all(axis=0)
    if sampled is not None:
        keep &= np.asarray(sampled, dtype=bool)
    ratios = (both[0] - both[1]).tolist()
    probs = np.exp(both[1]).tolist()
    flags = keep.tolist()
    return GeneratorSide(
        probs=[p if k else None for p, k in zip(probs, flags, strict=True)],
        log_ratios=[r if k else None for r, k in zip(ratios, flags, strict=True)],
    )


class TokenCell(TypedDict):
    """A token cell as the page draws it (token_cells)."""

    text: str  # what the cell's tokens contribute
    first: int  # the positions it covers, first…last
    last: int
    cls: str  # CSS classes: its probability's shade, near-miss, tool-tok
    title: str  # hover text: positions, ids, probabilities


Cells = list[TokenCell]
ControlRows = list[tuple[str, list[tuple[str, str]]]]  # control_rows: label, (class, text)


@functools.lru_cache(maxsize=1 << 16)  # float16 probabilities: a few thousand distinct values
def prob_text(value: float | None, digits: int = 2) -> str:
    """A probability with fixed decimals; '<0.01' rather than a misleading 0.00."""
    if value is None or not math.isfinite(value):
        return "—"
    floor = 10 ** (-digits)
    return f"<{floor:.{digits}f}" if 0 < value < floor / 2 else f"{value:.{digits}f}"


def control_name(token: str) -> str:
    """A control token as text with its whitespace visible (tokentext.piece_text: 'Ġ<' → '·<'),
    for hover text (pages draw names with the `token` filter)."""
    return tokentext.piece_text(token).replace(" ", "·").replace("\n", "↵").replace("\t", "⇥")


def _cell_probability(probs: Sequence[float | None], first: int, last: int) -> float | None:
    """A cell's probability: the product of its tokens' (the chance of sampling its text once
    its first token's context was given); None when one is unknown."""
    p = 1.0
    for q in probs[first : last + 1]:
        if q is None:
            return None
        p *= q
    return p


def token_cells(
    spans: Sequence[tokentext.Cell],
    ids: Sequence[int],
    probs: Sequence[float | None],
    control: Mapping[str, Sequence[float | None]],
    sampled: Sequence[bool] | None,
    near_misses: Sequence[Sequence[str]],
    limit: int | None = None,
    generator: GeneratorSide | None = None,
) -> Cells:
    """Per cell of a rollout's shown tokens (`spans`, those starting in the first `limit`
    positions): text, its positions (first, last), CSS classes and hover text (built here, not
    in Jinja: a 64-token completion × every control token is thousands of template
    operations). A cell of several tokens (one character split over them) shows the product of
    their probabilities, their ids, and the control tokens' probabilities at its first
    position. With a `generator` side a cell also has its log-ratio shade (ratio_class, drawn
    where the page asks for it) and its hover text the generator's probability and log r."""
    cells = []
    names = {t: control_name(t) for t in control}
    heads = [(f"p({names[t]})=", ps) for t, ps in control.items()]  # a hover line each
    for span in spans:
        a, b = span.first, span.last
        if limit is not None and a >= limit:
            break
        if a == b:  # most cells: one token
            at, id_text, p, misses = f"#{a}", f"id {ids[a]}", probs[a], sorted(near_misses[a])
        else:
            at, id_text = f"#{a}–{b}", "ids " + ", ".join(map(str, ids[a : b + 1]))
            p = _cell_probability(probs, a, b)
            misses = sorted({t for i in range(a, b + 1) for t in near_misses[i]})
        if sampled is not None and not sampled[a]:
            title = f"{at} · {id_text} · tool result: not sampled, not trained"
            cells.append(
                TokenCell(text=span.text, first=a, last=b, cls="tok tool-tok", title=title)
            )
            continue
        cls = _CELL_CLASSES[probability_bin(p)][bool(misses)]
        if generator is None:
            lines = [f"{at} · {id_text} · p={prob_text(p, 3)}"]
        else:
            q, log_r = generator.at(a, b)
            lines = [
                f"{at} · {id_text} · trainer p={prob_text(p, 3)} · generator p={prob_text(q, 3)}",
                ratio_text(log_r),
            ]
            cls = f"{cls} {ratio_class(log_r)}"
        if b > a:
            each = " × ".join(prob_text(q, 3) for q in probs[a : b + 1])
            lines.append(f"one character over {b - a + 1} tokens: p is the product {each}")
        lines += [head + prob_text(ps[a], 3) for head, ps in heads]
        if misses:
            lines.append(f"near miss: {', '.join(names[t] for t in misses)} was likely here")
        cells.append(TokenCell(text=span.text, first=a, last=b, cls=cls, title="\n".join(lines)))
    return cells


# A token cell's CSS classes by its probability's shade (0-9) and whether it is a near miss.
_CELL_CLASSES = [(f"tok p{i}", f"tok p{i} near-miss") for i in range(10)]


def control_rows(
    spans: Sequence[tokentext.Cell],
    probs: Sequence[float | None],
    control: Mapping[str, Sequence[float | None]],
    limit: int | None = None,
) -> ControlRows:
    """The control-token table (the cells starting in its first `limit` positions): (row
    label, [(CSS class, text)] per cell). The sampled row is each cell's probability (the
    product of its tokens'); a control token's row its probability at the cell's first
    position."""
    shown = [s for s in spans if limit is None or s.first < limit]
    sampled = [_cell_probability(probs, s.first, s.last) for s in shown]
    rows = [("sampled", [(f"p{probability_bin(p)}", prob_text(p)) for p in sampled])]
    for token, ps in control.items():
        firsts = [ps[s.first] for s in shown]
        rows.append((token, [(f"c{probability_bin(p)}", prob_text(p)) for p in firsts]))
    return rows
