"""The device step on a CUDA device (docs/protocol.md 2.10; csrc/cuda/step_cuda.hpp).

:class:`DeviceStep` owns the device copy of one Stager's step state and fixed
device buffers for a batch of up to ``capacity`` entries: the sequence ids,
the sampler's accept counts (int32, or the sampler's own int32 / int64 buffer:
:meth:`read_counts_from`) and every output of a step. :meth:`launch`
enqueues one step (one kernel launch; nothing synchronises, allocates or
copies), so it can be captured into a CUDA graph with the drafter and the
verify forward; between replays the sampler writes new counts into
:attr:`counts_ptr`. Handing sequences over and back (:meth:`to_device`,
:meth:`to_host`) copies the state between the host and the device: one wait,
outside the graph.

A chain drafter's Stager (``kind="chain"``) hands its rows' ids over by slot:
the server keeps the slot token table on the device beside its rows (int32,
``Stager.new_token_table()``'s size), writes each verify row's id at its verify
slot in the same graph as the verify forward (``table[verify_slots] =
input_ids``), and reads the staged rows' ids at ``row_slots``;
:meth:`to_device` / :meth:`to_host` take it as ``tokens`` and copy only the
handed sequences' slots.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from . import _backend, interop
from ..stager.device_step import _LAYOUT, StepOutputs
from .interop import DeviceArray

#: The step's outputs as laid out on the device: name, dtype, columns (per entry), from the
#: core's output list (the host twin's StepOutputs layout).
_OUTPUTS = tuple((name, dtype, 1 if shape == "n" else shape.split(",", 1)[1]) for name, dtype, shape in _LAYOUT)


class DeviceStep:
    """The device step of ``stager`` (external rows) for batches of up to ``capacity`` entries."""

    def __init__(self, stager: Any, capacity: int, device: int = 0) -> None:
        cu: Any = _backend._cuda
        if cu is None:
            raise RuntimeError("dspark_core was built without its CUDA kernels: DeviceStep needs them")
        self._cu = cu  # the extension (its handle checked once)
        self.stager = stager
        self.capacity = int(capacity)
        self.device = device
        cfg = stager.step_config
        self._config = tuple(int(cfg[k]) for k in cu.STEP_CONFIG_KEYS)
        self.block, self.max_rows, self.max_seqs = int(cfg["block"]), int(cfg["max_rows"]), int(cfg["max_seqs"])
        host = stager.step_state
        self._state = cu.Allocation(host.nbytes, device)
        cu.copy_to_device(self._state.ptr, np.ascontiguousarray(host).view(np.uint8).reshape(-1), 0)
        self._seqs = cu.Allocation(8 * max(1, self.capacity), device)
        self._counts = cu.Allocation(4 * max(1, self.capacity), device)
        # Where the step reads the accept counts: this step's own int32 buffer, or the sampler's.
        self._counts_at, self._counts_dtype = int(self._counts.ptr), np.dtype(np.int32)
        # The outputs as DeviceArrays of fixed shape (capacity rows, -1 until written): a ring's
        # gather_slots / write_slots take .arrays["row_slots"] / ["verify_slots"] in the same graph.
        self.arrays: dict[str, DeviceArray] = {}
        self._out: dict[str, Any] = {}
        for name, dtype, cols in _OUTPUTS:
            shape = (max(1, self.capacity),) if cols == 1 else (max(1, self.capacity), self._cols(cols))
            arr = DeviceArray.from_numpy(np.full(shape, -1, dtype), device=device, stream=0)
            self.arrays[name] = arr
            self._out[name] = (arr, dtype, cols)
        cu.synchronize(0, device)
        self.n = 0

    def _cols(self, cols: Any) -> int:
        return {1: 1, "max_rows": self.max_rows, "block": self.block, "block+1": self.block + 1}[cols]

    @property
    def counts_ptr(self) -> int:
        """The device buffer the next step reads its accept counts from (``counts_dtype``, one
        per batch entry, -1: not in this step): this step's own int32 buffer unless
        :meth:`read_counts_from` named the sampler's."""
        return self._counts_at

    @property
    def counts_dtype(self) -> np.dtype:
        """int32 or int64: the element type of :attr:`counts_ptr`."""
        return self._counts_dtype

    def read_counts_from(self, counts: Any, dtype: Any = None) -> None:
        """Read the accept counts from the sampler's own device buffer from now on: a
        :class:`~dspark_core.cuda.DeviceArray` of int32 / int64, or a device pointer with
        ``dtype``. Nothing is copied: each launch (a graph replay too) reads what the
        sampler last wrote there. Call it before capturing a graph; the buffer must hold
        one count per batch entry and outlive the launches that read it."""
        if isinstance(counts, DeviceArray):
            ptr, dt = int(counts.ptr), np.dtype(counts.dtype if dtype is None else dtype)
            if counts.size < self.capacity:
                raise ValueError(f"DeviceStep.read_counts_from: {counts.size} counts, the capacity is {self.capacity}")
        else:
            if dtype is None:
                raise ValueError("DeviceStep.read_counts_from: a raw pointer needs its dtype (int32 or int64)")
            ptr, dt = int(counts), np.dtype(dtype)
        if dt not in (np.dtype(np.int32), np.dtype(np.int64)):
            raise ValueError(f"DeviceStep.read_counts_from: counts must be int32 or int64, got {dt}")
        if ptr == 0:
            raise ValueError("DeviceStep.read_counts_from: a null pointer")
        self._counts_at, self._counts_dtype = ptr, dt

    def set_batch(self, seqs: Sequence[int], counts: Sequence[int] | None = None) -> None:
        """The batch's sequence ids (and counts), copied to the device (outside a graph)."""
        cu = self._cu
        ids = np.ascontiguousarray(seqs, np.int64)
        if ids.ndim != 1 or len(ids) > self.capacity:
            raise ValueError(f"DeviceStep: at most {self.capacity} sequence ids, got shape {ids.shape}")
        cu.copy_to_device(self._seqs.ptr, ids.view(np.uint8), 0)
        self.n = len(ids)
        if counts is not None:
            self.set_counts(counts)
        cu.synchronize(0, self.device)

    def set_counts(self, counts: Sequence[int]) -> None:
        """Write the accept counts (what a sampler kernel does on the device), outside a graph."""
        cu = self._cu
        c = np.ascontiguousarray(counts, self._counts_dtype)
        if c.shape != (self.n,):
            raise ValueError(f"DeviceStep: {self.n} accept counts expected, got shape {c.shape}")
        cu.copy_to_device(self._counts_at, c.view(np.uint8), 0)
        cu.synchronize(0, self.device)

    def launch(self, stream: int = 0) -> None:
        """Enqueue one step of the current batch on ``stream``: one kernel launch, capturable."""
        outs = tuple(int(self._out[name][0].ptr) for name, _, _ in _OUTPUTS)
        self._cu.device_step(self._config, self._state.ptr, self._seqs.ptr, self._counts_at,
                             self._counts_dtype.itemsize, self.n, outs, stream)

    def outputs(self) -> StepOutputs:
        """The last step's answers, copied to the host (synchronous: tests and logs)."""
        cu = self._cu
        arrays = {}
        for name, (alloc, dtype, cols) in self._out.items():
            k = self._cols(cols)
            raw = cu.copy_to_host(alloc.ptr, np.dtype(dtype).itemsize * k * self.n)
            a = np.frombuffer(raw, dtype).copy()
            arrays[name] = a if cols == 1 else a.reshape(self.n, k)
        return StepOutputs(**arrays)

    def _download(self) -> np.ndarray:
        cu = self._cu
        cu.synchronize(0, self.device)
        raw = cu.copy_to_host(self._state.ptr, 8 * self.stager.step_state.size)
        return np.frombuffer(raw, np.int64).reshape(self.stager.step_state.shape).copy()

    def _upload(self, state: np.ndarray) -> None:
        cu = self._cu
        cu.copy_to_device(self._state.ptr, np.ascontiguousarray(state).view(np.uint8).reshape(-1), 0)
        cu.synchronize(0, self.device)

    def _token_table(self, tokens: Any, fn: str) -> Any:
        """A chain drafter's device slot token table (None: a block drafter's Stager, which
        the Stager itself checks), checked: int32, one id per global slot, on this device."""
        if tokens is None:
            return None
        t = interop._dev_array(tokens, f"DeviceStep.{fn}: tokens", stream=0, writable=True)
        want = self.max_seqs * int(self.stager.ring_rows)
        if t.dtype != np.dtype(np.int32) or t.shape != (want,):
            raise ValueError(f"DeviceStep.{fn}: tokens must be the slot token table, int32 ({want},) "
                             f"(Stager.new_token_table()'s shape), got {t.dtype} {t.shape}")
        if interop._device_of(t) != self.device:
            raise ValueError(f"DeviceStep.{fn}: tokens are on device {t.device}, the step on device {self.device}")
        return t

    def _slices(self, ids: np.ndarray) -> list[tuple[int, int]]:
        """Each sequence's slots of the token table: (first id, count)."""
        rr = int(self.stager.ring_rows)
        return [(int(q) * rr, rr) for q in ids.tolist()]

    def to_device(self, seqs: Sequence[int], tokens: Any = None) -> None:
        """``stager.to_device(seqs)`` and their columns onto the device (one wait).
        ``tokens`` (a chain drafter's Stager): the device slot token table, whose slots of
        ``seqs`` receive their ids (-1 where no row is)."""
        ids = np.asarray(seqs, np.int64)
        t = self._token_table(tokens, "to_device")
        host_table = self.stager.new_token_table() if t is not None else None
        dev = self._download()
        self.stager.to_device(ids, tokens=host_table)
        dev[:, ids] = self.stager.step_state[:, ids]
        if host_table is not None:  # given exactly with t
            for first, n in self._slices(ids):
                self._cu.copy_to_device(t.ptr + 4 * first, host_table[first:first + n].view(np.uint8), 0)
        self._upload(dev)

    def to_host(self, seqs: Sequence[int], outcomes: Any = None, tokens: Any = None) -> np.ndarray:
        """Their columns back from the device, then ``stager.to_host(seqs, outcomes)``; the
        columns go back to the device after it (no longer live there). One wait.
        ``tokens`` (a chain drafter's Stager): the device slot token table, read at the
        slots of ``seqs``."""
        ids = np.asarray(seqs, np.int64)
        t = self._token_table(tokens, "to_host")
        host_table = None
        dev = self._download()
        if t is not None:
            host_table = self.stager.new_token_table()
            for first, n in self._slices(ids):
                raw = self._cu.copy_to_host(t.ptr + 4 * first, 4 * n)
                host_table[first:first + n] = np.frombuffer(raw, np.int32)
        host = self.stager.step_state
        host[:, ids] = dev[:, ids]
        try:
            return self.stager.to_host(ids, outcomes, tokens=host_table)
        finally:
            dev[:, ids] = host[:, ids]
            self._upload(dev)
