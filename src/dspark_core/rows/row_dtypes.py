"""The dtypes an owner reads rows in and writes them from: float32, float16 and bfloat16.

bfloat16 is ml_dtypes' (loaded when first used, :mod:`dspark_core.rows._bf16`); a uint16
array passed with ``in_dtype="bfloat16"`` is read as bfloat16 bits. One module, so that
every owner (the ring owners and the prefix tables) checks a row dtype the same way.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _bf16

__all__ = ["ROW_DTYPES", "is_row_dtype", "row_dtype", "input_row_dtype"]

#: Row dtypes the owners read and write, besides bfloat16.
ROW_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))


def is_row_dtype(dt: np.dtype) -> bool:
    """Whether ``dt`` is a row dtype (float32, float16 or bfloat16)."""
    return dt in ROW_DTYPES or _bf16.is_bf16(dt)


def row_dtype(dtype: Any) -> np.dtype:
    """A row dtype given as a name or a dtype (``"bfloat16"``: ml_dtypes' bfloat16)."""
    if isinstance(dtype, str):
        return _bf16.as_dtype(dtype)
    return np.dtype(dtype)


def input_row_dtype(dt: np.dtype, in_dtype: Any, fn: str) -> np.dtype:
    """The row dtype of an input of dtype ``dt`` read as ``in_dtype`` (``"bfloat16"`` reads uint16
    as bfloat16 bits); TypeError naming ``fn`` for anything else."""
    if in_dtype is not None:
        want = row_dtype(in_dtype)
        if _bf16.is_bf16(want) and dt == np.dtype(np.uint16):
            dt = want
        elif want != dt:
            raise TypeError(f"{fn}: in_dtype {want} does not match the array's dtype {dt}")
    if not is_row_dtype(dt):
        raise TypeError(f"{fn}: rows dtype {dt} is not supported; expected float32, float16 or bfloat16")
    return dt
