"""How a rollout's per-token arrays are stored (server/store/arrays.py): every coding read back
within its stated precision, the batch coder equal to the one-rollout coders, and the text rules
that rebuild a completion from its token texts exactly or not at all."""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import pytest
from rollout_lens.server.store import arrays


def _rows(rng: random.Random, k: int, n: int) -> list[list[float]]:
    rows = [[rng.random() ** 30 for _ in range(n)] for _ in range(k)]
    if k > 1:
        rows[1] = [0.0] * n  # a control token that never matters: an empty sparse row
    if k and n > 2:
        rows[0][1] = math.nan
    return rows


def test_ids_round_trip_exactly() -> None:
    ids = [0, 1, 2**31 - 1, 151_643, 7, 7, 7]
    assert arrays.decode_ids(arrays.encode_ids(ids)).tolist() == ids
    assert arrays.decode_ids(arrays.encode_ids([])).tolist() == [] and not len(
        arrays.decode_ids(None)
    )


def test_logprobs_read_back_within_half_a_step() -> None:
    rng = random.Random(1)
    values = [-rng.expovariate(1 / 3) for _ in range(2000)] + [0.0, -1e-9, -14.99]
    got = arrays.decode_logprobs(arrays.encode_logprobs(values)).tolist()
    for was, now in zip(values, got, strict=True):
        assert abs(now - was) <= 0.5 / arrays.LOGPROB_SCALE + 1e-12 or was < arrays.LOGPROB_FLOOR
    special = arrays.decode_logprobs(
        arrays.encode_logprobs([-math.inf, math.nan, -99.0, 0.5])
    ).tolist()
    assert special[0] == -math.inf and math.isnan(special[1])
    assert special[2:] == [arrays.LOGPROB_FLOOR, 0.0]  # below the floor; a positive logprob


@pytest.mark.parametrize(("k", "n"), [(4, 300), (3, 1), (2, 0), (0, 5), (1, 64)])
def test_control_probabilities_keep_what_matters(k: int, n: int) -> None:
    rows = _rows(random.Random(k * 100 + n), k, n)
    got = arrays.decode_control(arrays.encode_control(rows, n), k).T.tolist()  # by token
    assert len(got) == k and all(len(row) == n for row in got)
    for row, back in zip(rows, got, strict=True):
        for was, now in zip(row, back, strict=True):
            if math.isnan(was):
                assert math.isnan(now)
            elif was < arrays.CONTROL_FLOOR:
                assert now == 0.0
            else:
                assert abs(now - was) <= 0.5 / 32768 + 1e-12


def test_rows_of_another_length_are_cut_or_padded() -> None:
    got = arrays.decode_control(arrays.encode_control([[0.5, 0.5, 0.5], [0.75]], 2), 2)
    assert got.tolist() == [
        [0.5, 0.75],
        [0.5, 0.0],
    ]  # [position × token]  # (halves and quarters are exact)


def test_the_batch_coder_writes_what_the_one_rollout_coders_write() -> None:
    rng = random.Random(7)
    lengths = [5, 0, 300, 1, 64]
    ids = [[rng.randrange(150_000) for _ in range(n)] for n in lengths]
    logprobs = [[-rng.random() for _ in range(n)] for n in lengths]
    control = [_rows(rng, 3, n) for n in lengths]
    control[2][2] = control[2][2][:10]  # a short row: padded as encode_control pads it
    batch = arrays.encode_rollouts(ids, logprobs, control)
    for i, n in enumerate(lengths):
        assert batch[i] == (
            arrays.encode_ids(ids[i]),
            arrays.encode_logprobs(logprobs[i]),
            arrays.encode_control(control[i], n),
        )


def _drawn_step(seed: int) -> tuple[list[Any], list[Any], list[Any], list[int]]:
    """A step of rollouts as the writers hand them: ids as arrays or lists (some fitting two
    bytes, some not, a negative one), logprobs with NaN, −inf, one below the floor and a row
    shorter than its ids, control-token probabilities as [position × token] arrays or rows by
    token (a short one among them); lengths from none to 1,500 tokens."""
    r = np.random.default_rng(seed)
    lengths = [int(n) for n in r.choice([0, 1, 2, 7, 64, 300, 1500], size=int(r.integers(0, 40)))]
    k = int(r.integers(0, 5))
    ids: list[Any] = []
    logprobs: list[Any] = []
    control: list[Any] = []
    for n in lengths:
        drawn = r.integers(0, int(r.choice([2, 300, 65_535, 65_536, 150_000, 2**31 - 1])), n)
        if n and r.random() < 0.1:
            drawn[0] = -int(r.integers(1, 1000))
        ids.append(drawn if r.random() < 0.5 else drawn.tolist())
        lp = -r.exponential(2.0, n)
        for value, share in ((math.nan, 0.3), (-math.inf, 0.3), (-30.0, 0.2)):
            if n and r.random() < share:
                lp[r.integers(0, n)] = value
        lp = lp[: n // 2] if r.random() < 0.1 else lp
        logprobs.append(lp if r.random() < 0.5 else lp.tolist())
        probs = r.random((n, k)) ** 6
        if n and k and r.random() < 0.3:
            probs[r.integers(0, n), 0] = math.nan
        rows = [list(probs[:, j]) for j in range(k)]
        if rows and r.random() < 0.3:
            rows[0] = rows[0][: n // 3]
        control.append(probs if r.random() < 0.5 else rows)
    return ids, logprobs, control, lengths


@pytest.mark.parametrize("batch_values", [arrays.BATCH_VALUES, 1000, 1])
def test_the_batch_coder_is_the_one_rollout_coders_byte_for_byte(
    monkeypatch: pytest.MonkeyPatch, batch_values: int
) -> None:
    """encode_rollouts codes a step in numpy passes over many rollouts at once (their bits
    placed into one stream): every blob equals what the one-rollout coders write, over drawn
    steps, whatever the passes' size (one rollout a pass, a few, all)."""
    monkeypatch.setattr(arrays, "BATCH_VALUES", batch_values)
    for seed in range(60):
        ids, logprobs, control, lengths = _drawn_step(seed)
        batch = arrays.encode_rollouts(ids, logprobs, control)
        for i, n in enumerate(lengths):
            rows = control[i].T if isinstance(control[i], np.ndarray) else control[i]
            assert batch[i] == (
                arrays.encode_ids(ids[i]),
                arrays.encode_logprobs(logprobs[i]),
                arrays.encode_control(list(rows), n),
            ), (seed, i)


def test_the_batch_coder_refuses_parts_that_do_not_pair() -> None:
    with pytest.raises(ValueError, match="one each a rollout"):
        arrays.encode_rollouts([[1, 2]], [[-0.5, -0.5], [-0.5]], [[], []])


BYTE_LEVEL = {1: "Hello", 2: "Ġwörld", 3: "Ċ", 4: "<|im_end|>", 5: "Ã©"}
SENTENCEPIECE = {1: "▁Hello", 2: "▁world", 3: "<0x0A>", 4: "</s>"}


@pytest.mark.parametrize(
    ("text", "ids", "texts", "rule"),
    [
        ("Hello world", [1, 2], {1: "Hello", 2: " world"}, 1),
        ("Hello", [1, 2], {1: "Hello", 2: "<eos>"}, 1 + 8),  # the end-of-turn token decodes away
        ("Hello wörld\n", [1, 2, 3, 4], {**BYTE_LEVEL, 2: "Ġw" + "Ã¶" + "rld"}, 2 + 8),
        ("é", [5], BYTE_LEVEL, 2),
        (" Hello world\n", [1, 2, 3], SENTENCEPIECE, 3),
        ("Hello world\n", [1, 2, 3, 4], SENTENCEPIECE, 4 + 8),
        ("Hello there", [1, 2], {1: "Hello", 2: " world"}, None),  # no rule gives it: stored
        ("Hello", [1, 9], {1: "Hello"}, None),  # a token whose text the run does not know
        ("", [], {}, None),
    ],
)
def test_text_rules_rebuild_exactly_or_not_at_all(
    text: str, ids: list[int], texts: dict[int, str], rule: int | None
) -> None:
    assert arrays.text_rule(text, ids, texts) == rule
    if rule is not None:
        assert arrays.rebuild_text(rule, ids, texts) == text


def test_a_preview_cut_inside_a_character_leaves_it_out() -> None:
    pieces = ["Hello", "Ġw", "Ã", "¶rld"]  # "ö" is two bytes, split over two tokens
    assert arrays.preview(2, pieces[:3]) == "Hello w"
    assert arrays.preview(2, pieces) == "Hello wörld"


def test_a_stored_text_is_read_back_whole_or_by_its_head() -> None:
    text = "héllo " * 50_000
    data = arrays.encode_text(text)
    assert arrays.decode_text(data) == text and arrays.text_head(data, 9) == text[:9]
    assert arrays.completion(None, None, data, {}) == text


def test_threads_code_and_decode_at_once() -> None:
    """The web app decodes on a pool of threads (one shared zstd decompressor once corrupted
    concurrent reads under load): every thread reads back exactly what it wrote."""
    from concurrent.futures import ThreadPoolExecutor

    def work(seed: int) -> bool:
        rng = random.Random(seed)
        for _ in range(200):
            ids = [rng.randrange(150_000) for _ in range(rng.randrange(1, 3000))]
            if arrays.decode_ids(arrays.encode_ids(ids)).tolist() != ids:
                return False
        return True

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(work, range(16)))
