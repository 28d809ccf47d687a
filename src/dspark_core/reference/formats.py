"""Pure numpy / gguf-py twin of :mod:`dspark_core.formats` (test oracle).

Deliberately simple: the non-finite policy is applied with numpy, then the
encoding is ``numpy.astype(float16)`` for f16 (with the hardware's NaN rule,
see ``_f16``) and ``gguf.quantize`` for bf16,
q8_0 and q4_0 (gguf-py matches ggml's reference C quantizers byte for byte);
decoding is ``gguf.dequantize``. Same return layouts as ``formats``.

One deliberate deviation from gguf-py, following ggml's C code: a q4_0 block
whose elements are all zero stores ``d = -0.0`` (fp16 0x8000). ggml keeps the
running max at +0 and computes ``+0 / -8``; gguf-py takes the block's first
element, which gives +0 (0x0000) when that element is ``-0.0``.

Two more, where numpy (like ggml's C code) gives the CPU's answer and the
core gives x86's on every CPU (``x86_rules``): a q block so small that its
inverse scale ``1 / d`` overflows has every quant 0 (x86 turns the infinite
products into INT32_MIN, whose low byte is 0; Arm saturates +inf to 0xff),
and decoding a zero quant of a block whose scale is infinite gives x86's
default NaN 0xffc00000 (Arm's is 0x7fc00000). On x86 both are no-ops.
"""

from __future__ import annotations

import functools

import gguf
import ml_dtypes
import numpy as np

__all__ = ["encode", "decode", "apply_nonfinite", "bounds", "row_bytes", "STORAGES"]

#: The storages this oracle implements, written out on purpose: the oracle
#: does not read the core's table (a test checks both list the same formats).
STORAGES = ("f32", "f16", "bf16", "q8_0", "q4_0")
_QT = {
    "bf16": gguf.GGMLQuantizationType.BF16,
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
    "q4_0": gguf.GGMLQuantizationType.Q4_0,
}
#: Bytes of one 32-element block, from gguf-py's own table.
_BLOCK_BYTES = {name: gguf.GGML_QUANT_SIZES[qt][1] for name, qt in _QT.items() if name != "bf16"}
_BF16 = np.dtype(ml_dtypes.bfloat16)


def row_bytes(storage: str, dim: int) -> int:
    """Bytes of one row of ``dim`` elements: numpy's item sizes, gguf-py's block table."""
    if storage in _BLOCK_BYTES:
        return dim // 32 * _BLOCK_BYTES[storage]
    return dim * {"f32": 4, "f16": 2, "bf16": 2}[storage]


def _rows_f32(x: np.ndarray) -> np.ndarray:
    """Widen float32/float16/bfloat16 input to a 2-D float32 array (exact)."""
    x = np.asarray(x)
    if x.dtype not in (np.dtype(np.float32), np.dtype(np.float16), _BF16):
        raise TypeError(f"unsupported dtype {x.dtype} (expected float32, float16 or bfloat16)")
    if x.ndim == 1:
        x = x.reshape(1, -1)
    return np.array(x, dtype=np.float32)  # a copy, so policies can edit it


def bounds(storage: str, staged: str = "float32") -> tuple[float, float]:
    """``(limit, clamp_to)``: ``|x| < limit`` encodes in ``storage`` and decodes
    to ``staged`` as a finite value; ``clamp_to`` is the largest such magnitude.

    Found from the definition by bisection over float32 bit patterns, with
    gguf-py / numpy doing every conversion (a block of 32 copies of ``x``);
    every step of that round trip is monotone in ``|x|``.
    """
    return _bounds(storage, np.dtype(_BF16 if staged == "bfloat16" else staged).name)


@functools.lru_cache(maxsize=None)
def _bounds(storage: str, staged: str) -> tuple[float, float]:
    out = _BF16 if staged == "bfloat16" else np.dtype(staged)

    def finite(bits: int) -> bool:
        x = np.full((1, 32), bits, np.uint32).view(np.float32)
        back = decode(encode(x, storage, "keep"), storage, 32, out)
        return bool(np.isfinite(back.astype(np.float32)).all())

    lo, hi = 0, 0x7F800000  # +0 is finite everywhere, +inf nowhere
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if finite(mid):
            lo = mid
        else:
            hi = mid
    as_f32 = np.array([hi, lo], np.uint32).view(np.float32)
    return float(as_f32[0]), float(as_f32[1])


def apply_nonfinite(x: np.ndarray, nonfinite: str, storage: str = "f32", staged: str = "float32") -> np.ndarray:
    """Apply a policy to float32 ``x`` (2-D) before encoding it as ``storage``.

    A value is unencodable when ``!(|x| < limit)`` (:func:`bounds`): NaN,
    +-Inf, or a finite value whose encoding (or staged form) overflows.
    """
    if nonfinite in ("keep",):
        return x
    limit, clamp_to = bounds(storage, staged)
    with np.errstate(invalid="ignore"):
        ok = np.abs(x) < np.float32(limit)
    if nonfinite == "error":
        bad = np.flatnonzero(~ok)
        if bad.size:
            r, c = divmod(int(bad[0]), x.shape[1])
            raise ValueError(f"unencodable value {float(x[r, c])!r} at row {r}, column {c} ({storage})")
        return x
    if nonfinite == "zero":
        return np.where(ok, x, np.float32(0)).astype(np.float32)
    if nonfinite in ("clamp", "clamp_f16"):
        hi = np.float32(min(65504.0, clamp_to) if nonfinite == "clamp_f16" else clamp_to)
        x = np.where(np.isnan(x), np.float32(0), x)
        return np.clip(x, -hi, hi).astype(np.float32)
    raise ValueError(f"unknown nonfinite policy {nonfinite!r}")


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """ggml's fp32 -> bf16 rounding (gguf-py BF16 quantizer), as uint16."""
    return gguf.quantize(np.ascontiguousarray(x, dtype=np.float32), _QT["bf16"]).view(np.uint16)


def encode(x: np.ndarray, storage: str, nonfinite: str = "error", staged: str = "float32") -> np.ndarray:
    """Encode rows of ``x`` (2-D, or 1-D as one row) as ``storage``.

    Returns float32 / float16 / bfloat16 (n, D) for the float formats and
    uint8 (n, row_bytes) for q8_0 / q4_0.
    """
    if storage not in STORAGES:
        raise ValueError(f"unknown storage {storage!r}")
    x = apply_nonfinite(_rows_f32(x), nonfinite, storage, staged)
    n, dim = x.shape
    if storage == "f32":
        return x
    if storage == "f16":
        return _f16(x)
    if storage == "bf16":
        return _bf16_bits(x).reshape(n, dim).view(_BF16)
    if dim % 32:
        raise ValueError(f"{storage} needs dim % 32 == 0, got {dim}")
    with np.errstate(all="ignore"):
        q = gguf.quantize(x, _QT[storage]).reshape(n, dim // 32 * _BLOCK_BYTES[storage])
    _x86_quants(x, q.reshape(-1, _BLOCK_BYTES[storage]), storage)
    if storage == "q4_0":
        # ggml C quirk: an all-zero block stores d = -0.0 (see module docstring).
        blocks = q.reshape(-1, _BLOCK_BYTES["q4_0"])
        zero = np.all(x.reshape(-1, 32) == 0, axis=1)
        blocks[zero, 0] = 0x00
        blocks[zero, 1] = 0x80
    return q


def _x86_quants(x: np.ndarray, blocks: np.ndarray, storage: str) -> None:
    """Zero the quants of blocks whose fp32 inverse scale overflows (x86_rules), in place."""
    xb = x.reshape(-1, 32)
    if storage == "q8_0":
        d = np.abs(xb).max(axis=1) / np.float32(127)
    else:  # q4_0: the first element of largest magnitude, over -8
        d = xb[np.arange(len(xb)), np.abs(xb).argmax(axis=1)] / np.float32(-8)
    with np.errstate(all="ignore"):
        overflow = (d != 0) & np.isinf(np.float32(1) / d)
    blocks[overflow, 2:] = 0


def _f16(x: np.ndarray) -> np.ndarray:
    """float32 -> float16, round to nearest even, with the IEEE / F16C NaN rule.

    A NaN becomes a quiet NaN keeping the sign and the top 9 payload bits
    (F16C's ``vcvtps2ph``, and dspark's CUDA kernels, which convert in integer
    arithmetic; CUDA's own ``__float2half_rn`` returns 0x7fff for every NaN,
    so they do not use it). numpy differs for signalling
    NaNs: it keeps the signalling bit and, when the top payload bits are all
    zero, sets the lowest one so the result stays a NaN (0x7c01, not 0x7e00).
    """
    with np.errstate(over="ignore", invalid="ignore"):
        h = x.astype(np.float16)
    nan = np.isnan(x)
    if nan.any():
        fb = x.view(np.uint32)[nan]
        h.view(np.uint16)[nan] = (((fb >> 16) & 0x8000) | 0x7E00 | ((fb >> 13) & 0x3FF)).astype(np.uint16)
    return h


def _quiet(x: np.ndarray) -> np.ndarray:
    """Set the quiet bit of every NaN in a float32 array (in place)."""
    x.view(np.uint32)[np.isnan(x)] |= 0x00400000
    return x


def decode(data: np.ndarray, storage: str, dim: int, out_dtype: object = np.float32) -> np.ndarray:
    """Decode rows stored as ``storage`` to ``out_dtype`` (n, dim).

    float32 via ``gguf.dequantize`` (exact); float16 / bfloat16 as one
    round-to-nearest-even step of that float32 value.
    """
    if storage not in STORAGES:
        raise ValueError(f"unknown storage {storage!r}")
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    dt = np.dtype(out_dtype)  # type: ignore[call-overload]
    # NaN rule (the core's, i.e. the hardware's): decoding to the storage's own
    # format copies the bytes unchanged; a format conversion is an IEEE
    # conversion, which quiets signalling NaNs (numpy's casts keep them).
    same = {"f32": np.float32, "f16": np.float16, "bf16": _BF16}.get(storage)
    if same is not None and dt == np.dtype(same):
        return raw.view(dt).reshape(-1, dim).copy()
    if storage == "f32":
        f = raw.view(np.float32).copy()
    elif storage == "f16":
        f = _quiet(raw.view(np.float16).astype(np.float32))
    elif storage == "bf16":
        f = gguf.dequantize(raw, _QT["bf16"])
    else:
        with np.errstate(all="ignore"):  # d = inf times a zero quant -> NaN, as ggml
            f = gguf.dequantize(raw.reshape(-1, _BLOCK_BYTES[storage]), _QT[storage])
        # That NaN is x86's default NaN on every CPU (x86_rules in the docstring).
        f = np.asarray(f, dtype=np.float32).reshape(-1, 32)
        scale = raw.reshape(-1, _BLOCK_BYTES[storage])[:, :2].copy().view(np.float16).reshape(-1)
        invalid = np.isinf(scale)[:, None] & np.isnan(f)
        f.view(np.uint32)[invalid] = np.uint32(0xFFC00000)
    f = np.asarray(f, dtype=np.float32).reshape(-1, dim)
    if dt == np.float32:
        return f
    if dt == np.float16:
        return _f16(f)
    if dt == _BF16:
        return _bf16_bits(f).reshape(f.shape).view(_BF16)
    raise TypeError(f"unsupported out_dtype {dt}")
