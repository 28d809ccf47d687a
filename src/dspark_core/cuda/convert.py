"""Row conversion on the device: quantize_rows, dequantize_rows, upload_plan."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..stager import core_tables
from .. import formats
from ._backend import _BF16, _ELEM, _NAMES, _POLICY, _STORAGE, _U8, _U16, _require
from .interop import (
    _alloc, _array_stream, _current_device, _dev_array, _lib_of, _mark_written,
    _prepare_out, _stream_handle, _usable_backend,
)

def storage_dtype_name(storage: str) -> str:
    """dtype name of :func:`quantize_rows`' result for ``storage`` ("uint8" for q formats)."""
    return _NAMES[formats.storage_dtype(storage)]


# ------------------------------------------------------------ conversions ---


def quantize_rows(
    x: Any,
    storage: str,
    *,
    nonfinite: str = "error",
    out: Any = None,
    stream: Any = None,
    in_dtype: Any = None,
) -> Any:
    """Encode device rows ``x`` ((n, D) or (D,); float32 / float16 / bfloat16) as ``storage``.

    Same bytes as :func:`dspark_core.formats.quantize_rows`. Returns a new
    device array from the input's library (or ``out``): uint8 (n, row_bytes)
    for q formats, the storage's float dtype (n, D) otherwise (bfloat16 from
    cupy comes back as uint16 bits). ``in_dtype="bfloat16"`` reads a uint16
    array as bfloat16 bits.

    ``nonfinite``: ``"error"`` (waits for the kernel, then raises ValueError
    naming the row and column of the first NaN / Inf), ``"keep"`` (convert
    as-is, asynchronous), ``"zero"``, ``"clamp"``, ``"clamp_f16"`` (as
    :func:`dspark_core.formats.quantize_rows`; overflow counts as non-finite).
    """
    if nonfinite not in _POLICY:
        raise ValueError(f"nonfinite must be one of {tuple(_POLICY)}, got {nonfinite!r}")
    if storage not in _STORAGE:
        formats.row_bytes(storage, 32)  # raises ConfigError naming the allowed ones
    lib = _lib_of(x)
    s = _array_stream(stream, x, lib)
    a = _dev_array(x, "quantize_rows: x", stream=s)
    dt = a.dtype
    if in_dtype is not None:
        want = np.dtype(in_dtype)
        if want == _BF16 and dt == _U16:
            dt = _BF16
        elif want != dt:
            raise TypeError(f"quantize_rows: in_dtype {want} does not match the array's dtype {dt}")
    if dt not in _ELEM:
        raise TypeError(f"quantize_rows: dtype {dt} is not supported; expected float32, float16 or bfloat16")
    if len(a.shape) == 1:
        n, dim = 1, a.shape[0]
    elif len(a.shape) == 2:
        n, dim = a.shape
    else:
        raise ValueError(f"quantize_rows: expected a 1-D row or a 2-D (n_rows, feature_dim) array, got shape {a.shape}")
    rb = formats.row_bytes(storage, dim)
    sdt = formats.storage_dtype(storage)
    oshape = (n, rb) if core_tables.STORAGE_FORMATS[storage].quantized else (n, dim)
    cu = _require()
    out, o = _prepare_out(a, out, lib, oshape, sdt, s, "quantize_rows")
    bad = cu.encode(a.ptr, _ELEM[dt], o.ptr, _STORAGE[storage], n, dim, _POLICY[nonfinite],
                    nonfinite == "error", s)
    _mark_written(out, s, stream)
    if nonfinite == "error" and bad >= 0:
        r, c = divmod(int(bad), dim)
        raw = cu.copy_to_host(a.ptr + int(bad) * dt.itemsize, dt.itemsize)
        v = float(np.frombuffer(raw, dtype=dt)[0].astype(np.float32))
        raise ValueError(formats.unencodable_message(v, r, c, storage))
    return out


def dequantize_rows(
    data: Any,
    storage: str,
    feature_dim: int,
    out_dtype: Any = "float32",
    out: Any = None,
    stream: Any = None,
) -> Any:
    """Decode device rows stored as ``storage`` to (n, feature_dim) ``out_dtype`` on the device.

    ``data`` is any C-contiguous device array holding whole rows (uint8
    (n, row_bytes), or the storage's float dtype); n = nbytes // row_bytes.
    Exact in float32; float16 / bfloat16 are one round-to-nearest-even step
    of that (same bytes as :func:`dspark_core.formats.dequantize_rows`).
    Asynchronous on the stream; written into ``out`` when given.
    """
    odt = np.dtype(out_dtype) if not (isinstance(out_dtype, str) and out_dtype == "bfloat16") else _BF16
    if odt not in _ELEM:
        raise TypeError(f"dequantize_rows: out_dtype {odt} is not supported; expected float32, float16 or bfloat16")
    dim = int(feature_dim)
    rb = formats.row_bytes(storage, dim)
    lib = _lib_of(data)
    s = _array_stream(stream, data, lib)
    a = _dev_array(data, "dequantize_rows: data", stream=s)
    nbytes = a.nbytes
    if rb == 0 or nbytes % rb:
        raise ValueError(
            f"dequantize_rows: {nbytes} bytes is not a whole number of {storage} rows of dim {dim} ({rb} bytes each)"
        )
    n = nbytes // rb
    cu = _require()
    out, o = _prepare_out(a, out, lib, (n, dim), odt, s, "dequantize_rows")
    cu.decode(a.ptr, _STORAGE[storage], o.ptr, _ELEM[odt], n, dim, s)
    _mark_written(out, s, stream)
    return out


def upload_plan(
    plan: Any,
    config: Any,
    out_dtype: Any = None,
    *,
    device: int | None = None,
    stream: Any = None,
    backend: str | None = None,
    out: Any = None,
) -> Any:
    """Upload ``plan.encoded_rows`` (storage format) and dequantize it on the device.

    ``config`` is the :class:`~dspark_core.StagerConfig` (or the
    :class:`~dspark_core.Stager`) the plan came from: it gives the storage
    format, ``feature_dim`` and, by default, ``out_dtype`` (its
    ``stage_dtype``, the drafter's dtype). Returns an (n_rows, feature_dim)
    device array (``backend="cupy"|"torch"|"dspark"``; default cupy if
    importable, else torch, else a :class:`DeviceArray`) equal to ``plan.rows``, having moved only the
    encoded bytes over PCIe. A skipped or empty plan gives an (0, D) array.
    """
    cfg = getattr(config, "config", config)
    storage, dim = cfg.storage, int(cfg.feature_dim)
    odt = np.dtype(out_dtype if out_dtype is not None else _stage_dtype(cfg.stage_dtype))
    if odt not in _ELEM:
        raise TypeError(f"upload_plan: out_dtype {odt} is not supported; expected float32, float16 or bfloat16")
    enc = np.ascontiguousarray(plan.encoded_rows)
    if enc.dtype != _U8:
        enc = enc.view(_U8)
    rb = formats.row_bytes(storage, dim)
    if enc.size % rb:
        raise ValueError(f"upload_plan: plan.encoded_rows holds {enc.size} bytes, not whole {storage} rows of dim {dim}")
    n = enc.size // rb
    cu = _require()
    lib = backend or next((x for x in ("cupy", "torch") if _usable_backend(x)), "dspark")
    if lib not in ("cupy", "torch", "dspark"):
        raise ValueError(f"upload_plan: backend must be 'cupy', 'torch' or 'dspark', got {backend!r}")
    if device is None:
        device = _current_device(lib)
    s = _stream_handle(stream, lib, device)
    if out is None:
        out = _alloc(lib, (n, dim), odt, int(device), s)
    if n == 0:
        return out
    staging = _alloc(lib, (n, rb), _U8, int(device), s)
    st = _dev_array(staging, "upload_plan: staging buffer", stream=s)
    cu.copy_to_device(st.ptr, enc.reshape(-1), s)
    result = dequantize_rows(staging, storage, dim, odt, out=out, stream=s)
    _mark_written(result, s, stream)  # keep the caller's stream object, not just its handle
    return result


def _stage_dtype(name: str) -> np.dtype:
    return _BF16 if name == "bfloat16" else np.dtype(name)
