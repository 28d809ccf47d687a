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

# Index-driven batches (row_batch_cuda.hpp).
STATUS_WORDS: int

def batch_status_reset(status: int, stream: int) -> None:
    """batch_status_reset_cuda: both status words to "nothing reported" (a memset on ``stream``)."""

def check_rows(
    src: int,
    in_code: int,
    n_rows: int,
    dim: int,
    slots: int,
    table_rows: int,
    storage_code: int,
    staged_code: int,
    status: int,
    stream: int,
) -> None:
    """check_rows_cuda (``slots`` 0: check every row). One launch, read-only."""

def scatter_rows(
    src: int,
    in_code: int,
    n_rows: int,
    dim: int,
    slots: int,
    table: int,
    storage_code: int,
    table_rows: int,
    policy_code: int,
    staged_code: int,
    status: int,
    gated: bool,
    stream: int,
) -> None:
    """scatter_rows_cuda (``status`` 0: none). One launch."""

def gather_rows(
    table: int,
    storage_code: int,
    table_rows: int,
    dim: int,
    slots: int,
    n_rows: int,
    dst: int,
    out_code: int,
    status: int,
    stream: int,
) -> None:
    """gather_rows_cuda (``status`` 0: none). One launch."""

# Streams and graphs (cuda_graph.hpp): tests and benchmarks.
def emulated_launches() -> int:
    """Kernel launches the emulated device ran so far (-1 on a real device)."""

@disjoint_base
class Stream:
    """A non-blocking CUDA stream of ``device`` (tests, benchmarks), destroyed with the object."""

    @property
    def device(self) -> int: ...
    @property
    def handle(self) -> int: ...
    def __new__(cls, device: int = 0) -> Self: ...

@disjoint_base
class Graph:
    """A CUDA graph captured from a stream (:func:`capture_begin` / :func:`capture_end`), instantiated."""

    @property
    def device(self) -> int: ...
    def launch(self, stream: int) -> None:
        """Replay the graph on ``stream`` (asynchronous)."""

def capture_begin(stream: int, device: int = 0) -> None:
    """Start capturing ``stream`` (not the legacy default stream) into a graph."""

def capture_end(stream: int, device: int = 0) -> Graph:
    """End the capture of ``stream``: the instantiated :class:`Graph` (RuntimeError when a call in the
    capture could not be captured: a synchronization, an allocation, a host copy)."""

# The device step (step_cuda.hpp).
STEP_CONFIG_KEYS: tuple[str, ...]
STEP_OUTPUT_KEYS: tuple[str, ...]

def device_step(
    config: tuple[int, ...],
    state: int,
    seqs: int,
    counts: int,
    count_bytes: int,
    n: int,
    outputs: tuple[int, ...],
    stream: int,
) -> None:
    """device_step_cuda (csrc/cuda/step_cuda.hpp): one launch. ``config``: the values of
    STEP_CONFIG_KEYS; ``outputs``: device pointers in STEP_OUTPUT_KEYS order (0: not written)."""

def device_step_rows(
    config: tuple[int, ...],
    state: int,
    seqs: int,
    n: int,
    outputs: tuple[int, ...],
    capacity: int,
    row_offsets: int,
    row_slots: int,
    row_positions: int,
    stream: int,
) -> None:
    """device_step_rows_cuda (csrc/cuda/step_cuda.hpp): the CSR rows of the batch the last
    step stepped, two launches. ``outputs``: that step's device pointers in STEP_OUTPUT_KEYS
    order; ``row_offsets`` (capacity + 1 int64), ``row_slots`` / ``row_positions``
    (capacity * max_rows int64 / int32; 0: not written)."""

def step_columns_to_device(config: tuple[int, ...], state: int, host: Any, seqs: Any,
                           stream: int) -> None:
    """step_columns_to_device_cuda: the columns of ``seqs`` of the host step state (int64
    ``(columns, max_seqs)``, Stager.step_state) into the device state, on ``stream``."""

def step_columns_to_host(config: tuple[int, ...], state: int, host: Any, seqs: Any,
                         stream: int) -> None:
    """step_columns_to_host_cuda: the columns of ``seqs`` of the device state into the host
    step state, ordered on ``stream`` (returns once they are there)."""
