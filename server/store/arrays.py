"""How a rollout's per-token data is stored: token ids, logprobs and control-token probabilities
compressed (zstd), control-token probabilities sparse, and the completion's text rebuilt from its
ids where that gives it back exactly.

At 512 rollouts × 1,000 tokens a step these arrays are nearly all of a run's bytes, so each is
coded for its distribution:
- ids: int32, exact, bit-length coded (below): a BPE vocabulary numbers its frequent pieces
  first, so most ids are short.
- logprobs: 1/LOGPROB_SCALE nat steps as uint16 (a probability near 1 is off by at most 1.2e-4,
  below the 3 decimals the viewer shows), down to LOGPROB_FLOOR; −inf and NaN kept; exact
  enough that Σ logprob (a float64 column computed at full precision) is never recomputed;
  bit-length coded (most are near 0 nat: short).
- control-token probabilities: only the positions where one is at least CONTROL_FLOOR, as
  uint16 steps of 1/32768; every other position reads back as 0.0 (pages say so). Most of a
  completion's control-token probabilities are near 0: a row is a few dozen positions.
- text: where the run's token texts joined by one of TEXT_RULES give the completion back
  exactly (checked on write), no text is stored; otherwise it is stored zstd-compressed.

Each array is written in the shortest of a few codings, told apart by its first byte (a zstd
frame starts with 0x28: byte-shuffled zstd, as the store wrote every array before, is one of
them and is still read):
- bit-length coding (BIT_LENGTH_CODED): each value's bit length, one byte a value,
  zstd-compressed (its entropy coder sees a few distinct, skewed symbols), then each value's bits
  below its leading 1, packed (near-uniform: nothing to compress). A value costs about its bit
  length plus two or three bits: best where values are drawn independently (on the scale
  bench's Zipf ids some 15 % below byte-shuffled zstd, on its logprobs some 13 %);
- ids only: zstd over the plain little-endian ids, 2 bytes each where they fit (RAW_UINT16) or 4
  (RAW_INT32): best on real text, whose repeated runs of tokens zstd's matches find (on English
  and Python in SmolLM2's ids some 20 % below bit-length coding).

Only the codings that can be the shortest are tried: ids that fit in 2 bytes are never tried in 4
(the same values with two zero bytes more each: never shorter in 3,072 rollouts of real text,
692 against 796 bytes a rollout), and a logprob row's byte-shuffled zstd only where its bucket
symbols compress below SHUFFLE_TRIED bits a symbol (repeats, which zstd's matches would find in
the shuffled bytes too); a row of independent draws codes its symbols at 6.5 to 8 bits, and the
shuffled bytes were shorter there in 6 of 3,072 real-text rows, by 1 to 3 bytes.
"""

from __future__ import annotations

import math
import struct
import threading
from array import array
from collections.abc import Iterable, Mapping, Sequence
from itertools import accumulate, chain
from operator import itemgetter

import numpy as np
import zstandard
from rollout_lens.server.core.tokentext import TEXT_RULES

LOGPROB_SCALE = 4096  # steps per nat
LOGPROB_FLOOR = -15.0  # p = 3e-7; lower logprobs read back as this
CONTROL_FLOOR = 1e-3  # control-token probabilities below this are not stored (read back as 0.0)
_LP_NAN, _LP_NEG_INF = 65535, 65534
_LP_MAX = int(-LOGPROB_FLOOR * LOGPROB_SCALE)  # 61440 < 65534
_P_NAN, _P_SCALE = 65535, 32768  # a power of two: 0.5, 0.25… are exact
_LEVEL = 3  # zstd level: level 3 writes at hundreds of MB/s; higher levels gain a few %

# zstandard's (de)compressors must not be shared between threads (the web app serves requests
# on a pool of them: one shared decompressor corrupted concurrent reads): one each per thread.
_local = threading.local()
# A rollout's control-token probabilities: [position × token] (the step entity's orientation),
# or one sequence per token (rows as lists).
ControlRows = np.ndarray | Sequence[Sequence[float] | np.ndarray]


def _zstd() -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
    pair: tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor] | None = getattr(
        _local, "pair", None
    )
    if pair is None:
        pair = _local.pair = (zstandard.ZstdCompressor(level=_LEVEL), zstandard.ZstdDecompressor())
    return pair


def _shuffle(values: np.ndarray) -> bytes:
    """Little-endian values → their first bytes, then their second bytes… (zstd-friendly)."""
    return _planes(values).tobytes()


def _planes(values: np.ndarray) -> np.ndarray:
    """Little-endian values' byte planes, [byte × value]: a run of values' shuffled bytes are
    the C-order bytes of its columns (_shuffle of a slice, for many slices of one array)."""
    raw = values.astype(values.dtype.newbyteorder("<"), copy=False).view(np.uint8)
    return raw.reshape(-1, values.dtype.itemsize).T


def _unshuffle(data: bytes, dtype: str) -> np.ndarray:
    kind = np.dtype(dtype).newbyteorder("<")
    planes = np.frombuffer(data, np.uint8).reshape(kind.itemsize, -1)
    return planes.T.copy().view(kind).reshape(-1)


BIT_LENGTH_CODED = 0x01  # the first byte of a bit-length coded array
RAW_UINT16, RAW_INT32 = 0x02, 0x03  # … of zstd over plain little-endian ids (2 or 4 bytes each)
BUCKET_CODED = 0x04  # … of a bucket coded array (_code_buckets)
_LENGTHS = struct.Struct("<BI")  # that byte, then the compressed bit lengths' size


def _bit_lengths(values: np.ndarray) -> np.ndarray:
    """Bit length of each uint32 (0 for 0): frexp is exact on float64 below 2**53."""
    return np.frexp(values.astype(np.float64))[1].astype(np.uint8)


def _bit_places(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For `counts` bits of each value laid end to end: each bit's value and its place in it."""
    total = int(counts.sum())
    owner = np.repeat(np.arange(len(counts)), counts)
    place = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    return owner, place.astype(np.uint32)


def _low_bits(values: np.ndarray, counts: np.ndarray) -> bytes:
    """Each uint32 value's lowest `counts` bits, packed one after another (little-endian bit
    order), one pass over the bits themselves."""
    if not len(counts) or not int(counts.max()):
        return b""
    owner, place = _bit_places(counts)
    bits = ((values[owner] >> place) & 1).astype(np.uint8)
    return np.packbits(bits, bitorder="little").tobytes()


def byte_words(raw: np.ndarray) -> np.ndarray:
    """The little-endian 64-bit word at every byte offset of `raw` (uint8) that has 8 bytes
    from it: one view of the bytes, a byte apart (unaligned reads, no copy)."""
    return np.ndarray((len(raw) - 7,), dtype="<u8", buffer=raw, strides=(1,))


def _read_low_bits(data: bytes, offset: int, counts: np.ndarray) -> np.ndarray:
    """_low_bits' inverse: each value's lowest `counts` bits, read from data[offset:]. Each
    value is read as the 64-bit little-endian word at the byte its bits start in, shifted and
    masked (a value's bits, at most 32, and the 7 before them in that byte fit one word): a few
    passes over the values, none over the bits."""
    if not len(counts) or not int(counts.max()):
        return np.zeros(len(counts), dtype=np.uint32)
    widths = counts.astype(np.uint64)
    starts = np.cumsum(widths) - widths
    raw = np.frombuffer(data, np.uint8, offset=offset)
    padded = np.zeros(int(starts[-1] >> np.uint64(3)) + 16, dtype=np.uint8)
    padded[: min(len(raw), len(padded))] = raw[: len(padded)]
    words = byte_words(padded)
    word = words[(starts >> np.uint64(3)).astype(np.intp)]
    shifted = word >> (starts & np.uint64(7))
    low: np.ndarray = (shifted & ((np.uint64(1) << widths) - np.uint64(1))).astype(np.uint32)
    return low


def _code_bits(values: np.ndarray) -> bytes:
    """uint32 values → BIT_LENGTH_CODED bytes."""
    v = values.astype(np.uint32, copy=False).reshape(-1)
    widths = _bit_lengths(v)
    lengths = _pack(widths.tobytes())
    tail = np.maximum(widths.astype(np.int64) - 1, 0)  # bits below the leading 1
    return _LENGTHS.pack(BIT_LENGTH_CODED, len(lengths)) + lengths + _low_bits(v, tail)


def _decode_bits(data: bytes) -> np.ndarray:
    """BIT_LENGTH_CODED bytes → the uint32 values."""
    _, size = _LENGTHS.unpack_from(data)
    at = _LENGTHS.size
    widths = np.frombuffer(_unpack(data[at : at + size]), np.uint8).astype(np.int64)
    tail = np.maximum(widths - 1, 0)
    lead = np.where(widths > 0, np.left_shift(1, tail), 0).astype(np.uint32)
    out: np.ndarray = lead | _read_low_bits(data, at + size, tail)
    return out


# Bucket coding (BUCKET_CODED): a value below 2**(_TOP + 1) is its own symbol; a larger one's
# symbol is its bit length and the _TOP bits below its leading 1 (8 buckets an octave), and its
# lower bits follow, packed. The symbols (one byte each, at most 239) are zstd-compressed: its
# entropy coder codes them near their order-0 entropy, so a value costs about the entropy of a
# smooth distribution (logprobs), where bit-length coding spent 1 to 2 bits more.
_TOP = 3
_EXACT = 1 << (_TOP + 1)


def _code_buckets(values: np.ndarray) -> bytes:
    """uint32 values → BUCKET_CODED bytes."""
    v = values.astype(np.uint32, copy=False).reshape(-1)
    widths = _bit_lengths(v).astype(np.int64)
    below = np.maximum(widths - 1 - _TOP, 0)  # bits below the symbol's
    top = (v >> below.astype(np.uint32)).astype(np.int64)
    symbols = np.where(
        below == 0, v, _EXACT + (widths - _TOP - 2) * (1 << _TOP) + top - (1 << _TOP)
    )
    coded = _pack(symbols.astype(np.uint8).tobytes())
    return _LENGTHS.pack(BUCKET_CODED, len(coded)) + coded + _low_bits(v, below)


def _bucket_table() -> tuple[np.ndarray, np.ndarray]:
    """For each of the 256 byte values a symbol may be: (its value's bits above the packed ones,
    as a value; how many are packed)."""
    s = np.arange(256, dtype=np.int64)
    big = s >= _EXACT
    rest = np.maximum(s - _EXACT, 0)
    below = np.where(big, rest // (1 << _TOP) + 1, 0)
    top = np.where(big, (1 << _TOP) + rest % (1 << _TOP), s)
    return top, below


_BUCKET_TOPS, _BUCKET_BELOWS = _bucket_table()


def _bucket_widths(symbols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symbols → (each value's bits above its packed ones, as a value; how many are packed),
    looked up (a symbol is one byte)."""
    at = symbols.astype(np.intp, copy=False)
    return _BUCKET_TOPS[at], _BUCKET_BELOWS[at]


def _decode_buckets(data: bytes, symbols: np.ndarray | None = None) -> np.ndarray:
    """BUCKET_CODED bytes → the uint32 values."""
    _, size = _LENGTHS.unpack_from(data)
    at = _LENGTHS.size
    if symbols is None:
        symbols = np.frombuffer(_unpack(data[at : at + size]), np.uint8)
    top, below = _bucket_widths(symbols)
    high = (top.astype(np.uint64) << below.astype(np.uint64)).astype(np.uint32)
    out: np.ndarray = high | _read_low_bits(data, at + size, below)
    return out


def _coded(data: bytes) -> bool:
    return data[0] in (BIT_LENGTH_CODED, BUCKET_CODED)


def _decode_coded(data: bytes) -> np.ndarray:
    """BIT_LENGTH_CODED or BUCKET_CODED bytes → the uint32 values."""
    return _decode_bits(data) if data[0] == BIT_LENGTH_CODED else _decode_buckets(data)


def _pack(payload: bytes) -> bytes:
    return _zstd()[0].compress(payload)


def _unpack(data: bytes) -> bytes:
    return _zstd()[1].decompress(data)


def _floats(rows: Iterable[Iterable[float]]) -> np.ndarray:
    """Many lists of floats → one float64 array (array('d') reads Python floats in C)."""
    try:
        return np.frombuffer(array("d", chain.from_iterable(rows)), dtype=np.float64)
    except TypeError:  # None or another non-number: NaN, as a chart would show it
        values = [
            float(x) if isinstance(x, (int, float)) else math.nan for row in rows for x in row
        ]
        return np.asarray(values, dtype=np.float64)


def _logprob_codes(lp: np.ndarray) -> np.ndarray:
    """Logprobs → uint16 steps of 1/LOGPROB_SCALE nat (NaN and −inf have codes of their own)."""
    with np.errstate(invalid="ignore"):
        steps = np.rint(np.clip(-lp, 0.0, -LOGPROB_FLOOR) * LOGPROB_SCALE)
    codes: np.ndarray = np.nan_to_num(steps).astype(np.uint16)
    codes[np.isneginf(lp)] = _LP_NEG_INF
    codes[np.isnan(lp)] = _LP_NAN
    return codes


def _probability_codes(p: np.ndarray) -> np.ndarray:
    """Probabilities → uint16 steps of 1/_P_SCALE (NaN has a code of its own)."""
    codes: np.ndarray = np.rint(np.clip(np.nan_to_num(p, nan=0.0), 0.0, 1.0) * _P_SCALE).astype(
        np.uint16
    )
    codes[np.isnan(p)] = _P_NAN
    return codes


def _kept(values: np.ndarray, row_length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where rows of `row_length` laid end to end in `values` are at or above CONTROL_FLOOR (or
    NaN): (index into values, the gap from the row's previous kept position — from 0 for its
    first — and how many each row keeps)."""
    n_rows = len(values) // row_length if row_length else 0
    at = np.flatnonzero(~(values < CONTROL_FLOOR))  # NaN is kept
    row = at // row_length if row_length else at
    position = at - row * row_length
    gaps = np.diff(position, prepend=0)
    starts = np.flatnonzero(np.diff(row, prepend=-1))  # each row's first kept position
    gaps[starts] = position[starts]
    counts = np.bincount(row, minlength=n_rows) if n_rows else np.zeros(0, dtype=np.int64)
    return at, gaps.astype(np.uint32), counts


def _sparse(length: int, counts: np.ndarray, gaps: np.ndarray, codes: np.ndarray) -> bytes:
    """One rollout's control-token rows, sparse: its length, each row's count of kept positions,
    then every row's gaps (uint32) and every row's codes (uint16), each shuffled; compressed."""
    head = np.concatenate(([length], counts)).astype("<u4").tobytes()
    return _pack(head + _shuffle(gaps) + _shuffle(codes))


# --- ids, logprobs, control-token probabilities ------------------------------------------------


def encode_ids(ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids → compressed bytes (exact): the shorter of their bit-length coding (ids drawn
    independently: every value its own) and zstd over the plain little-endian ids, 2 bytes each
    where they fit, else 4 (real text repeats runs of tokens, which zstd's matches find)."""
    values = np.asarray(ids, dtype=np.int32)
    found = [_code_bits(values.view(np.uint32))]
    if len(values):
        if int(values.min()) >= 0 and int(values.max()) < 1 << 16:
            found.append(bytes([RAW_UINT16]) + _pack(values.astype("<u2").tobytes()))
        else:
            found.append(bytes([RAW_INT32]) + _pack(values.astype("<i4").tobytes()))
    return min(found, key=len)


def decode_ids(data: bytes | None) -> np.ndarray:
    """Compressed bytes → token ids (int64, as the write entity holds them)."""
    if not data:
        return np.zeros(0, dtype=np.int64)
    kind = data[0]
    if kind in (BIT_LENGTH_CODED, BUCKET_CODED):
        values = _decode_coded(data).view(np.int32)
    elif kind == RAW_UINT16:
        values = np.frombuffer(_unpack(data[1:]), "<u2")
    elif kind == RAW_INT32:
        values = np.frombuffer(_unpack(data[1:]), "<i4")
    else:  # a zstd frame: byte-shuffled int32, as the store wrote ids before
        values = _unshuffle(_unpack(data), "i4")
    return values.astype(np.int64)


def _logprob_blob(codes: np.ndarray) -> bytes:
    """Logprob codes → their bucket coding, or byte-shuffled zstd where that is shorter (tried
    only where the bucket symbols compress well: _shuffle_tried)."""
    bucket = _code_buckets(codes)
    if not _shuffle_tried(_LENGTHS.unpack_from(bucket)[1], len(codes)):
        return bucket
    return min(bucket, _pack(_shuffle(codes)), key=len)


SHUFFLE_TRIED = 4  # bits a bucket symbol, compressed: below it, byte-shuffled zstd is tried too


def _shuffle_tried(coded_symbols: int, n: int) -> bool:
    """Whether a logprob row of `n` values whose bucket symbols compress to `coded_symbols`
    bytes repeats enough for byte-shuffled zstd to be tried as well."""
    return n == 0 or coded_symbols * 8 < SHUFFLE_TRIED * n


def encode_logprobs(logprobs: Sequence[float] | np.ndarray) -> bytes:
    """Per-token logprobs (a list, or an array taken as it is) → compressed uint16 steps of
    1/LOGPROB_SCALE nat."""
    return _logprob_blob(_logprob_codes(_as_floats(logprobs)))


def decode_logprobs(data: bytes | None) -> np.ndarray:
    """Compressed bytes → per-token logprobs, float64 (−inf and NaN as they were written)."""
    if not data:
        return np.zeros(0)
    codes = (
        _decode_coded(data).astype(np.uint16) if _coded(data) else _unshuffle(_unpack(data), "u2")
    )
    return _logprob_values(codes)


def _logprob_values(codes: np.ndarray) -> np.ndarray:
    """Logprob codes → float64 logprobs (−inf and NaN as they were written)."""
    values = codes.astype(np.float64) / -LOGPROB_SCALE + 0.0  # + 0.0: no -0.0
    values[codes == _LP_NEG_INF] = -math.inf
    values[codes == _LP_NAN] = math.nan
    return values


def stored_logprobs(logprobs: Sequence[float] | np.ndarray) -> np.ndarray:
    """Logprobs as the store reads them back (decode_logprobs of encode_logprobs), without
    coding them: what a figure computed on the write path must see to equal the one the pages
    compute from the stored arrays."""
    return _logprob_values(_logprob_codes(_as_floats(logprobs)))


def _fit(row: Sequence[float], length: int) -> Sequence[float]:
    """A control-token row cut or padded (with 0.0) to the completion's length."""
    if len(row) == length:
        return row
    return [*row[:length], *[0.0] * (length - len(row))]


def encode_control(rows: Sequence[Sequence[float]], length: int) -> bytes:
    """Each control token's probability at each of `length` positions → compressed sparse rows
    (only the positions where it is at least CONTROL_FLOOR, or NaN)."""
    values = _floats([_fit(row, length) for row in rows])
    at, gaps, counts = _kept(values, length)
    counts = counts if length else np.zeros(len(rows), dtype=np.int64)
    return _sparse(length, counts, gaps, _probability_codes(values[at]))


def _as_floats(row: Sequence[float] | np.ndarray) -> np.ndarray:
    """One row of floats as float64 (an array as it is, a list read in C; None or another
    non-number: NaN, as a chart would show it)."""
    if isinstance(row, np.ndarray):
        return row.astype(np.float64, copy=False).reshape(-1)
    try:
        return np.frombuffer(array("d", row), dtype=np.float64)
    except TypeError:
        return _floats([row])


def _control_rows(control: ControlRows, length: int) -> np.ndarray:
    """A rollout's control-token probabilities as [token × position] float64, `length` wide: a
    2-D array is [position × token] (the step entity's orientation); a sequence holds one row
    per token (each cut or padded with 0.0 to the completion's length)."""
    if isinstance(control, np.ndarray) and control.ndim == 2:
        by_token = control.astype(np.float64, copy=False).T
        if by_token.shape[1] != length:
            fitted = np.zeros((by_token.shape[0], length))
            n = min(length, by_token.shape[1])
            fitted[:, :n] = by_token[:, :n]
            by_token = fitted
        return by_token
    out = np.zeros((len(control), length))
    for k, row in enumerate(control):
        values = _as_floats(row)
        n = min(length, len(values))
        out[k, :n] = values[:n]
    return out


def encode_rollouts(
    ids: Sequence[Sequence[int] | np.ndarray],
    logprobs: Sequence[Sequence[float] | np.ndarray],
    control: Sequence[ControlRows],
) -> list[tuple[bytes, bytes, bytes]]:
    """Many rollouts' (ids, logprobs, control-token probabilities) → their three blobs each, as
    encode_ids, encode_logprobs and encode_control write them, byte for byte: every numpy pass
    runs over a chunk of rollouts at once (BATCH_VALUES values or so), and what is left a
    rollout is cutting its slices and compressing them (per rollout the numpy calls alone cost
    more than the database write). Arrays are taken as they are (no Python floats on the way);
    lists are read in C."""
    if not len(ids) == len(logprobs) == len(control):
        raise ValueError("ids, logprobs and control-token probabilities: one each a rollout")
    lengths = [len(x) for x in ids]
    lp_rows = [_as_floats(x) for x in logprobs]
    blobs = [
        (id_blob, lp_blob, control_blob)
        for chunk in _chunks([len(x) for x in lp_rows], lengths)
        for id_blob, lp_blob, control_blob in zip(
            _id_blobs([np.asarray(ids[i], dtype=np.int32).reshape(-1) for i in chunk]),
            _logprob_blobs([lp_rows[i] for i in chunk]),
            _control_blobs([control[i] for i in chunk], [lengths[i] for i in chunk]),
            strict=True,
        )
    ]
    return blobs


BATCH_VALUES = 1 << 16  # values coded in one numpy pass: bounds the temporary arrays


def _chunks(*sizes: Sequence[int]) -> list[range]:
    """Consecutive runs of rollouts whose values (the most of `sizes`) stay near BATCH_VALUES."""
    out: list[range] = []
    start, held = 0, 0
    for i, size in enumerate(map(max, *sizes)):
        if held and held + size > BATCH_VALUES:
            out.append(range(start, i))
            start, held = i, 0
        held += size
    out.append(range(start, len(sizes[0])))
    return out if len(sizes[0]) else []


def _bounds(rows: Sequence[np.ndarray]) -> tuple[np.ndarray, list[int]]:
    """Rows laid end to end, and where each starts (and the last ends)."""
    joined = np.concatenate(rows) if rows else np.zeros(0)
    ends = [0, *accumulate(len(r) for r in rows)]
    return joined, ends


_LOW_MASKS = np.array([(1 << c) - 1 for c in range(33)], dtype=np.uint64)  # c low bits


def _low_bits_many(values: np.ndarray, counts: np.ndarray, ends: Sequence[int]) -> list[bytes]:
    """_low_bits of each run values[ends[i]:ends[i + 1]] (each padded to whole bytes), found for
    all the runs in one pass a value, not a bit: each value's low `counts` bits (at most 32)
    are shifted to their place in the byte-aligned stream of all the runs (a run's padding
    counted with its last value) and added into the 64-bit little-endian word they start in
    (bits never overlap: a sum is their OR); the few that cross into the next word add their
    high bits there."""
    n = len(ends) - 1
    bounds = np.asarray(ends)
    counts = counts.astype(np.int64, copy=False)
    run_bits = np.diff(np.concatenate(([0], np.cumsum(counts)))[bounds])
    pads = -run_bits % 8
    byte_ends = np.concatenate(([0], np.cumsum((run_bits + pads) // 8)))
    steps = counts.copy()  # each value's bits and, for a run's last, the run's padding
    nonempty = bounds[1:] > bounds[:-1]
    steps[bounds[1:][nonempty] - 1] += pads[nonempty]
    first = np.cumsum(steps) - steps  # each value's first bit in the stream
    low = values.astype(np.uint64) & _LOW_MASKS[counts]
    offset = (first & 63).astype(np.uint64)
    word = first >> 6
    words = np.zeros((int(byte_ends[-1]) + 7) // 8 + 2, dtype=np.uint64)
    np.add.at(words, word, low << offset)
    cross = np.flatnonzero(offset + counts.astype(np.uint64) > 64)  # an offset above 32
    words[word[cross] + 1] += low[cross] >> (np.uint64(64) - offset[cross])
    packed = words.astype("<u8").tobytes()
    return [packed[byte_ends[i] : byte_ends[i + 1]] for i in range(n)]


def _id_blobs(rows: Sequence[np.ndarray]) -> list[bytes]:
    """encode_ids of each row of int32 ids: its bit-length coding and its plain coding found
    for all the rows at once, the shorter kept."""
    values, ends = _bounds(rows)
    values = values.astype(np.int32, copy=False)
    v = values.view(np.uint32)
    widths = _bit_lengths(v)
    lows = _low_bits_many(v, np.maximum(widths.astype(np.int64) - 1, 0), ends)
    plain32, plain16 = values.astype("<i4"), values.astype("<u2")
    # which rows' ids fit in two bytes (a row with none is never asked)
    nonempty = np.flatnonzero(np.diff(ends))
    fits = np.zeros(len(rows), dtype=bool)
    if len(nonempty):
        starts = np.asarray(ends)[nonempty]
        low, high = np.minimum.reduceat(values, starts), np.maximum.reduceat(values, starts)
        fits[nonempty] = (low >= 0) & (high < 1 << 16)
    out = []
    for i in range(len(rows)):
        a, b = ends[i], ends[i + 1]
        lengths = _pack(widths[a:b].tobytes())
        found = [_LENGTHS.pack(BIT_LENGTH_CODED, len(lengths)) + lengths + lows[i]]
        if b > a:
            if fits[i]:
                found.append(bytes([RAW_UINT16]) + _pack(plain16[a:b].tobytes()))
            else:
                found.append(bytes([RAW_INT32]) + _pack(plain32[a:b].tobytes()))
        out.append(min(found, key=len))
    return out


def _logprob_blobs(rows: Sequence[np.ndarray]) -> list[bytes]:
    """_logprob_blob of each row of logprobs: their codes, bucket symbols and byte planes found
    for all the rows at once, the shorter coding kept (the planes tried as _logprob_blob tries
    them)."""
    joined, ends = _bounds(rows)
    codes = _logprob_codes(joined)
    v = codes.astype(np.uint32)
    widths = _bit_lengths(v).astype(np.int64)
    below = np.maximum(widths - 1 - _TOP, 0)
    top = (v >> below.astype(np.uint32)).astype(np.int64)
    symbols = np.where(
        below == 0, v, _EXACT + (widths - _TOP - 2) * (1 << _TOP) + top - (1 << _TOP)
    ).astype(np.uint8)
    lows = _low_bits_many(v, below, ends)
    planes = codes.astype("<u2").view(np.uint8)
    low_bytes, high_bytes = planes[0::2], planes[1::2]
    out = []
    for i in range(len(rows)):
        a, b = ends[i], ends[i + 1]
        coded = _pack(symbols[a:b].tobytes())
        bucket = _LENGTHS.pack(BUCKET_CODED, len(coded)) + coded + lows[i]
        if _shuffle_tried(len(coded), b - a):
            bucket = min(
                bucket, _pack(low_bytes[a:b].tobytes() + high_bytes[a:b].tobytes()), key=len
            )
        out.append(bucket)
    return out


def _control_blobs(control: Sequence[ControlRows], lengths: Sequence[int]) -> list[bytes]:
    """_sparse of each rollout's control-token rows: the kept positions of every row of every
    rollout found at once (a rollout's rows are consecutive: its kept positions are one slice)."""
    by_token = [_control_rows(rows, n) for rows, n in zip(control, lengths, strict=True)]
    n_rows = by_token[0].shape[0] if by_token else 0
    values = np.concatenate([m.reshape(-1) for m in by_token]) if by_token else np.zeros(0)
    at = np.flatnonzero(~(values < CONTROL_FLOOR))
    codes = _probability_codes(values[at])
    row_starts = np.repeat(np.cumsum([0, *lengths[:-1]]) * n_rows, n_rows) + np.tile(
        np.arange(n_rows), len(lengths)
    ) * np.repeat(lengths, n_rows)
    row_of = np.searchsorted(row_starts, at, side="right") - 1
    position = at - row_starts[row_of]
    gaps = np.diff(position, prepend=0)
    firsts = np.flatnonzero(np.diff(row_of, prepend=-1))
    gaps[firsts] = position[firsts]
    gaps = gaps.astype(np.uint32)
    counts = np.bincount(row_of, minlength=len(row_starts))
    ends = np.cumsum(counts)
    # _sparse of each rollout, its head (length, each row's count) and its gaps' and codes'
    # byte planes cut from arrays made once (numpy calls a rollout cost more than its bytes)
    heads = np.column_stack(
        (np.asarray(lengths), counts[: len(lengths) * n_rows].reshape(len(lengths), n_rows))
    ).astype("<u4")
    gap_planes, code_planes = _planes(gaps), _planes(codes)
    out = []
    for i in range(len(lengths)):
        first_row = i * n_rows
        a = int(ends[first_row - 1]) if first_row else 0
        b = int(ends[first_row + n_rows - 1]) if n_rows else a
        out.append(
            _pack(heads[i].tobytes() + gap_planes[:, a:b].tobytes() + code_planes[:, a:b].tobytes())
        )
    return out


def decode_control(data: bytes | None, n_rows: int) -> np.ndarray:
    """Compressed sparse rows of `n_rows` control tokens → [position × token] float64, the
    write entity's orientation (0.0 where nothing was stored; no rows: not measured)."""
    if not data or n_rows == 0:
        return np.zeros((0, n_rows))
    raw = _unpack(data)
    head = np.frombuffer(raw, "<u4", 1 + n_rows, 0)
    length, counts = int(head[0]), head[1:].astype(np.int64)
    total = int(counts.sum())
    at = 4 * (1 + n_rows)
    gaps = _unshuffle(raw[at : at + 4 * total], "u4").astype(np.int64)
    codes = _unshuffle(raw[at + 4 * total : at + 6 * total], "u2")
    values = codes.astype(np.float64) / _P_SCALE
    values[codes == _P_NAN] = math.nan
    dense = np.zeros((length, n_rows), dtype=np.float64)
    row = np.repeat(np.arange(n_rows), counts)
    if total:
        # positions: the running sum of gaps, restarted at each row's first (an empty row starts
        # where the next one does)
        running = np.cumsum(gaps)
        before = np.concatenate(([0], running))[np.concatenate(([0], np.cumsum(counts)[:-1]))]
        dense[running - np.repeat(before, counts), row] = values
    return dense


# --- text --------------------------------------------------------------------------------------


def encode_text(text: str) -> bytes:
    """A completion's text → compressed bytes (surrogates kept, as the store's text is)."""
    return _pack(text.encode("utf-8", "surrogatepass"))


def decode_text(data: bytes) -> str:
    return _unpack(data).decode("utf-8", "surrogatepass")


# TEXT_RULES (server.core.tokentext): rule id → how token pieces become text; a stored text_rule
# also says how many trailing tokens the text leaves out (text_rule = id + 8 × dropped).
MAX_DROPPED = 2


def text_rule(text: str, ids: Sequence[int] | np.ndarray, texts: Mapping[int, str]) -> int | None:
    """The rule that rebuilds `text` exactly from the token texts of `ids`, or None (then the
    text is stored)."""
    if isinstance(ids, np.ndarray):
        ids = ids.tolist()
    if not ids:
        return None
    try:
        pieces = list(itemgetter(*ids)(texts)) if len(ids) > 1 else [texts[ids[0]]]
    except KeyError:
        return None
    return pieces_rule(text, pieces)


def pieces_rule(text: str, pieces: Sequence[str]) -> int | None:
    """The rule that rebuilds `text` exactly from its tokens' texts `pieces`, or None."""
    for dropped in range(min(MAX_DROPPED, len(pieces) - 1) + 1):
        kept = pieces[: len(pieces) - dropped]
        for rule, build in TEXT_RULES.items():
            try:
                if build(kept) == text:
                    return rule + 8 * dropped
            except (ValueError, UnicodeError):
                continue
    return None


def rebuild_text(rule: int, ids: Sequence[int], texts: Mapping[int, str]) -> str:
    """The completion text that `text_rule` said `ids` rebuild."""
    build, dropped = TEXT_RULES[rule % 8], rule // 8
    kept = ids[: len(ids) - dropped] if dropped else ids
    return build([texts[i] for i in kept])


def rebuild_from_pieces(rule: int, pieces: Sequence[str]) -> str:
    """The completion text that `text_rule` said these pieces (its ids' texts) rebuild."""
    build, dropped = TEXT_RULES[rule % 8], rule // 8
    return build(pieces[: len(pieces) - dropped] if dropped else pieces)


def completion(
    rule: int | None, ids: bytes | None, text: bytes | None, texts: Mapping[int, str]
) -> str:
    """A stored completion's text: rebuilt from its ids by `rule`, else its stored text."""
    if rule is not None:
        return rebuild_text(rule, decode_ids(ids).tolist(), texts)
    return decode_text(text) if text is not None else ""


def preview(rule: int, pieces: Sequence[str]) -> str:
    """The text the first pieces of a completion make under `rule` (a head: the cut may fall
    inside a character, whose pieces are then left out)."""
    build = TEXT_RULES[rule % 8]
    for cut in range(min(4, len(pieces)) + 1):
        try:
            return build(pieces[: len(pieces) - cut])
        except (ValueError, UnicodeError):
            continue
    return ""


def text_head(data: bytes, n_chars: int) -> str:
    """The first n_chars characters of a stored text, decompressing no more than needed."""
    with _zstd()[1].stream_reader(data) as reader:
        raw = reader.read(4 * n_chars)
    return raw.decode("utf-8", "ignore")[:n_chars]


# --- blobs received from elsewhere (a trainer recording over HTTP) -----------------------------


def _bounded(data: bytes, most: int, what: str) -> bytes:
    """zstd frame → its bytes, refused (ValueError naming `what`) unless the frame says its size
    and that size is at most `most`: a hostile frame never makes us allocate what it claims."""
    try:
        size = zstandard.frame_content_size(data)
    except zstandard.ZstdError:
        raise ValueError(f"{what}: not a zstd frame") from None
    if size < 0:
        raise ValueError(f"{what}: a zstd frame that does not say its size")
    if size > most:
        raise ValueError(f"{what}: decompresses to {size:,} bytes, more than {most:,}")
    try:
        raw = _unpack(data)
    except zstandard.ZstdError as exc:
        raise ValueError(f"{what}: not a whole zstd frame ({exc})") from None
    if len(raw) != size:
        raise ValueError(f"{what}: decompressed to {len(raw):,} bytes, not the {size:,} it says")
    return raw


def _bits_checked(data: bytes, length: int, widest: int, what: str) -> np.ndarray:
    """BIT_LENGTH_CODED or BUCKET_CODED bytes → exactly `length` values of at most `widest`
    bits; ValueError otherwise (the symbols' frame bounded, the bits below them exactly as many
    as they say)."""
    if len(data) < _LENGTHS.size:
        raise ValueError(f"{what}: too short for a bit-length coded array")
    _, size = _LENGTHS.unpack_from(data)
    at = _LENGTHS.size
    if size > len(data) - at:
        raise ValueError(f"{what}: says {size:,} bytes of bit lengths, more than it holds")
    symbols = np.frombuffer(_bounded(data[at : at + size], length, what), np.uint8)
    if len(symbols) != length:
        raise ValueError(f"{what}: holds {len(symbols):,} values, not the {length:,} of its length")
    if data[0] == BUCKET_CODED:
        top, below = _bucket_widths(symbols)
        widths = np.where(below > 0, below + _TOP + 1, _bit_lengths(top.astype(np.uint32)))
    else:
        widths = symbols.astype(np.int64)
        below = np.maximum(widths - 1, 0)
    if len(widths) and int(widths.max()) > widest:
        raise ValueError(f"{what}: a value of {int(widths.max())} bits, more than {widest}")
    bits = int(below.sum())
    if len(data) - at - size != (bits + 7) // 8:
        raise ValueError(f"{what}: {len(data) - at - size:,} bytes do not hold {bits:,} bits")
    return _decode_bits(data) if data[0] == BIT_LENGTH_CODED else _decode_buckets(data, symbols)


def decode_ids_checked(data: bytes, length: int, what: str = "ids") -> np.ndarray:
    """Blob of encode_ids (any of its codings) → exactly `length` int64 ids, none negative;
    ValueError otherwise."""
    kind = data[0] if data else None
    if kind in (BIT_LENGTH_CODED, BUCKET_CODED):
        ids = _bits_checked(data, length, 32, what).view(np.int32).astype(np.int64)
    elif kind in (RAW_UINT16, RAW_INT32):
        width, dtype = (2, "<u2") if kind == RAW_UINT16 else (4, "<i4")
        raw = _bounded(data[1:], width * length, what)
        if len(raw) != width * length:
            raise ValueError(
                f"{what}: holds {len(raw) // width:,} ids, not the {length:,} of its length"
            )
        ids = np.frombuffer(raw, dtype).astype(np.int64)
    else:  # byte-shuffled int32 in a zstd frame, as the store wrote ids before
        raw = _bounded(data, 4 * length, what)
        if len(raw) != 4 * length:
            raise ValueError(
                f"{what}: holds {len(raw) // 4:,} ids, not the {length:,} of its length"
            )
        ids = _unshuffle(raw, "i4").astype(np.int64)
    if len(ids) and int(ids.min()) < 0:
        raise ValueError(f"{what}: a negative token id ({int(ids.min())})")
    return ids


def decode_logprobs_checked(data: bytes, length: int, what: str = "logprobs") -> np.ndarray:
    """Blob of encode_logprobs (either of its codings) → exactly `length` float64 logprobs;
    ValueError otherwise."""
    if data and _coded(data):
        codes = _bits_checked(data, length, 16, what).astype(np.uint16)
    else:
        raw = _bounded(data, 2 * length, what)
        if len(raw) != 2 * length:
            raise ValueError(f"{what}: holds {len(raw) // 2:,} values, not {length:,}")
        codes = _unshuffle(raw, "u2")
    if np.any((codes > _LP_MAX) & (codes < _LP_NEG_INF)):
        raise ValueError(f"{what}: a code outside the logprob range")
    values = codes.astype(np.float64) / -LOGPROB_SCALE + 0.0
    values[codes == _LP_NEG_INF] = -math.inf
    values[codes == _LP_NAN] = math.nan
    return values


def decode_control_checked(
    data: bytes, n_rows: int, length: int, what: str = "control"
) -> np.ndarray:
    """Blob of encode_control → [position × token] float64 (`length` × `n_rows`), every count,
    gap and code checked against the layout; ValueError otherwise."""
    most = 4 * (1 + n_rows) + 6 * n_rows * length
    raw = _bounded(data, most, what)
    if len(raw) < 4 * (1 + n_rows):
        raise ValueError(f"{what}: too short for {n_rows} control tokens")
    head = np.frombuffer(raw, "<u4", 1 + n_rows, 0)
    if int(head[0]) != length:
        raise ValueError(f"{what}: says {int(head[0]):,} positions, not the {length:,} of its ids")
    counts = head[1:].astype(np.int64)
    if np.any(counts > length):
        raise ValueError(f"{what}: a row keeps more positions than the completion has")
    total = int(counts.sum())
    if len(raw) != 4 * (1 + n_rows) + 6 * total:
        raise ValueError(f"{what}: {len(raw):,} bytes do not hold {total:,} kept positions")
    at = 4 * (1 + n_rows)
    gaps = _unshuffle(raw[at : at + 4 * total], "u4").astype(np.int64)
    codes = _unshuffle(raw[at + 4 * total :], "u2")
    if np.any((codes > _P_SCALE) & (codes != _P_NAN)):
        raise ValueError(f"{what}: a probability code above 1")
    dense = np.zeros((n_rows, length), dtype=np.float64)
    if total:
        running = np.cumsum(gaps)
        starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        before = np.concatenate(([0], running))[starts]
        position = running - np.repeat(before, counts)
        row = np.repeat(np.arange(n_rows), counts)
        same = np.diff(row) == 0  # positions within a row rise strictly
        if np.any(position >= length) or np.any(np.diff(position)[same] <= 0):
            raise ValueError(f"{what}: a kept position outside the completion, or repeated")
        values = codes.astype(np.float64) / _P_SCALE
        values[codes == _P_NAN] = math.nan
        dense[row, position] = values
    return dense.T.copy()
