"""Bit-length coded arrays (server.store.arrays): ids come back exactly, logprobs exactly as the
byte-shuffled zstd blobs the store wrote before gave them back (so no page shows a different
figure), and those older blobs are still read."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import zstandard
from rollout_lens.server.store import arrays


def _shuffled(values: np.ndarray) -> bytes:
    """The older blobs' layout, written here as they were (not the store's own code): little-endian
    values' first bytes, then their second bytes, and so on."""
    raw = values.astype(values.dtype.newbyteorder("<")).view(np.uint8)
    return raw.reshape(-1, values.dtype.itemsize).T.tobytes()


def _old_ids(ids: np.ndarray) -> bytes:
    """Ids as the store wrote them before bit-length coding: int32 bytes shuffled, zstd."""
    return zstandard.ZstdCompressor(level=3).compress(_shuffled(ids.astype(np.int32)))


def _codes(logprobs: np.ndarray) -> np.ndarray:
    """uint16 steps of 1/LOGPROB_SCALE nat down to LOGPROB_FLOOR (65534 for −inf, 65535 for
    NaN), as the store has always quantized logprobs."""
    with np.errstate(invalid="ignore"):
        steps = np.rint(np.clip(-logprobs, 0.0, -arrays.LOGPROB_FLOOR) * arrays.LOGPROB_SCALE)
    codes = np.nan_to_num(steps).astype(np.uint16)
    codes[np.isneginf(logprobs)] = 65534
    codes[np.isnan(logprobs)] = 65535
    return codes


def _old_logprobs(logprobs: np.ndarray) -> bytes:
    """Logprobs as the store wrote them before bit-length coding: their codes shuffled, zstd."""
    return zstandard.ZstdCompressor(level=3).compress(_shuffled(_codes(logprobs)))


def _bit_length_logprobs(logprobs: np.ndarray) -> bytes:
    """Logprobs as the store wrote them before bucket coding, written here as they were: 0x01,
    the size of the zstd frame of each code's bit length (a byte each), that frame, then each
    code's bits below its leading 1, lowest first, packed little-endian."""
    codes = _codes(logprobs).astype(np.int64)
    widths = np.array([int(c).bit_length() for c in codes], dtype=np.uint8)
    lengths = zstandard.ZstdCompressor(level=3).compress(widths.tobytes())
    bits = [(int(c) >> k) & 1 for c in codes for k in range(max(int(c).bit_length() - 1, 0))]
    rest = np.packbits(np.array(bits, dtype=np.uint8), bitorder="little").tobytes()
    return struct.pack("<BI", 1, len(lengths)) + lengths + rest


@pytest.mark.parametrize("n", [0, 1, 2, 7, 1000])
def test_ids_come_back_exactly(n: int) -> None:
    rng = np.random.default_rng(n)
    ids = np.concatenate(
        [rng.integers(0, 2**31 - 1, n // 3), rng.zipf(1.1, n - n // 3) % 150_000]
    ).astype(np.int64)
    ids[: min(n, 3)] = [0, 1, 2**31 - 1][: min(n, 3)]
    blob = arrays.encode_ids(ids)
    assert blob[0] in (
        arrays.BIT_LENGTH_CODED,
        arrays.BUCKET_CODED,
        arrays.RAW_INT32,
        arrays.RAW_UINT16,
    )
    assert arrays.decode_ids(blob).tolist() == ids.tolist()
    # the older blobs are still read
    assert arrays.decode_ids(_old_ids(ids)).tolist() == ids.tolist()


@pytest.mark.parametrize(("top", "kind"), [(50_000, "RAW_UINT16"), (150_000, "RAW_INT32")])
def test_repeated_runs_of_ids_take_the_plain_coding(top: int, kind: str) -> None:
    """Text repeats runs of tokens (code's indentation, a phrase): zstd's matches find them."""
    rng = np.random.default_rng(top)
    phrase = rng.integers(top // 2, top, 40)
    ids = np.concatenate([phrase, rng.integers(0, top, 5)] * 20)
    blob = arrays.encode_ids(ids)
    assert blob[0] == getattr(arrays, kind)
    assert arrays.decode_ids(blob).tolist() == ids.tolist()


def test_negative_ids_come_back_too() -> None:
    ids = [-1, -(2**31), 5, 0]
    assert arrays.decode_ids(arrays.encode_ids(ids)).tolist() == ids


def test_logprobs_read_back_as_the_older_blobs_did() -> None:
    rng = np.random.default_rng(1)
    lp = -rng.exponential(rng.choice([0.01, 0.4, 2.5], 5000))
    lp[:4] = [-math.inf, math.nan, 0.0, -1e-9]
    new, old = arrays.encode_logprobs(lp.tolist()), _old_logprobs(lp)
    got, was = arrays.decode_logprobs(new), arrays.decode_logprobs(old)
    assert new[0] == arrays.BUCKET_CODED and old[0] not in (1, arrays.BUCKET_CODED)
    assert len(new) < len(old)
    assert np.array_equal(np.asarray(got), np.asarray(was), equal_nan=True)
    # the bit-length coded blobs the store wrote before bucket coding are still read, and
    # bucket coding is shorter on such a smooth distribution
    bits = _bit_length_logprobs(lp)
    assert bits[0] == arrays.BIT_LENGTH_CODED and len(new) < len(bits)
    assert np.array_equal(np.asarray(arrays.decode_logprobs(bits)), np.asarray(was), equal_nan=True)
    same = np.full(3000, -0.25)  # one value throughout: zstd's matches beat bit lengths
    assert arrays.encode_logprobs(same.tolist()) == _old_logprobs(same)
    assert arrays.decode_logprobs(arrays.encode_logprobs(same.tolist())).tolist() == [-0.25] * 3000
    # the batch encoder writes the same blobs as the one-rollout encoder
    ((ids, batch_lp, _),) = arrays.encode_rollouts([list(range(len(lp)))], [lp], [[]])
    assert batch_lp == new and arrays.decode_ids(ids).tolist() == list(range(len(lp)))


@pytest.mark.parametrize("n", [0, 1, 7, 1000])
def test_a_received_blob_is_checked_in_every_coding(n: int) -> None:
    """What a trainer sends over HTTP is decoded by the checked readers: every coding the store
    writes (and the older one) reads back as the unchecked readers read it; a blob cut short, or
    one that says another length, is refused with its field's name."""
    rng = np.random.default_rng(n)
    for ids in (rng.integers(0, 2**31 - 1, n), np.tile(rng.integers(0, 300, 8), n // 8 + 1)[:n]):
        blobs = [arrays.encode_ids(ids), _old_ids(ids)]
        blobs += [bytes([arrays.RAW_UINT16]) + zstandard.compress(ids.astype("<u2").tobytes())]
        for blob in blobs[: 3 if int(ids.max(initial=0)) < 1 << 16 else 2]:
            assert arrays.decode_ids_checked(blob, n).tolist() == arrays.decode_ids(blob).tolist()
            with pytest.raises(ValueError, match="^ids: "):
                arrays.decode_ids_checked(blob, n + 1)
            if len(blob) > 12:
                with pytest.raises(ValueError, match="^ids: "):
                    arrays.decode_ids_checked(blob[:-3], n)
    logprobs = -rng.exponential(2.0, n)
    older = _bit_length_logprobs(logprobs)  # bit-length coded, as the store wrote before
    for blob in (arrays.encode_logprobs(logprobs.tolist()), _old_logprobs(logprobs), older):
        checked = arrays.decode_logprobs_checked(blob, n, "lp")
        assert np.array_equal(checked, arrays.decode_logprobs(blob))
        with pytest.raises(ValueError, match="^lp: "):
            arrays.decode_logprobs_checked(blob, n + 1, "lp")
