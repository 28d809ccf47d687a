"""Argument normalisation shared by the Stager binding and the reference.

Both sides raise the same exception *types* for the same bad input because
they normalise arguments here; the C++ core then re-checks every value it is
given (it never trusts its caller).
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

__all__ = [
    "MAX_POSITION", "ROW_DTYPES", "as_index", "as_count", "as_positions", "as_rows", "as_encoded", "row_dtype_code",
    "readable_bytes", "writable_bytes", "check_rows_given", "require_held_rows",
]

#: Positions are int64 in the core; keep well clear of overflow in ``pos + B``.
#: A row's position is below ``MAX_POSITION - 1`` so a sequence's end (last
#: position + 1), and every ``n_past``, stays below ``MAX_POSITION``.
MAX_POSITION = 1 << 62


def _bf16() -> np.dtype:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


#: Input row dtypes by core code (matches ``dspark::ElemType``).
ROW_DTYPES = {"float32": 0, "float16": 1, "bfloat16": 2}


def as_index(name: str, value: Any) -> int:
    """``operator.index(value)`` with a TypeError that names the argument."""
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None


def as_count(name: str, value: Any) -> int:
    """A position-like count (``n_past``, ``n_keep``, ...): an integer in ``[0, MAX_POSITION)``."""
    v = as_index(name, value)
    if not 0 <= v < MAX_POSITION:
        raise ValueError(f"{name} must be in [0, 2**62), got {v}")
    return v


def as_positions(positions: Any) -> np.ndarray:
    """Positions as a 1-D contiguous int64 array.

    Raises:
        TypeError: not integers.
        ValueError: not 1-D, or outside ``[0, MAX_POSITION)``.
    """
    arr = np.asarray(positions)
    if arr.size == 0:
        arr = arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"positions must be integers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"positions must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) >= MAX_POSITION - 1:
        raise ValueError(f"position {int(arr.max())} is out of range [0, 2**62 - 1)")
    out = np.ascontiguousarray(arr, dtype=np.int64)
    if out.size and (int(out.min()) < 0 or int(out.max()) >= MAX_POSITION - 1):
        bad = int(out.min()) if int(out.min()) < 0 else int(out.max())
        raise ValueError(f"position {bad} is out of range [0, 2**62 - 1)")
    return out


def row_dtype_code(dtype: np.dtype) -> int:
    """Core element-type code of a row dtype, or TypeError."""
    name = dtype.name
    code = ROW_DTYPES.get(name)
    if code is None or (name == "bfloat16" and dtype != _bf16()):
        raise TypeError(f"rows must be float32, float16 or bfloat16 (ml_dtypes), got dtype {dtype}")
    return code


def as_rows(rows: Any, feature_dim: int) -> np.ndarray:
    """Rows as a C-contiguous ``(n, feature_dim)`` float32/float16/bfloat16 array.

    Raises:
        TypeError: not an array of a supported float dtype.
        ValueError: wrong number of dimensions or row width.
    """
    if not isinstance(rows, np.ndarray):
        raise TypeError(f"rows must be a numpy array, got {type(rows).__name__}")
    row_dtype_code(rows.dtype)
    if rows.ndim != 2 or rows.shape[1] != feature_dim:
        raise ValueError(f"rows must have shape (n, {feature_dim}), got {rows.shape}")
    if not rows.dtype.isnative:  # e.g. '>f4': the core reads native-endian values
        rows = rows.astype(rows.dtype.newbyteorder("="))
    return np.ascontiguousarray(rows)


def as_encoded(data: Any, n: int, row_bytes: int) -> np.ndarray:
    """Rows already in storage format as a flat contiguous uint8 array.

    Accepts uint8 ``(n, row_bytes)`` or ``(n * row_bytes,)`` arrays and any
    bytes-like object (``bytes``, ``bytearray``, ``memoryview``) of
    ``n * row_bytes`` bytes, read as raw bytes whatever its item format.

    Raises:
        TypeError: not uint8 / not bytes-like.
        ValueError: wrong shape or length.
    """
    if isinstance(data, (bytes, bytearray, memoryview)):
        try:
            data = np.frombuffer(data, np.uint8)  # the raw bytes, whatever the item format
        except (ValueError, BufferError) as exc:
            raise TypeError(f"encoded rows must be a contiguous buffer ({exc})") from None
    arr = np.asarray(data)
    if arr.dtype != np.uint8:
        raise TypeError(f"encoded rows must be uint8, got dtype {arr.dtype}")
    if arr.ndim == 2:
        if arr.shape != (n, row_bytes):
            raise ValueError(f"encoded rows must have shape ({n}, {row_bytes}), got {arr.shape}")
    elif arr.ndim != 1 or arr.shape[0] != n * row_bytes:
        raise ValueError(f"encoded rows must be {n} x {row_bytes} bytes, got shape {arr.shape}")
    return np.ascontiguousarray(arr).reshape(-1)


def readable_bytes(data: Any) -> memoryview:
    """``data`` (any buffer: bytes, bytearray, memoryview, ndarray, mmap) as a flat byte view.

    No copy for a C-contiguous buffer; a strided one is copied once.
    """
    try:
        view = memoryview(data)
    except (TypeError, ValueError):
        raise TypeError(f"snapshot data must be bytes-like, got {type(data).__name__}") from None
    if not view.c_contiguous:
        view = memoryview(view.tobytes())
    return view.cast("B")


def writable_bytes(buffer: Any) -> memoryview:
    """``buffer`` as a flat writable byte view (no copy); ``TypeError`` unless it is a
    writable C-contiguous buffer (bytearray, ndarray, mmap, shared memory)."""
    try:
        view = memoryview(buffer)
    except (TypeError, ValueError):
        raise TypeError(f"buffer must support the buffer protocol, got {type(buffer).__name__}") from None
    if view.readonly:
        raise TypeError(f"buffer must be writable, got a read-only {type(buffer).__name__}")
    if not view.c_contiguous:
        raise TypeError(f"buffer must be C-contiguous, got a strided {type(buffer).__name__}")
    return view.cast("B")


def check_rows_given(external: bool, rows: Any) -> None:
    """``process``: rows must be given in held mode and must not be in external-row mode.

    Raises:
        TypeError: naming the mode.
    """
    if external and rows is not None:
        raise TypeError(
            "process: this Stager runs in external-row mode (rows='external') and holds no rows: "
            "call process(seq, positions) without rows and write each row at the slot it returns"
        )
    if not external and rows is None:
        raise TypeError(
            "process: rows are required: this Stager holds its rows (rows='held'); pass the (n, feature_dim) rows "
            "or configure StagerConfig(rows='external')"
        )


def require_held_rows(external: bool, call: str) -> None:
    """A call that needs the rows themselves (``process_encoded``, ``snapshot``
    of rows): a TypeError naming the mode in external-row mode."""
    if external:
        raise TypeError(f"{call}: this Stager runs in external-row mode (rows='external') and holds no rows")
