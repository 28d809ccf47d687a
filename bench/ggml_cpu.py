"""ggml-cpu's own row converters, through ctypes: a peer for bench_convert.py.

docs/design.md section 6 asks that dspark's conversions be no slower than
ggml-cpu's SIMD row converters (and, unlike ggml's q8_0 SIMD path, bit-exact
with ggml's reference). The ``libggml-cpu`` / ``libggml-base`` shared
libraries that ``pip install llama-cpp-python`` builds export them:

* ``ggml_cpu_fp32_to_fp16``, ``ggml_cpu_fp32_to_bf16`` (ggml-cpu.h);
* ``quantize_row_q8_0``, ``quantize_row_q4_0`` (ggml-cpu, SIMD);
* ``quantize_row_q8_0_ref``, ``quantize_row_q4_0_ref`` (ggml-base: the
  reference, whose bytes dspark reproduces);
* to float32: ``ggml_cpu_fp16_to_fp32``, ``ggml_cpu_bf16_to_fp32`` (ggml-cpu)
  and ``dequantize_row_q8_0`` / ``_q4_0`` (ggml-base: what ggml's type
  traits use to dequantize on the CPU).

Optional: :func:`load` returns None (and why) when no library is found. It
looks in ``$DSPARK_GGML_LIB_DIR``, then in an importable ``llama_cpp``
package's ``lib/`` folder. Nothing is downloaded or built here.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from pathlib import Path

import numpy as np

# storage -> (SIMD symbol, reference symbol or None)
_ENCODERS = {
    "f16": ("ggml_cpu_fp32_to_fp16", None),
    "bf16": ("ggml_cpu_fp32_to_bf16", None),
    "q8_0": ("quantize_row_q8_0", "quantize_row_q8_0_ref"),
    "q4_0": ("quantize_row_q4_0", "quantize_row_q4_0_ref"),
}


# storage -> decoder to float32
_DECODERS = {
    "f16": "ggml_cpu_fp16_to_fp32",
    "bf16": "ggml_cpu_bf16_to_fp32",
    "q8_0": "dequantize_row_q8_0",
    "q4_0": "dequantize_row_q4_0",
}


class GgmlCpu:
    """The converters of one ggml build (``lib_dir`` holds libggml-base / -cpu)."""

    def __init__(self, lib_dir: Path) -> None:
        self.lib_dir = lib_dir
        mode = getattr(os, "RTLD_GLOBAL", 0)
        self._base = ctypes.CDLL(str(_one(lib_dir, "libggml-base")), mode=mode)
        self._cpu = ctypes.CDLL(str(_one(lib_dir, "libggml-cpu")), mode=mode)
        if hasattr(self._cpu, "ggml_cpu_init"):  # fills ggml's fp16 tables
            self._cpu.ggml_cpu_init.restype = None
            self._cpu.ggml_cpu_init()
        self._fns: dict[tuple[str, bool], ctypes._CFuncPtr] = {}
        for storage, (simd, ref) in _ENCODERS.items():
            for name, lib, is_ref in ((simd, self._cpu, False), (ref, self._base, True)):
                if name is None or not hasattr(lib, name):
                    continue
                fn = getattr(lib, name)
                fn.restype = None
                fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
                self._fns[(storage, is_ref)] = fn
        self._dec: dict[str, ctypes._CFuncPtr] = {}
        for storage, name in _DECODERS.items():
            lib = next((x for x in (self._cpu, self._base) if hasattr(x, name)), None)
            if lib is not None:
                fn = getattr(lib, name)
                fn.restype = None
                fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
                self._dec[storage] = fn

    def has(self, storage: str, ref: bool = False) -> bool:
        return (storage, ref) in self._fns

    def has_decode(self, storage: str) -> bool:
        return storage in self._dec

    def decode(self, storage: str, data: np.ndarray, out: np.ndarray) -> None:
        """Decode ``data`` (storage bytes, C-contiguous) into float32 ``out`` in one call."""
        assert out.dtype == np.float32 and data.flags.c_contiguous and out.flags.c_contiguous
        self._dec[storage](data.ctypes.data, out.ctypes.data, out.size)

    def encode(self, storage: str, x: np.ndarray, out: np.ndarray, ref: bool = False) -> None:
        """Convert all of ``x`` (C-contiguous float32) into ``out`` in one call."""
        assert x.dtype == np.float32 and x.flags.c_contiguous and out.flags.c_contiguous
        self._fns[(storage, ref)](x.ctypes.data, out.ctypes.data, x.size)


def _one(lib_dir: Path, stem: str) -> Path:
    found = sorted(lib_dir.glob(f"{stem}.so*")) + sorted(lib_dir.glob(f"{stem}.dylib"))
    if not found:
        raise FileNotFoundError(f"{stem}.so not in {lib_dir}")
    return found[0]


def _candidate_dirs() -> list[Path]:
    dirs = []
    env = os.environ.get("DSPARK_GGML_LIB_DIR")
    if env:
        dirs.append(Path(env))
    spec = importlib.util.find_spec("llama_cpp")
    if spec is not None and spec.submodule_search_locations:
        dirs.append(Path(list(spec.submodule_search_locations)[0]) / "lib")
    return dirs


def load() -> tuple[GgmlCpu | None, str]:
    """(the converters, where they came from) or (None, why not)."""
    tried = []
    for d in _candidate_dirs():
        try:
            return GgmlCpu(d), str(d)
        except OSError as exc:  # FileNotFoundError included
            tried.append(f"{d}: {exc}")
    if not tried:
        return None, "no libggml-cpu (set DSPARK_GGML_LIB_DIR, or pip install llama-cpp-python)"
    return None, "; ".join(tried)
