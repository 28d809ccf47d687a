"""Row formats: encode feature rows into a storage dtype and decode them back.

Storage layouts are GGML's (``f32``, ``f16``, ``bf16``, ``q8_0``, ``q4_0``) and
the conversions are bit-exact with ggml's reference quantizers (and so with
``gguf.quantize`` / ``gguf.dequantize``) on every SIMD path. The work happens
in the C++ core (``dspark_core._ext._row_format``) with the GIL released.

Example::

    >>> import numpy as np
    >>> from dspark_core import formats
    >>> x = np.random.default_rng(0).standard_normal((4, 64), dtype=np.float32)
    >>> q = formats.quantize_rows(x, "q8_0")          # uint8 (4, 68)
    >>> y = formats.dequantize_rows(q, "q8_0", 64)    # float32 (4, 64)
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, NamedTuple

import numpy as np

from .rows import _bf16
from .stager import core_tables
from . import kernels
from .stager._args import as_index
from ._ext import _row_format

__all__ = [
    "EncodeBounds",
    "encode_bounds",
    "STORAGES",
    "NONFINITE_POLICIES",
    "quantize_rows",
    "dequantize_rows",
    "find_nonfinite",
    "row_bytes",
    "storage_dtype",
    "simd_paths",
    "best_simd_path",
    "active_simd_path",
    "set_simd_path",
    "simd_path",
]

#: Storage formats, in the C++ enum's order.
STORAGES = core_tables.STORAGES

#: What :func:`quantize_rows` does with NaN / +-Inf inputs: the core's
#: policies plus ``"keep"`` (convert as-is; the first non-finite is not an error).
NONFINITE_POLICIES = (*core_tables.NONFINITE_POLICIES, "keep")

_FAMILY = "row_format"

#: Input / output element dtypes besides bfloat16 (ml_dtypes', loaded when first used: dspark_core.rows._bf16).
_FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))


#: Largest feature_dim a size_t holds (the core's type); row_bytes refuses more.
_SIZE_T_LIMIT = 1 << 64


def _as_name(what: str, value: object) -> str:
    """A string argument (a storage, policy or path name), or a TypeError naming it."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, got {type(value).__name__}")
    return value


def _as_dim(value: object) -> int:
    """``feature_dim`` as an integer in [0, 2**64), or a TypeError / ValueError naming it."""
    dim = as_index("feature_dim", value)
    if not 0 <= dim < _SIZE_T_LIMIT:
        raise ValueError(f"feature_dim must be in [0, 2**64), got {dim}")
    return dim


def _check_float_dtype(dtype: object, what: str) -> np.dtype:
    if dtype is None:
        raise TypeError(f"{what} must be a float dtype, got None")
    dt = _bf16.as_dtype(dtype)
    if dt not in _FLOAT_DTYPES and not _bf16.is_bf16(dt):
        raise TypeError(
            f"{what}: dtype {dt} is not supported; expected float32, float16 or bfloat16 (ml_dtypes)"
        )
    return dt


def row_bytes(storage: str, feature_dim: int) -> int:
    """Bytes of one row of ``feature_dim`` elements stored as ``storage``.

    Raises :class:`dspark_core.errors.ConfigError` (a ``ValueError``) for an
    unknown storage, a q format with ``feature_dim % 32 != 0``, or a byte
    count that overflows; ``ValueError`` for a negative ``feature_dim``.
    """
    return int(_row_format.row_bytes(_as_name("storage", storage), _as_dim(feature_dim)))


def storage_dtype(storage: str) -> np.dtype:
    """numpy dtype :func:`quantize_rows` returns for ``storage``.

    float32 / float16 / bfloat16 for the float formats, uint8 for q formats.
    """
    return np.dtype(_row_format.storage_out_dtype(_as_name("storage", storage)))


def _as_rows(x: object, what: str) -> np.ndarray:
    """Coerce input to a C-contiguous 2-D array of a supported float dtype."""
    if not isinstance(x, np.ndarray):
        x = np.asarray(x)
        if x.dtype == np.float64:
            raise TypeError(
                f"{what}: got float64 data; pass float32, float16 or bfloat16 (convert explicitly)"
            )
    if not x.dtype.isnative:  # e.g. '>f4': the kernels read native-endian values
        x = x.astype(x.dtype.newbyteorder("="))
    _check_float_dtype(x.dtype, what)
    if x.ndim == 1:
        x = x.reshape(1, -1)
    elif x.ndim != 2:
        raise ValueError(f"{what}: expected a 1-D row or a 2-D (n_rows, feature_dim) array, got shape {x.shape}")
    return np.ascontiguousarray(x)


def quantize_rows(
    x: np.ndarray, storage: str, *, nonfinite: str = "error", out: np.ndarray | None = None
) -> np.ndarray:
    """Encode rows ``x`` (float32 / float16 / bfloat16, shape (n, D) or (D,)) as ``storage``.

    Returns a new array: uint8 (n, row_bytes) for ``q8_0`` / ``q4_0``;
    float16 / bfloat16 (ml_dtypes) (n, D) for ``f16`` / ``bf16``; a float32
    copy for ``f32``. A 1-D input is one row (the result is still 2-D).

    ``nonfinite`` decides what values the storage cannot carry do: NaN, +-Inf,
    and finite values whose encoding overflows (``|x| >= limit`` of
    :func:`encode_bounds`: 65520 for f16, 127 * 65520 for q8_0, 8 * 65520 for
    q4_0, where the block's fp16 scale would overflow):

    * ``"error"`` (default): raise ``ValueError`` naming the row, column and
      value of the first such value;
    * ``"zero"``: replace them with 0;
    * ``"clamp"``: NaN -> 0, then clamp every value to the largest magnitude
      the storage encodes as a finite value (``encode_bounds(storage).clamp_to``);
    * ``"clamp_f16"``: the same, bounded by [-65504, 65504] as well;
    * ``"keep"``: convert as-is (NaN stays a quiet NaN, as gguf-py does; a q
      block holding a NaN gets ``d = NaN`` and zero quants).

    ``out``, when given, must be a writeable C-contiguous array of exactly the
    result's dtype and shape, not overlapping ``x``; it is filled and returned
    (no allocation). A rejected call leaves it untouched: under ``"error"``
    q8_0 / q4_0 save ``out`` and put it back on a rejection, the float
    storages check ``x`` before writing (one extra read of it); without
    ``out`` the check stays fused into the single conversion pass.

    Raises ``TypeError`` for another input dtype and
    :class:`dspark_core.errors.ConfigError` for an unknown storage or a q
    format with ``D % 32 != 0``.
    """
    _as_name("storage", storage)
    if _as_name("nonfinite", nonfinite) not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
    rows = _as_rows(x, "quantize_rows")
    out, bad = _row_format.encode(rows, storage, nonfinite, out)
    if nonfinite == "error" and bad >= 0:
        dim = rows.shape[1]
        r, c = divmod(int(bad), dim)
        v = rows.reshape(-1)[bad]
        raise ValueError(unencodable_message(float(v), r, c, storage))
    return out


class EncodeBounds(NamedTuple):
    """Which values a conversion carries as finite values (see :func:`encode_bounds`)."""

    #: ``|x| < limit`` encodes (and stages) to a finite value.
    limit: float
    #: The largest magnitude that does: what ``nonfinite="clamp"`` clamps to.
    clamp_to: float


def encode_bounds(storage: str, stage_dtype: object = np.float32) -> EncodeBounds:
    """The bounds of ``storage`` rows decoded to ``stage_dtype`` (default float32: the storage alone).

    f32: ``(inf, FLT_MAX)``; f16: ``65520`` (which rounds to +inf); bf16:
    ``0x1.ffp+127``; q8_0 ``127 * 65520`` and q4_0 ``8 * 65520`` (the block's
    fp16 scale ``amax / 127`` or ``max / -8`` overflows). A Stager whose
    ``stage_dtype`` is float16 carries only what stays finite after that last
    narrowing as well (e.g. f32 storage staged as float16: 65520).
    """
    _check_float_dtype(stage_dtype, "encode_bounds stage_dtype")
    limit, clamp_to = _row_format.bounds(storage, np.dtype(stage_dtype))  # type: ignore[call-overload]
    return EncodeBounds(limit, clamp_to)


def unencodable_message(value: float, row: int, column: int, storage: str) -> str:
    """The ``nonfinite="error"`` message of :func:`quantize_rows` (and the reference's)."""
    what = (
        f"{value:.9g}, which overflows {storage} (|x| must stay below {encode_bounds(storage).limit:.9g})"
        if math.isfinite(value)
        else f"{value!r}, a non-finite value"
    )
    return (
        f"row {row}, column {column} holds {what} (nonfinite='error'; use storage='bf16' for rows with "
        "massive activations, or nonfinite='clamp', 'zero' or 'keep')"
    )


def dequantize_rows(
    data: np.ndarray,
    storage: str,
    feature_dim: int,
    out_dtype: object = np.float32,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Decode rows stored as ``storage`` back to floats, shape (n, feature_dim).

    ``data`` holds whole rows: the uint8 (n, row_bytes) array
    :func:`quantize_rows` returned, any C-contiguous array with the same
    bytes, or the storage's float dtype (n, feature_dim). Decoding is exact in
    float32; to float16 / bfloat16 it is one round-to-nearest-even step of the
    float32 value. Writes into ``out`` (C-contiguous, right shape and dtype,
    not overlapping ``data``) when given and returns it.
    """
    _as_name("storage", storage)
    dim = _as_dim(feature_dim)
    dt = _check_float_dtype(out_dtype, "dequantize_rows out_dtype")
    if not isinstance(data, np.ndarray):
        raise TypeError(f"dequantize_rows: data must be a numpy array, got {type(data).__name__}")
    data = np.ascontiguousarray(data)
    return _row_format.decode(data, storage, dim, dt, out)


def find_nonfinite(x: np.ndarray) -> int:
    """Flat index of the first NaN / +-Inf in ``x`` (float32/float16/bfloat16), or -1."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"find_nonfinite: x must be a numpy array, got {type(x).__name__}")
    _check_float_dtype(x.dtype, "find_nonfinite")
    return int(_row_format.find_nonfinite(np.ascontiguousarray(x)))


# The row-format family of the dispatch registry (dspark_core.kernels) under
# its first names.


def simd_paths() -> list[str]:
    """Row-format kernel paths this CPU and build support (``"scalar"`` first)."""
    return kernels.supported(_FAMILY)


def best_simd_path() -> str:
    """The fastest supported path (the default unless ``DSPARK_SIMD`` says otherwise)."""
    return kernels.best(_FAMILY)


def active_simd_path() -> str:
    """The path conversions use now."""
    return kernels.active(_FAMILY)


def set_simd_path(name: str) -> None:
    """Select the row-format path process-wide (every path gives identical bytes).

    ``ValueError`` for an unknown or unsupported path.
    """
    kernels.set_path(_FAMILY, _as_name("name", name))


@contextlib.contextmanager
def simd_path(name: str) -> Iterator[str]:
    """Context manager running its body on row-format path ``name`` (for tests).

    Process-wide, so not for use from several threads at once.
    """
    with kernels.use(_FAMILY, _as_name("name", name)):
        yield name
