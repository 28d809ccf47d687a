"""The device step on a CUDA device (docs/protocol.md 2.10; csrc/cuda/step_cuda.hpp).

:class:`DeviceStep` owns the device copy of one Stager's step state and fixed
device buffers for a batch of up to ``capacity`` entries: the sequence ids,
the sampler's accept counts (int32, or the sampler's own int32 / int64 buffer:
:meth:`read_counts_from`) and every output of a step. :meth:`launch`
enqueues one step (one kernel launch; nothing synchronises, allocates or
copies), so it can be captured into a CUDA graph with the drafter and the
verify forward; between replays the sampler writes new counts into
:attr:`counts_ptr`.

Handing sequences over and back (:meth:`to_device`, :meth:`to_host`) moves
only the handed sequences' columns of the step state (one strided copy per
run of consecutive ids), ordered on the step's :attr:`stream` (``stream=`` at
construction: the server's stream, the one its steps and graph replays run
on). A step of another sequence, launched or running meanwhile, is neither
undone nor raced; ``to_host`` waits for the steps enqueued on that stream
before it, ``to_device`` waits for nothing. Steps run on another stream must
be ordered before a hand-over by the caller (an event the step's stream waits for).

``padded=False`` leaves out the padded ``[capacity, max_rows]`` gather slots and positions
(not allocated, not written); ``rows="csr"`` makes every :meth:`launch` also write the CSR
rows of its batch (``Stager.step_rows`` on the device: two more launches in the same
stream, so inside the same captured graph) into :attr:`csr`: ``row_offsets``
(``capacity + 1``), ``row_slots`` and ``row_positions`` (``capacity * max_rows``, the first
``row_offsets[-1]`` written), a gather of one call over them (docs/protocol.md 2.10).

A chain drafter's Stager (``kind="chain"``) hands its rows' ids over by slot:
the server keeps the slot token table on the device beside its rows (int32,
``Stager.new_token_table()``'s size), writes each verify row's id at its verify
slot in the same graph as the verify forward (``table[verify_slots] =
input_ids``), and reads the staged rows' ids at ``row_slots``;
:meth:`to_device` / :meth:`to_host` take it as ``tokens`` and copy only the
handed sequences' slots, on the same stream.

Ids and accept counts are converted by the Stager's rules (``as_seq_ids``,
``batch_ints``): what ``Stager.step_many`` / ``to_device`` / ``to_host`` refuse
is refused with the same exception; an accept count the int32 buffer cannot
hold is clamped into it, which keeps it a bad count (``STEP_BAD_COUNT``), as
the CPU twin names it.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from . import _backend, interop
from ..stager._args import _INT32_MAX, _INT32_MIN, as_seq_ids, batch_ints
from ..stager.device_step import _LAYOUT, _PADDED, PADDING_ID, STEP_STATE_FIELDS, StepOutputs, StepRows
from .interop import DeviceArray

#: The step's outputs as laid out on the device: name, dtype, columns (per entry), from the
#: core's output list (the host twin's StepOutputs layout).
_OUTPUTS = tuple((name, dtype, 1 if shape == "n" else shape.split(",", 1)[1]) for name, dtype, shape in _LAYOUT)

#: The accept count types the kernel reads.
_COUNT_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))


class DeviceStep:
    """The device step of ``stager`` (external rows) for batches of up to ``capacity`` entries,
    on ``device``. ``stream`` (an int handle or a CUDA stream object; default the legacy
    default stream; ``"new"``: a stream of this object's own, created here): the stream the
    steps run on, on which every copy of this object is ordered (hand-overs, batches,
    counts) and :meth:`launch` enqueues by default. :meth:`capture` needs a stream other
    than the legacy default one (which cannot be captured)."""

    def __init__(self, stager: Any, capacity: int, device: int = 0, stream: Any = 0, padded: bool = True,
                 rows: str | None = None) -> None:
        if rows not in (None, "csr"):
            raise ValueError(f'DeviceStep: rows must be None or "csr", got {rows!r}')
        cu: Any = _backend._cuda
        if cu is None:
            raise RuntimeError("dspark_core was built without its CUDA kernels: DeviceStep needs them")
        self._cu = cu  # the extension (its handle checked once)
        self.stager = stager
        self.capacity = int(capacity)
        self.device = device
        if isinstance(stream, str) and stream == "new":
            self._own_stream = cu.Stream(device)  # kept alive with this object
            stream = self._own_stream.handle
        self.stream = interop._stream_handle(stream, "", device)
        cfg = stager.step_config
        self._config = tuple(int(cfg[k]) for k in cu.STEP_CONFIG_KEYS)
        self.block, self.max_rows, self.max_seqs = int(cfg["block"]), int(cfg["max_rows"]), int(cfg["max_seqs"])
        host = stager.step_state
        self._state = cu.Allocation(host.nbytes, device)
        cu.copy_to_device(self._state.ptr, np.ascontiguousarray(host).view(np.uint8).reshape(-1), self.stream)
        self._seqs = cu.Allocation(8 * max(1, self.capacity), device)
        self._counts = cu.Allocation(4 * max(1, self.capacity), device)
        # Where the step reads the accept counts: this step's own int32 buffer, or the sampler's.
        self._counts_at, self._counts_dtype = int(self._counts.ptr), np.dtype(np.int32)
        # The outputs as DeviceArrays of fixed shape (capacity rows, -1 until written): a ring's
        # gather_slots / write_slots take .arrays["row_slots"] / ["verify_slots"] in the same graph.
        self.arrays: dict[str, DeviceArray] = {}
        self._out: dict[str, Any] = {}
        self.padded, self.rows = bool(padded), rows
        for name, dtype, cols in _OUTPUTS:
            if name in _PADDED and not self.padded:
                continue
            shape = (max(1, self.capacity),) if cols == 1 else (max(1, self.capacity), self._cols(cols))
            arr = DeviceArray.from_numpy(np.full(shape, -1, dtype), device=device, stream=self.stream)
            self.arrays[name] = arr
            self._out[name] = (arr, dtype, cols)
        #: The CSR rows (rows="csr"): row_offsets, row_slots, row_positions as DeviceArrays.
        self.csr: dict[str, DeviceArray] = {}
        if rows == "csr":
            host_rows = StepRows.empty(max(1, self.capacity), self.max_rows)
            for name in ("row_offsets", "row_slots", "row_positions"):
                self.csr[name] = DeviceArray.from_numpy(getattr(host_rows, name), device=device, stream=self.stream)
        cu.synchronize(self.stream, device)
        self.n = 0
        self._captured = False  # a graph of capacity entries reads these buffers: every batch padded

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
        one count per batch entry and outlive the launches that read it. Refused
        (ValueError, nothing changes): another type, a null or misaligned pointer, memory
        that is not this step's device's."""
        fn = "DeviceStep.read_counts_from"
        if isinstance(counts, DeviceArray):
            ptr, dt = int(counts.ptr), np.dtype(counts.dtype if dtype is None else dtype)
            if counts.size < self.capacity:
                raise ValueError(f"{fn}: {counts.size} counts, the capacity is {self.capacity}")
        else:
            if dtype is None:
                raise ValueError(f"{fn}: a raw pointer needs its dtype (int32 or int64)")
            ptr, dt = int(counts), np.dtype(dtype)
        if dt not in _COUNT_DTYPES:
            raise ValueError(f"{fn}: counts must be int32 or int64, got {dt}")
        if ptr == 0:
            raise ValueError(f"{fn}: a null pointer")
        # The kernel reads one count per entry: a misaligned buffer would fault on a GPU.
        if ptr % dt.itemsize:
            raise ValueError(f"{fn}: the counts pointer {ptr:#x} is not {dt.itemsize}-byte aligned ({dt})")
        where = int(self._cu.pointer_device(ptr))
        if where < 0:
            raise ValueError(f"{fn}: the counts pointer {ptr:#x} is not CUDA device memory")
        if where != self.device:
            raise ValueError(f"{fn}: the counts are on device {where}, the step on device {self.device}")
        self._counts_at, self._counts_dtype = ptr, dt

    def _counts_of(self, counts: Any, n: int, fn: str) -> np.ndarray:
        """``counts`` as the counts buffer's type, by ``step_many``'s rules (TypeError: not
        integers; ValueError: not one per entry; beyond int64 clamped). A count int32 cannot
        hold is clamped into it: still a bad count (-1 is the only negative one a step takes,
        and none reaches the block size), as the twin names the original."""
        c = batch_ints(fn, "n_accepted", counts, n)
        if self._counts_dtype == np.dtype(np.int32):
            c = np.clip(c, _INT32_MIN, _INT32_MAX).astype(np.int32)
        return np.ascontiguousarray(c, self._counts_dtype)

    def set_batch(self, seqs: Sequence[int], counts: Sequence[int] | None = None, pad: bool = False) -> None:
        """The batch's sequence ids (and counts), copied to the device (outside a graph).
        Ids convert as ``step_many``'s do (TypeError: not integers); every check comes
        before any copy. ``pad``: the batch fills the first entries and the rest of the
        capacity holds padding entries (``PADDING_ID``, count -1: ``STEP_NOT_IN_STEP``,
        nothing changed), so every launch is one of ``capacity`` entries and a graph
        captured once replays over a batch whose size changes (the sampler writes -1 at
        the padding entries' counts). After :meth:`capture` every batch is padded."""
        cu = self._cu
        ids = as_seq_ids("DeviceStep.set_batch", seqs)
        if len(ids) > self.capacity:
            raise ValueError(f"DeviceStep.set_batch: at most {self.capacity} sequence ids (seqs), got {len(ids)}")
        c = None if counts is None else self._counts_of(counts, len(ids), "DeviceStep.set_batch")
        n_batch, extra = len(ids), 0
        if (pad or self._captured) and len(ids) < self.capacity:
            extra = self.capacity - len(ids)
            ids = np.concatenate([ids, np.full(extra, PADDING_ID, np.int64)])
        cu.copy_to_device(self._seqs.ptr, ids.view(np.uint8), self.stream)
        self.n = len(ids)
        if c is not None:
            cu.copy_to_device(self._counts_at, c.view(np.uint8), self.stream)
        if extra:  # a padding entry is PADDING_ID with count -1 (with any other count: an unknown id)
            pad_counts = np.full(extra, -1, self._counts_dtype)
            cu.copy_to_device(self._counts_at + self._counts_dtype.itemsize * n_batch, pad_counts.view(np.uint8),
                              self.stream)
        cu.synchronize(self.stream, self.device)

    def set_counts(self, counts: Sequence[int]) -> None:
        """Write the accept counts (what a sampler kernel does on the device), outside a graph.
        Converted as ``step_many``'s ``n_accepted`` (see :meth:`_counts_of`)."""
        cu = self._cu
        c = self._counts_of(counts, self.n, "DeviceStep.set_counts")
        cu.copy_to_device(self._counts_at, c.view(np.uint8), self.stream)
        cu.synchronize(self.stream, self.device)

    def launch(self, stream: Any = None) -> None:
        """Enqueue one step of the current batch on ``stream`` (None: :attr:`stream`): one
        kernel launch, capturable. On another stream, order it before the next hand-over."""
        s = self.stream if stream is None else interop._stream_handle(stream, "", self.device)
        outs = tuple(int(self._out[name][0].ptr) if name in self._out else 0 for name, _, _ in _OUTPUTS)
        self._cu.device_step(self._config, self._state.ptr, self._seqs.ptr, self._counts_at,
                             self._counts_dtype.itemsize, self.n, outs, s)
        if self.csr:
            r = self.csr
            self._cu.device_step_rows(self._config, self._state.ptr, self._seqs.ptr, self.n, outs,
                                      max(1, self.capacity), int(r["row_offsets"].ptr), int(r["row_slots"].ptr),
                                      int(r["row_positions"].ptr), s)

    def capture(self) -> Any:
        """One step of all ``capacity`` entries of the batch buffers (:meth:`set_batch`,
        :attr:`counts_ptr`) captured into a CUDA graph on :attr:`stream`, instantiated:
        :meth:`replay` (or ``graph.launch(stream)``) replays it, one launch per step, whatever
        batch was written into those buffers since (from then on every :meth:`set_batch` pads
        the entries past its batch; the current batch is padded now). Capture it once, after
        :meth:`read_counts_from` if the sampler's buffer is to be read. ValueError on the legacy
        default stream (``stream=`` a stream of the server's, or ``"new"``)."""
        if self.stream == 0:
            raise ValueError("DeviceStep.capture: the legacy default stream cannot be captured: construct the "
                             "step on a stream of its own (DeviceStep(..., stream=server_stream or \"new\"))")
        if self.n < self.capacity:  # the graph steps every entry: those past the batch are padding
            self.set_batch(self._batch_ids().tolist(), None, pad=True)
        self._captured = True
        cu = self._cu
        cu.capture_begin(self.stream, self.device)
        try:
            self.launch()
        finally:
            graph = cu.capture_end(self.stream, self.device)
        return graph

    def _batch_ids(self) -> np.ndarray:
        """The current batch's ids, read back from the device."""
        raw = self._cu.copy_to_host(self._seqs.ptr, 8 * self.n)
        return np.frombuffer(raw, np.int64).copy()

    def replay(self, graph: Any) -> None:
        """Enqueue one replay of a graph from :meth:`capture` on :attr:`stream` (asynchronous)."""
        graph.launch(self.stream)

    def outputs(self) -> StepOutputs:
        """The last step's answers, copied to the host after the steps enqueued on
        :attr:`stream` (synchronous: tests and logs)."""
        cu = self._cu
        cu.synchronize(self.stream, self.device)
        arrays: dict[str, Any] = dict.fromkeys(_PADDED)
        for name, (alloc, dtype, cols) in self._out.items():
            k = self._cols(cols)
            raw = cu.copy_to_host(alloc.ptr, np.dtype(dtype).itemsize * k * self.n)
            a = np.frombuffer(raw, dtype).copy()
            arrays[name] = a if cols == 1 else a.reshape(self.n, k)
        return StepOutputs(**arrays)

    def set_drafting(self, seqs: Sequence[int], on: bool) -> None:
        """Turn drafting on or off for ``seqs`` (``Stager.enable_many`` / ``disable_many``:
        any state, every id checked first, nothing changed on an error). For those handed
        over, their ``drafting_off`` column (that column only: the others are the device's,
        newer than the host's) is copied onto the device copy, on :attr:`stream`, so the
        steps enqueued after this call skip them with ``SKIP_DRAFTING_OFF`` (or draft them
        again) and :meth:`to_host` brings the switch back. Waits for the copy (outside a
        graph, as :meth:`set_batch`)."""
        st = self.stager
        ids = as_seq_ids("DeviceStep.set_drafting", seqs)
        (st.enable_many if on else st.disable_many)(ids)
        col = STEP_STATE_FIELDS.index("drafting_off")
        value = np.array([0 if on else 1], np.int64).view(np.uint8)
        for q in sorted({q for q in ids.tolist() if st.on_device(q)}):
            self._cu.copy_to_device(self._state.ptr + 8 * (col * self.max_seqs + q), value, self.stream)
        self._cu.synchronize(self.stream, self.device)

    def sync_metrics(self) -> None:
        """Copy every handed-over sequence's step-state columns back from the device copy into
        the host step state, after the steps enqueued on :attr:`stream` (one wait), so the
        Stager's metrics (``stats``, ``totals``, the Prometheus exporter) read them as of now
        (design.md 2.10: as of the last copy back). They stay on the device; nothing else
        changes. Call it as often as the metrics should be fresh."""
        st = self.stager
        held = np.array([q for q in range(self.max_seqs) if st.on_device(q)], np.int64)
        if held.size:
            self._cu.step_columns_to_host(self._config, self._state.ptr, st.step_state, held, self.stream)

    def csr_rows(self) -> StepRows:
        """The last step's CSR rows (rows="csr"), copied to the host after the steps enqueued
        on :attr:`stream` (synchronous: tests and logs): the offsets, and the slots and
        positions of the ``row_offsets[-1]`` rows written (the flat arrays' other elements
        as the device holds them)."""
        if not self.csr:
            raise ValueError('DeviceStep.csr_rows: this step writes no CSR rows (DeviceStep(..., rows="csr"))')
        cu = self._cu
        cu.synchronize(self.stream, self.device)
        got = {}
        for name, arr in self.csr.items():
            raw = cu.copy_to_host(arr.ptr, arr.nbytes)
            got[name] = np.frombuffer(raw, arr.dtype).copy()
        return StepRows(**got)

    def _columns_to_device(self, ids: np.ndarray) -> None:
        """The host step state's columns of ``ids`` (and no other) into the device copy, on :attr:`stream`."""
        if ids.size:
            self._cu.step_columns_to_device(self._config, self._state.ptr, self.stager.step_state, ids, self.stream)

    def _token_table(self, tokens: Any, fn: str) -> Any:
        """A chain drafter's device slot token table (None: a block drafter's Stager, which
        the Stager itself checks), checked: int32, one id per global slot, aligned, on this
        device."""
        if tokens is None:
            return None
        t = interop._dev_array(tokens, f"DeviceStep.{fn}: tokens", stream=self.stream, writable=True)
        want = self.max_seqs * int(self.stager.ring_rows)
        if t.dtype != np.dtype(np.int32) or t.shape != (want,):
            raise ValueError(f"DeviceStep.{fn}: tokens must be the slot token table, int32 ({want},) "
                             f"(Stager.new_token_table()'s shape), got {t.dtype} {t.shape}")
        if t.ptr % t.dtype.itemsize:  # the server's kernels read and write it as int32
            raise ValueError(f"DeviceStep.{fn}: tokens (the slot token table at {t.ptr:#x}) is not "
                             f"{t.dtype.itemsize}-byte aligned")
        if interop._device_of(t) != self.device:
            raise ValueError(f"DeviceStep.{fn}: tokens are on device {t.device}, the step on device {self.device}")
        return t

    def _slices(self, ids: np.ndarray) -> list[tuple[int, int]]:
        """Each sequence's slots of the token table: (first id, count)."""
        rr = int(self.stager.ring_rows)
        return [(int(q) * rr, rr) for q in ids.tolist()]

    def to_device(self, seqs: Sequence[int], tokens: Any = None) -> None:
        """``stager.to_device(seqs)``, then their columns (only theirs) onto the device, on
        :attr:`stream` (no wait). ``tokens`` (a chain drafter's Stager): the device slot
        token table, whose slots of ``seqs`` receive their ids (-1 where no row is).
        Refused as the Stager refuses (the same exception), changing nothing."""
        ids = as_seq_ids("to_device", seqs)
        t = self._token_table(tokens, "to_device")
        host_table = self.stager.new_token_table() if t is not None else None
        self.stager.to_device(ids, tokens=host_table)
        self._columns_to_device(ids)
        if host_table is not None:  # given exactly with t
            for first, n in self._slices(ids):
                self._cu.copy_to_device(t.ptr + 4 * first, host_table[first:first + n].view(np.uint8), self.stream)

    def to_host(self, seqs: Sequence[int], outcomes: Any = None, tokens: Any = None) -> np.ndarray:
        """Their columns (only theirs) back from the device after the steps enqueued on
        :attr:`stream` (one wait), then ``stager.to_host(seqs, outcomes)``; the columns go
        back to the device after it (no longer live there). ``tokens`` (a chain drafter's
        Stager): the device slot token table, read at the slots of ``seqs``. Refused as
        the Stager refuses (the same exception), bringing nothing back."""
        cu, st = self._cu, self.stager
        ids = as_seq_ids("to_host", seqs)
        t = self._token_table(tokens, "to_host")
        # Only columns of sequences on the device move: the Stager names any other id's fault.
        held = np.array([q for q in ids.tolist() if 0 <= q < self.max_seqs and st.on_device(q)], np.int64)
        if held.size:
            cu.step_columns_to_host(self._config, self._state.ptr, st.step_state, held, self.stream)
        host_table = None
        if t is not None:
            cu.synchronize(self.stream, self.device)  # the steps' writes into the table before it
            host_table = st.new_token_table()
            for first, n in self._slices(held):
                raw = cu.copy_to_host(t.ptr + 4 * first, 4 * n)
                host_table[first:first + n] = np.frombuffer(raw, np.int32)
        try:
            return st.to_host(ids, outcomes, tokens=host_table)
        finally:
            # Those that came back (all, or none when refused) are no longer live on the device.
            self._columns_to_device(held[np.array([not st.on_device(q) for q in held.tolist()], bool)])
