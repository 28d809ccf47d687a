"""Typed stubs of the private Cython module ``dspark_core._ext._cuda`` (DSPARK_CUDA builds only).

Use :mod:`dspark_core.cuda`; these wrappers take raw device pointers (ints),
sizes, the core's enum codes and stream handles (0 = the legacy default
stream), and check nothing the public module checks.
"""

from typing import Any

from typing_extensions import CapsuleType, Self, disjoint_base

def device_count() -> int:
    """Number of CUDA devices (0 without a GPU or driver; never raises)."""

def emulated() -> bool:
    """True in a DSPARK_CUDA=EMULATE (test) build: devices are host memory."""

def unavailable_reason() -> str:
    """Why device_count() is 0 ("" when it is not)."""

def runtime_version() -> int: ...
def driver_version() -> int: ...
def pointer_device(ptr: int) -> int:
    """Device ordinal owning ``ptr``, or -1 for host / unknown memory."""

def device_name(dev: int) -> str: ...
def encode(
    src: int,
    in_code: int,
    dst: int,
    storage_code: int,
    n_rows: int,
    dim: int,
    policy_code: int,
    report: bool,
    stream: int,
    staged_code: int = 0,
) -> int:
    """encode_rows_cuda; returns the first flat index that cannot be staged as
    ``staged_code`` (non-finite, or beyond encode_bounds(storage, staged)), or -1."""

def decode(src: int, storage_code: int, dst: int, out_code: int, n_rows: int, dim: int, stream: int) -> None:
    """decode_rows_cuda (asynchronous on ``stream``)."""

def synchronize(stream: int, device: int = -1) -> None: ...
def copy_to_host(src: int, nbytes: int) -> bytes: ...
def copy_to_device(dst: int, host: Any, stream: int) -> None:
    """Copy a contiguous 1-D uint8 host buffer to device memory at ``dst`` on ``stream``."""

def stream_wait(waiter: int, producer: int, device: int = -1) -> None: ...
def dlpack_info(
    capsule: CapsuleType,
) -> tuple[int, int, int, tuple[int, ...], tuple[int, ...] | None, tuple[int, int, int]]:
    """``(ptr, device_type, device_id, shape, strides, (code, bits, lanes))`` of an unconsumed DLPack capsule."""

def copy_device(dst: int, src: int, nbytes: int, stream: int) -> None: ...
@disjoint_base
class Allocation:
    """``nbytes`` of device memory on ``device`` (cudaMalloc), freed with the object."""

    @property
    def nbytes(self) -> int: ...
    @property
    def device(self) -> int: ...
    @property
    def ptr(self) -> int: ...
    def __new__(cls, nbytes: int, device: int = 0) -> Self: ...
