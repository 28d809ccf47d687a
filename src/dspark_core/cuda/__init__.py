"""Row conversion on the GPU: quantize / dequantize device arrays, bit-exact with the CPU.

The same formats and bytes as :mod:`dspark_core.formats` (f32 / f16 / bf16 /
q8_0 / q4_0, ggml's reference quantizers), computed by CUDA kernels on
device arrays: one kernel launch per contiguous run of rows. Quantizing where
the target's capture rows are born and dequantizing where the drafter reads
them moves 4-7x fewer bytes over PCIe.

Device arrays are taken through ``__dlpack__`` (torch, cupy, jax, ...) or
``__cuda_array_interface__`` (cupy, numba, ...); neither torch nor cupy is a
dependency. Arrays must be C-contiguous and live on a CUDA device. Results
are allocated by the input's library (cupy / torch), else by cupy or torch
when importable, else as a minimal :class:`DeviceArray` (which also moves
host data: ``DeviceArray.from_numpy`` / ``.get()``).

The kernels are an optional part of the build (``DSPARK_CUDA=OFF|AUTO|ON``; AUTO builds
them for the visible GPU, or the architectures named, and not without a GPU);
this module always imports. :func:`available` is False when the extension
was not built or no GPU / driver is present, and every conversion then
raises ``RuntimeError("no CUDA device available: ...")``.

Streams: ``stream=None`` uses the current stream of the input's library
(cupy / torch), else the legacy default stream; pass an int handle, a
``cupy.cuda.Stream`` or a ``torch.cuda.Stream`` to choose. Conversions are
asynchronous on that stream, except ``quantize_rows(nonfinite="error")``,
which waits for its result to report the first NaN / Inf
(``nonfinite="keep"`` converts as-is without waiting).

Example::

    >>> import cupy as cp
    >>> from dspark_core import cuda
    >>> x = cp.random.standard_normal((16, 4096), dtype=cp.float32)
    >>> q = cuda.quantize_rows(x, "q8_0")             # uint8 (16, 4352) on the device
    >>> y = cuda.dequantize_rows(q, "q8_0", 4096)      # float32 (16, 4096)
"""

from __future__ import annotations

from . import _backend  # noqa: F401 - the extension handle tests replace
from ._backend import _cuda, _emulated, available, device_count, emulated, unavailable_reason  # noqa: F401
from .convert import dequantize_rows, quantize_rows, storage_dtype_name, upload_plan
from .device_ring import DeviceRing
from .device_step import DeviceStep
from .prefix_table import PrefixTable
from .interop import DeviceArray
from .interop import _importable, _usable_backend  # noqa: F401 - tests and bench/gpu_check.sh use them

__all__ = [
    "available",
    "device_count",
    "unavailable_reason",
    "quantize_rows",
    "dequantize_rows",
    "upload_plan",
    "storage_dtype_name",
    "DeviceArray",
    "DeviceRing",
    "DeviceStep",
    "PrefixTable",
]
