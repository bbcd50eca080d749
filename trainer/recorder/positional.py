"""Control-token probes at the positions that matter (pure: tokens and probabilities in).

The collapse the second seed describes is a control token winning at the wrong place — most
often end-of-turn right after a bare opening tag. These read that off each completion.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from rollout_lens.server.core import vocab
from rollout_lens.trainer.recorder.tags import Marks, single_token_marks

PROBES = tuple(vocab.POSITIONAL_PROBES)  # control-token probes, computed by probes_at
ID_PROBES = tuple(vocab.ID_PROBES)  # at the id position, computed by id_probes


def control_probes(
    tokens: Sequence[str],
    probs: Mapping[str, Sequence[float]],
    *,
    open_tag: str,
    close_tag: str,
    eot: str,
) -> dict[str, float | None]:
    """probes_at for tags that are single tokens, found by the tokens' texts."""
    marks = single_token_marks(tokens, open_tag, close_tag, eot)
    return probes_at(marks, probs, open_token=open_tag, close_token=close_tag, eot=eot)


def probes_at(
    marks: Marks,
    probs: Mapping[str, Sequence[float]],
    *,
    open_token: str,
    close_token: str,
    eot: str,
) -> dict[str, float | None]:
    """The positional probes of one completion (vocab.POSITIONAL_PROBES but the two after a
    tool result, which turn_probes adds); None where the position does not exist. A tag of
    several tokens stands at its first token (`open_token`, `close_token`: the control tokens
    read for it); "after" a tag is the position after its last token. Where a control token
    belongs: the opening tag first, the closing tag after the id, end-of-turn after the closing
    tag. Where it does not: end-of-turn or a closing tag right after the opening tag,
    end-of-turn after the id, a second closing tag. "After the id" is where the call's content
    stopped: the first closing tag or end-of-turn after it (else the position after a one-token
    id)."""

    def at(token: str, position: int | None) -> float | None:
        return _at(probs.get(token), position if position is None or position < marks.n else None)

    opened = marks.opens[0] if marks.opens else None
    closed = marks.closes[0] if marks.closes else None
    after_open = None if opened is None else opened[1]
    after_id = None
    if after_open is not None:
        stops = [a for a, _ in marks.closes if a > after_open]
        stops += [p for p in marks.eots if p > after_open]
        after_id = min(stops) if stops else after_open + 1
    after_close = None if closed is None else closed[1]
    return {
        "open_first": at(open_token, 0),
        "eot_after_open": at(eot, after_open),
        "close_after_id": at(close_token, after_id),
        "eot_after_close": at(eot, after_close),
        "close_after_open": at(close_token, after_open),
        "eot_after_id": at(eot, after_id),
        "close_after_close": at(close_token, after_close),
    }


def turn_probes(
    tokens: Sequence[str],
    probs: Mapping[str, Sequence[float]],
    turns: Sequence[Mapping[str, Any]],
    *,
    open_tag: str,
    close_tag: str,
    eot: str,
) -> dict[str, float | None]:
    """turn_probes_at for tags that are single tokens, found by the tokens' texts."""
    marks = single_token_marks(tokens, open_tag, close_tag, eot)
    return turn_probes_at(marks, probs, turns, open_token=open_tag, close_token=close_tag, eot=eot)


def turn_probes_at(
    marks: Marks,
    probs: Mapping[str, Sequence[float]],
    turns: Sequence[Mapping[str, Any]],
    *,
    open_token: str,
    close_token: str,
    eot: str,
) -> dict[str, float | None]:
    """The positional probes of a tool-calling rollout, read turn by turn: each model turn's
    probes_at (the opening tag first only in the first turn; "after the id" is where the call
    closed, its content being many tokens), averaged over the turns where the position exists,
    and at the first position of each model turn after a tool result the opening tag (another
    call) and end-of-turn (ending without an answer)."""
    found: dict[str, list[float]] = {}
    after_result = False
    for k, turn in enumerate(turns):
        if turn["role"] != "model":
            after_result = True
            continue
        a, b = int(turn["start"]), int(turn["end"])
        part = {t: p[a:b] for t, p in probs.items()}
        said = marks.within(a, b)
        one = probes_at(said, part, open_token=open_token, close_token=close_token, eot=eot)
        # A call's content is many tokens (its JSON), not one id: "after the id" is where the
        # call closed, which is where the closing tag belongs (and end-of-turn does not).
        opened = said.opens[0] if said.opens else None
        closed = next((c for c, _ in said.closes if c >= opened[1]), None) if opened else None
        one["close_after_id"] = _at(part.get(close_token), closed)
        one["eot_after_id"] = _at(part.get(eot), closed)
        if k:
            one["open_first"] = None
        if after_result and b > a:
            one["open_after_result"] = _first(part.get(open_token))
            one["eot_after_result"] = _first(part.get(eot))
        after_result = False
        for name, value in one.items():
            if value is not None:
                found.setdefault(name, []).append(value)
    return {
        name: (sum(found[name]) / len(found[name]) if name in found else None) for name in PROBES
    }


def _first(values: Sequence[float] | None) -> float | None:
    return _at(values, 0)


def _at(values: Sequence[float] | None, position: int | None) -> float | None:
    if values is None or position is None or not 0 <= position < len(values):
        return None
    return float(values[position])


def id_probes(
    logprobs: Mapping[str, float] | None, listed: Sequence[str], target: str | None
) -> dict[str, float | None]:
    """At the id position: logprob of the target id, of its best listed rival, entropy (bits) over listed ids."""
    if not logprobs or not listed:
        return dict.fromkeys(ID_PROBES)
    listed_lp = {i: logprobs[i] for i in listed if i in logprobs}
    rivals = [lp for i, lp in listed_lp.items() if i != target]
    total = sum(math.exp(lp) for lp in listed_lp.values())
    entropy = -sum(
        math.exp(lp) / total * math.log2(math.exp(lp) / total)
        for lp in listed_lp.values()
        if lp > -80
    )
    return {
        "target_logprob": listed_lp.get(target) if target else None,
        "rival_logprob": max(rivals) if rivals else None,
        "id_entropy": entropy if total > 0 else None,
    }


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..1) of a non-empty sequence."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def aggregate(
    rows: Sequence[Mapping[str, float | None]], rewarded: Sequence[bool], supervised: Sequence[bool]
) -> dict[str, float | None]:
    """Per-step mean, p90 and max of each probe some rollout measured, and its mean split by
    reward and by origin."""
    out: dict[str, float | None] = {}
    names = [*PROBES, *ID_PROBES]
    for name in names:
        values = [(r.get(name), w, s) for r, w, s in zip(rows, rewarded, supervised, strict=True)]
        present = [v for v, _, _ in values if v is not None]
        if not present:
            continue  # not measured at this step (or by this kind of run): no series point
        out[vocab.probe(name, "mean")] = sum(present) / len(present)
        out[vocab.probe(name, "p90")] = percentile(present, 0.9)
        out[vocab.probe(name, "max")] = max(present)
        for label, keep in zip(
            vocab.PROBE_SPLITS,
            (lambda w, s: w, lambda w, s: not w, lambda w, s: s, lambda w, s: not s),
            strict=True,
        ):
            part = [v for v, w, s in values if v is not None and keep(w, s)]
            if part:
                out[vocab.probe(name, f"{label}/mean")] = sum(part) / len(part)
    return out
