"""bfloat16 (ml_dtypes), loaded when first used.

``import ml_dtypes`` costs several times ``import numpy`` (its extension
registers a dozen dtypes and their casts), so ``import dspark_core`` does not
pay it: :func:`dtype` imports it on first call. :func:`is_bf16` answers
without importing it: no bfloat16 array or dtype can exist before ml_dtypes
has been imported (numpy knows the type only once ml_dtypes registers it), so
while ``ml_dtypes`` is not in ``sys.modules`` the answer is False.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

__all__ = ["dtype", "is_bf16", "as_dtype"]

_DTYPE: np.dtype | None = None


def dtype() -> np.dtype:
    """numpy's dtype of ml_dtypes' bfloat16 (imports ml_dtypes the first time)."""
    global _DTYPE
    if _DTYPE is None:
        import ml_dtypes

        _DTYPE = np.dtype(ml_dtypes.bfloat16)
    return _DTYPE


def is_bf16(dt: Any) -> bool:
    """Whether ``dt`` (a numpy dtype) is ml_dtypes' bfloat16; never imports ml_dtypes."""
    if "ml_dtypes" not in sys.modules:
        return False
    return bool(dt == dtype())


def as_dtype(value: Any) -> np.dtype:
    """``np.dtype(value)``, where the name ``"bfloat16"`` loads ml_dtypes first (numpy
    resolves that name only once ml_dtypes has registered it)."""
    if isinstance(value, str) and value == "bfloat16":
        return dtype()
    return np.dtype(value)
