"""The CUDA extension handle, the core's enum codes for it, and availability.

``_cuda`` is the extension module, or None in a build without CUDA kernels;
the other modules of :mod:`dspark_core.cuda` read it through this module
(``_backend._cuda``), so there is one handle to replace (tests do).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import ml_dtypes
import numpy as np

from ..stager import core_tables
from .. import formats



def _load() -> tuple[ModuleType | None, str]:
    """The extension and "", or None and why it is missing (it exists only in builds with DSPARK_CUDA)."""
    try:
        from .._ext import _cuda
    except ImportError as exc:  # pragma: no cover - depends on the build
        return None, str(exc)
    return _cuda, ""


_cuda, _IMPORT_ERROR = _load()

_F32 = np.dtype(np.float32)
_F16 = np.dtype(np.float16)
_BF16 = np.dtype(ml_dtypes.bfloat16)
_U8 = np.dtype(np.uint8)
_U16 = np.dtype(np.uint16)

_ELEM = {_F32: 0, _F16: 1, _BF16: 2}
_STORAGE = {name: i for i, name in enumerate(formats.STORAGES)}
_POLICY = {"keep": 0, **{name: i for i, name in enumerate(core_tables.NONFINITE_POLICIES)}}
_NAMES = {_F32: "float32", _F16: "float16", _BF16: "bfloat16", _U8: "uint8"}

# DLPack device types.
_KDL_CPU, _KDL_CUDA, _KDL_CUDA_HOST, _KDL_CUDA_MANAGED = 1, 2, 3, 13
_KDL_NAMES = {1: "CPU", 2: "CUDA", 3: "CUDA pinned host", 4: "OpenCL", 7: "Vulkan", 8: "Metal",
              10: "ROCm", 11: "ROCm pinned host", 13: "CUDA managed", 14: "oneAPI"}


# ------------------------------------------------------------ availability ---


def device_count() -> int:
    """Number of CUDA devices usable here (0 without the extension, a GPU or a driver)."""
    return 0 if _cuda is None else int(_cuda.device_count())


def available() -> bool:
    """True when the CUDA kernels were built and at least one GPU is usable."""
    return device_count() > 0


def _emulated() -> bool:
    """True in a ``DSPARK_CUDA=EMULATE`` build (test infrastructure, never a release).

    Such a build compiles the CUDA host code and kernels for the CPU against
    the emulated runtime of ``csrc/tests/cuda_emulation``: "device memory" is
    host memory and the kernels run under a lock-step warp model. CI's
    rehearsal of ``bench/gpu_check.sh`` and ``tests/test_cuda.py`` ask this.
    """
    return _cuda is not None and bool(_cuda.emulated())


def emulated() -> bool:
    """Deprecated (test infrastructure): whether this is an emulated-device test build."""
    import warnings

    warnings.warn("dspark_core.cuda.emulated() is test infrastructure and will be removed",
                  DeprecationWarning, stacklevel=2)
    return _emulated()


def unavailable_reason() -> str:
    """Why :func:`available` is False ("" when it is True)."""
    if _cuda is None:
        return (
            "dspark_core was built without its CUDA kernels (DSPARK_CUDA=OFF, or AUTO without nvcc or "
            "without a GPU at build time; rebuild with DSPARK_CUDA=ON or CUDAARCHS=<arch>): "
            f"{_IMPORT_ERROR}"
        )
    if _cuda.device_count() > 0:
        return ""
    return str(_cuda.unavailable_reason())


def _require() -> Any:
    if not available():
        raise RuntimeError(f"no CUDA device available: {unavailable_reason()}")
    return _cuda
