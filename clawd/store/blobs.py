"""Compact, exact byte encodings for token arrays stored as SQLite BLOBs.

Boundary: pure NumPy <-> bytes conversion, no database access. Everything is
little-endian and fixed-width so a row written on one machine reads the same on any
other: token ids as int32 (4 bytes each), log-probs as float32 (4 bytes each), and
2-D arrays (teacher top-k ids / log-probs) as raw C-order data with the shape kept by
the caller.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_IDS = np.dtype("<i4")
_FLOATS = np.dtype("<f4")
_I32 = np.iinfo(np.int32)


def pack_ids(ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids -> int32 little-endian bytes (4 bytes per token).

    Raises:
        ValueError: a value is not an integer or does not fit in int32 (casting would
            silently wrap it and corrupt training data).
    """
    arr = np.asarray(ids)
    if arr.size == 0:
        return b""
    if arr.ndim != 1:
        raise ValueError(f"token ids must be 1-D, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.dtype != _IDS and (arr.min() < _I32.min or arr.max() > _I32.max):
        raise ValueError("token id out of int32 range")
    return arr.astype(_IDS, copy=False).tobytes()


def unpack_ids(data: bytes) -> list[int]:
    """Inverse of pack_ids."""
    _check_width(data, _IDS.itemsize)
    return np.frombuffer(data, dtype=_IDS).tolist()


def pack_floats(values: Sequence[float] | np.ndarray) -> bytes:
    """Floats -> float32 little-endian bytes. float32 inputs round-trip exactly."""
    arr = np.asarray(values, dtype=_FLOATS)
    if arr.ndim != 1:
        raise ValueError(f"float sequence must be 1-D, got shape {arr.shape}")
    return arr.tobytes()


def unpack_floats(data: bytes) -> np.ndarray:
    """Inverse of pack_floats: a writable, native float32 array."""
    _check_width(data, _FLOATS.itemsize)
    return np.frombuffer(data, dtype=_FLOATS).astype(np.float32)


def pack_array(arr: np.ndarray) -> bytes:
    """Any numeric array -> little-endian C-order bytes; keep dtype and shape beside it."""
    arr = np.asarray(arr)
    return np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes()


def unpack_array(data: bytes, dtype: np.dtype | str, shape: tuple[int, ...]) -> np.ndarray:
    """Inverse of pack_array; returns a writable array in native byte order."""
    native = np.dtype(dtype)
    _check_width(data, native.itemsize)
    flat = np.frombuffer(data, dtype=native.newbyteorder("<"))
    if flat.size != int(np.prod(shape, dtype=np.int64)):
        raise ValueError(f"{flat.size} values do not fill shape {tuple(shape)}")
    return flat.reshape(shape).astype(native)


def _check_width(data: bytes, width: int) -> None:
    if len(data) % width:
        raise ValueError(f"blob of {len(data)} bytes is not a whole number of {width}-byte values")
