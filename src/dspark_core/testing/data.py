"""Deterministic test data (rows that look like real activations) and trace formatting."""

from __future__ import annotations

from typing import Any

import numpy as np

# ---------------------------------------------------------------------------
# Deterministic data
# ---------------------------------------------------------------------------


def _hash_u32(n: int, seed: int) -> np.ndarray:
    idx = np.arange(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        u = (idx + np.uint64(seed) * np.uint64(0x9E3779B1) + np.uint64(1)) * np.uint64(2654435761)
        u ^= u >> np.uint64(15)
        u *= np.uint64(0x2C1B3C6D)
    return (u & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def make_rows(n: int, dim: int, fill: str = "normal", seed: int = 0, special: Any = None) -> np.ndarray:
    """Deterministic float32 rows ``(n, dim)`` of a given character.

    ``fill``: ``normal`` (values in [-2, 2)), ``massive`` (real activations:
    normal noise, channel 3 at 1e3..1e5 as massive-activation channels are,
    row 0 a huge-norm BOS row holding 87,929), ``tiny`` (f16 subnormals),
    ``big`` (beyond f16 range), ``zeros``, ``ties`` (q8_0 rounding ties),
    ``negzero``. ``special = (kind, index)`` puts a NaN / +-Inf at one cell.
    """
    u = _hash_u32(n * dim, seed)
    x = (u.astype(np.float64) / 2**32 - 0.5) * 4.0
    if fill == "tiny":
        x *= 1e-5
    elif fill == "big":
        x *= 4e4
    elif fill == "zeros":
        x[:] = 0.0
    elif fill == "negzero":
        x[:] = -0.0
    elif fill == "ties":
        x = ((u % 255).astype(np.float64) - 127.0) / 2.0
        x[::32] = 127.0  # block max 127 -> d = 1: every k + 0.5 is a tie
    out = x.astype(np.float32).reshape(n, dim)
    if fill == "massive" and n:
        ch = 3 % dim
        out[:, ch] *= np.float32(1e3) * (1 + (u[: n * dim : dim] % 100).astype(np.float32))  # 1e3 .. 1e5
        out[0] *= np.float32(30.0)
        out[0, ch] = np.float32(87_929.0)
    if special is not None and n:
        kind, at = special
        flat = out.reshape(-1)
        flat[at % flat.size] = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}[kind]
    return out


def _as_dtype(x: np.ndarray, kind: str) -> Any:
    if kind == "bfloat16":
        import ml_dtypes

        return x.astype(ml_dtypes.bfloat16)
    with np.errstate(over="ignore", invalid="ignore"):
        if kind == "float16":
            return x.astype(np.float16)
        if kind == "float64":
            return x.astype(np.float64)
        if kind == "int32":
            return np.nan_to_num(x).astype(np.int32)
    if kind == "width":
        return np.ascontiguousarray(x[:, :-1])
    if kind == "1d":
        return x.reshape(-1)
    if kind == "list":
        return x.tolist()
    if kind == "strided":
        return np.repeat(x, 2, axis=0)[::2]
    return x


def _fmt_pos(pos: Any) -> str:
    if isinstance(pos, np.ndarray) and pos.ndim == 1 and pos.size:
        contiguous = pos.size == 1 or bool(np.all(np.diff(pos.astype(np.float64)) == 1))
        if contiguous:
            return f"[{pos[0]}..{pos[-1]}]:{pos.dtype}"
        return f"{pos.tolist()}:{pos.dtype}"
    if isinstance(pos, np.ndarray):
        return f"array{pos.shape}:{pos.dtype}"
    return repr(pos)


def _fmt_arr(x: Any) -> str:
    if isinstance(x, np.ndarray):
        return f"{x.dtype}{tuple(x.shape)}"
    return f"{type(x).__name__}(len {len(x)})" if hasattr(x, "__len__") else repr(x)
