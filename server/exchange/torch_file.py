"""A file `torch.save` wrote, read without torch (the web process never loads it) and without
running anything it pickles: its zip archive's `data.pkl` unpickled with an allowlist (plain
Python, `collections.OrderedDict`, torch's own tensor rebuild over its storage classes, and
numpy's arrays, dtypes and scalars as numpy pickles them), each tensor rebuilt as a numpy array
from its storage record, sizes checked before they are read.

A pickle can name any callable; one naming anything else is refused, never imported. What a
dump may hold is bounded like every import (server.exchange.bounds): the pickle, each storage
and the whole archive.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
from rollout_lens.server.core.errors import InvalidInput
from rollout_lens.server.exchange import bounds

MAX_PICKLE_BYTES = bounds.MAX_LINE_BYTES  # data.pkl: the samples' plain values
MAX_ARCHIVE_BYTES = 8 * 2**30  # every storage together, uncompressed
MAX_STORAGE = 4 * bounds.MAX_TOKENS  # elements of one storage: a sample's prompt and response
# torch's storage classes → numpy dtypes (bfloat16: its high 16 bits of a float32)
STORAGES: dict[str, np.dtype[Any]] = {
    "FloatStorage": np.dtype("<f4"),
    "DoubleStorage": np.dtype("<f8"),
    "HalfStorage": np.dtype("<f2"),
    "BFloat16Storage": np.dtype("<u2"),
    "LongStorage": np.dtype("<i8"),
    "IntStorage": np.dtype("<i4"),
    "ShortStorage": np.dtype("<i2"),
    "CharStorage": np.dtype("i1"),
    "ByteStorage": np.dtype("u1"),
    "BoolStorage": np.dtype("?"),
}


class _Storage:
    """A storage class named by the pickle: which dtype its bytes are."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.dtype = STORAGES[name]


def _rebuild_tensor(
    storage: np.ndarray, offset: int, size: tuple[int, ...], stride: tuple[int, ...], *_: Any
) -> np.ndarray:
    """torch._utils._rebuild_tensor_v2 for a contiguous tensor, as a numpy array (a copy)."""
    expected = tuple(int(np.prod(size[i + 1 :], dtype=np.int64)) for i in range(len(size)))
    if tuple(stride) != expected and int(np.prod(size, dtype=np.int64)) > 1:
        raise InvalidInput(f"a tensor of stride {tuple(stride)} is not contiguous")
    count = int(np.prod(size, dtype=np.int64))
    if offset < 0 or offset + count > len(storage):
        raise InvalidInput("a tensor reaches past its storage")
    return storage[offset : offset + count].reshape(size).copy()


_NDARRAY = object()  # what `numpy.ndarray` names in a pickle: only _reconstruct's argument


class _Array(np.ndarray):
    """A numpy array as its pickle rebuilds one, its state checked before numpy takes it: at
    most MAX_STORAGE elements, and exactly the data (bytes, or a list of the allowed values)
    its shape and dtype say, so that no shape makes numpy allocate more than the file holds."""

    def __setstate__(self, state: Any) -> None:
        if not (isinstance(state, tuple) and len(state) == 5):
            raise InvalidInput("a numpy array's pickled state of an unknown shape")
        _, shape, dtype, _, data = state
        if not isinstance(shape, tuple) or not all(type(n) is int and n >= 0 for n in shape):
            raise InvalidInput("a numpy array's shape is not a tuple of sizes")
        count = int(np.prod(shape, dtype=np.int64))
        if not isinstance(dtype, np.dtype) or not 0 <= count <= MAX_STORAGE:
            raise InvalidInput(f"a numpy array of {count:,} elements (at most {MAX_STORAGE:,})")
        size = count if dtype.hasobject else count * dtype.itemsize
        if not isinstance(data, list if dtype.hasobject else bytes) or len(data) != size:
            raise InvalidInput("a numpy array whose data does not fill its shape")
        super().__setstate__(state)


def _numpy_array(subtype: Any, shape: Any, dtype: Any) -> np.ndarray:
    """numpy's `_reconstruct` for a plain ndarray: an empty one its pickled state then fills
    (`_Array.__setstate__`)."""
    if subtype is not _NDARRAY:
        raise InvalidInput("a numpy array of a subclass is not a plain value")
    return _Array(0, dtype=np.int8)


def _numpy_dtype(spec: Any, align: Any = False, copy: Any = True) -> np.dtype[Any]:
    """numpy.dtype as its pickle names one: by its type code."""
    if not isinstance(spec, str):
        raise InvalidInput(f"a numpy dtype named by {type(spec).__name__}")
    return np.dtype(spec, align=bool(align), copy=bool(copy))


def _numpy_scalar(dtype: Any, data: Any = None) -> Any:
    """numpy's `scalar`: a numpy number of `dtype` from its bytes."""
    if not isinstance(dtype, np.dtype) or dtype.hasobject or not isinstance(data, bytes):
        raise InvalidInput("a numpy scalar that is not a number")
    if len(data) != dtype.itemsize:
        raise InvalidInput(f"a numpy scalar of {len(data)} bytes, not {dtype.itemsize}")
    return np.frombuffer(data, dtype=dtype)[0]


def _latin1(text: Any, encoding: str = "utf-8") -> bytes:
    """`_codecs.encode` as numpy's pickles use it for raw bytes: latin-1 text to bytes."""
    if not isinstance(text, str) or encoding != "latin1":
        raise InvalidInput("bytes encoded otherwise than numpy's pickles encode them")
    return text.encode("latin1")


def _no_bytes(*args: Any) -> bytes:
    """`bytes()` as a protocol-2 pickle writes empty bytes (an empty array's data): no more."""
    if args:
        raise InvalidInput("bytes made by a call, not the empty bytes of an empty array")
    return b""


NUMPY_CORE = ("numpy._core.multiarray", "numpy.core.multiarray")  # numpy 2, numpy 1
ALLOWED: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("numpy", "ndarray"): _NDARRAY,
    ("numpy", "dtype"): _numpy_dtype,
    ("_codecs", "encode"): _latin1,
    ("__builtin__", "bytes"): _no_bytes,
    ("builtins", "bytes"): _no_bytes,
    **{(core, "_reconstruct"): _numpy_array for core in NUMPY_CORE},
    **{(core, "scalar"): _numpy_scalar for core in NUMPY_CORE},
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, archive: zipfile.ZipFile, prefix: str, where: str) -> None:
        super().__init__(io.BytesIO(data))
        self.archive = archive
        self.prefix = prefix
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED:
            return ALLOWED[module, name]
        if module == "torch" and name in STORAGES:
            return _Storage(name)
        raise InvalidInput(
            f"{self.where}: pickles {module}.{name}, which a torch.save of plain values and "
            "tensors does not hold; refused (a pickle can run code, so nothing else is loaded)"
        )

    def persistent_load(self, pid: Any) -> np.ndarray:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise InvalidInput(f"{self.where}: a storage record of an unknown shape")
        _, kind, key, _, numel = pid
        if not isinstance(kind, _Storage) or not isinstance(key, str) or type(numel) is not int:
            raise InvalidInput(f"{self.where}: a storage record of an unknown shape")
        if not 0 <= numel <= MAX_STORAGE:
            raise InvalidInput(
                f"{self.where}: a storage of {numel:,} elements (at most {MAX_STORAGE:,})"
            )
        try:
            info = self.archive.getinfo(f"{self.prefix}/data/{key}")
        except KeyError:
            raise InvalidInput(
                f"{self.where}: storage {key!r} is missing from the archive"
            ) from None
        if info.file_size != numel * kind.dtype.itemsize:
            raise InvalidInput(
                f"{self.where}: storage {key!r} holds {info.file_size:,} bytes, not "
                f"{numel:,} × {kind.dtype.itemsize}"
            )
        values: np.ndarray = np.frombuffer(self.archive.read(info), dtype=kind.dtype)
        if kind.name == "BFloat16Storage":
            values = (values.astype(np.uint32) << 16).view(np.float32)
        return values


def load(path: Path) -> Any:
    """What torch.save wrote to `path`, tensors as numpy arrays; InvalidInput for a file that is
    not one, is past the bounds, or pickles anything but plain values and tensors."""
    where = str(path)
    try:
        with zipfile.ZipFile(path) as archive:
            infos = archive.infolist()
            pickles = [
                i for i in infos if i.filename.count("/") == 1 and i.filename.endswith("/data.pkl")
            ]
            if len(pickles) != 1:
                raise InvalidInput(f"{where}: not a file torch.save wrote (no data.pkl)")
            if sum(i.file_size for i in infos) > MAX_ARCHIVE_BYTES:
                raise InvalidInput(f"{where}: more than {MAX_ARCHIVE_BYTES:,} bytes unpacked")
            if pickles[0].file_size > MAX_PICKLE_BYTES:
                raise InvalidInput(f"{where}: data.pkl is longer than {MAX_PICKLE_BYTES:,} bytes")
            prefix = pickles[0].filename.split("/")[0]
            data = archive.read(pickles[0])
            return _Unpickler(data, archive, prefix, where).load()
    except InvalidInput:
        raise
    except (zipfile.BadZipFile, EOFError) as exc:
        raise InvalidInput(f"{where}: not a file torch.save wrote ({exc})") from exc
    except (
        pickle.UnpicklingError,
        ValueError,
        TypeError,
        IndexError,
        KeyError,
        AttributeError,
    ) as exc:
        raise InvalidInput(f"{where}: its pickle does not load ({exc})") from exc
    except OSError as exc:
        raise InvalidInput(f"{where}: cannot be read ({exc.strerror})") from exc
