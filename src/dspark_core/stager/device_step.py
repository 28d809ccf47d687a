"""The device step's answers and status words (docs/protocol.md, "The device step").

``Stager.step_many`` (the CPU twin) and the CUDA step write one step's answers
for a batch of ``n`` entries into a :class:`StepOutputs`: per entry a status
word, the next round's plan (skip code, flags, ``pos_base``, ``crop_from``,
``n_rows``), the drafter's gather slots and positions in the graph-safe
padded layout (``[n, max_rows]``, ``-1`` padding), the block's drafter
positions (``[n, B]``) and the slots of the next verify batch's rows
(``[n, B + 1]``, ``-1`` where unused). The same arrays are reused step after
step (a captured CUDA graph needs fixed buffers).

The status codes are the core's (``dspark/step_math.hpp``): ``STEP_OK`` and
``STEP_NOT_IN_STEP`` are not errors; every code from ``STEP_FIRST_ERROR`` on
is one, and the step changed nothing for that entry.

``padded=False`` leaves the padded arrays out (the step's biggest write); the batch's rows
are then one call away as CSR rows, :class:`StepRows` (``Stager.step_rows``: ``row_offsets``
and flat slots and positions, ``draft_many``'s layout; docs/protocol.md 2.10).

A ``StepOutputs`` of capacity ``N`` (``StepOutputs.empty(N, ...)``) serves any batch of at most
``N`` entries: the entries past the batch are padding (:data:`PADDING_ID`, count ``-1``:
``STEP_NOT_IN_STEP``, nothing changed, "nothing" written), so a CUDA graph captured for ``N``
entries replays over a batch whose size changes step to step; a server that keeps its own id
and count arrays of length ``N`` writes the padding entry itself.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from .._ext import _row_format

STEP_OK = 0
STEP_NOT_IN_STEP = 1
STEP_FIRST_ERROR = 16
STEP_NOT_ON_DEVICE = 16
STEP_DUPLICATE = 17
STEP_BAD_COUNT = 18
STEP_POSITION_LIMIT = 19
STEP_INTERNAL = 20
STEP_DAMAGED = 21
#: The names of the status codes (for logs).
STEP_STATUS_NAMES = {
    STEP_OK: "ok",
    STEP_NOT_IN_STEP: "not_in_step",
    STEP_NOT_ON_DEVICE: "not_on_device",
    STEP_DUPLICATE: "duplicate",
    STEP_BAD_COUNT: "bad_count",
    STEP_POSITION_LIMIT: "position_limit",
    STEP_INTERNAL: "internal",
    STEP_DAMAGED: "damaged",
}
#: The id of a padding entry (with accept count -1): ``STEP_NOT_IN_STEP``, changes nothing.
PADDING_ID = -1
#: ``flags`` bits.
STEP_REBASE = 1
STEP_CLEAR_CACHE = 2
#: ``skip`` of an entry that was not stepped (else the core's skip code, one of the three below or 0).
NOT_STEPPED = -1
#: The skips a step can make (the core's ``Skip`` codes; a skipped entry reserves its one verify
#: row ``[end]``): ``max_failures`` rounds failed (until ``begin``), no context (nothing new to
#: draft from), and drafting turned off for the request (``disable``; ``enable`` drafts again).
SKIP_NONE = 0
SKIP_DISABLED = 1
SKIP_NO_CONTEXT = 3
SKIP_DRAFTING_OFF = 5

_INT = {4: np.int32, 8: np.int64}
#: Each array's name, dtype and shape in units of (n, max_rows, block): the core's list
#: (DSPARK_STEP_OUTPUT_FIELDS), read through the binding.
_LAYOUT: tuple[tuple[str, type, str], ...] = tuple(
    (name, _INT[nbytes], shape) for name, nbytes, shape in _row_format.STEP_OUTPUTS)


#: The step state's fields, in column order (``Stager.step_state[STEP_STATE_FIELDS.index(name)]``
#: is that field of every sequence); the acceptance histogram's ``B + 1`` columns follow.
STEP_STATE_FIELDS: tuple[str, ...] = _row_format.STEP_STATE_FIELDS

#: The padded arrays, which may be None (not written).
_PADDED = ("row_slots", "row_positions")


#: The plan arrays a CSR pass reads (Stager.step_rows): (index in the core's order, name, dtype).
_PLAN = ("status", "skip", "start", "n_rows", "pos_base")
_PLAN_AT: tuple[tuple[int, str, np.dtype], ...] = tuple(
    (k, name, np.dtype(dtype)) for k, (name, dtype, _) in enumerate(_LAYOUT) if name in _PLAN)


def _check_array(what: str, name: str, arr: Any, dtype: Any, want: tuple[int, ...]) -> None:
    """Raise unless ``arr`` is a numpy array of ``dtype`` and shape ``want``, C-contiguous,
    aligned and writable (the core writes through raw pointers: nothing else is safe)."""
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"{what}: {name} must be a numpy array, got {type(arr).__name__}")
    if arr.dtype != np.dtype(dtype) or arr.shape != want:
        raise ValueError(f"{what}: {name} must be {np.dtype(dtype).name} of shape {want}, "
                         f"got {arr.dtype.name} of shape {arr.shape}")
    if not arr.flags.c_contiguous or not arr.flags.writeable or not arr.flags.aligned:
        raise ValueError(f"{what}: {name} must be C-contiguous, aligned and writable")


def _shape(kind: str, n: int, max_rows: int, block: int) -> tuple[int, ...]:
    dims = {"n": n, "max_rows": max_rows, "block": block, "block+1": block + 1}
    return tuple(dims[d] for d in kind.split(","))


@dataclass
class StepOutputs:
    """One step's answers for ``n`` entries (see the module docstring); reusable."""

    status: np.ndarray
    skip: np.ndarray
    flags: np.ndarray
    start: np.ndarray
    pos_base: np.ndarray
    crop_from: np.ndarray
    n_rows: np.ndarray
    row_slots: np.ndarray | None
    row_positions: np.ndarray | None
    block_positions: np.ndarray
    verify_slots: np.ndarray

    @classmethod
    def empty(cls, n: int, max_rows: int, block: int, padded: bool = True) -> StepOutputs:
        """Arrays for ``n`` entries (``max_rows``: ``Stager.step_layout[1]``, ``block``: B).
        ``padded=False``: no ``row_slots`` / ``row_positions`` (None: not written; the
        plan's rows are then ``n_rows`` rows from its ``pos_base``-relative start, as the
        plan arrays of ``draft_many`` give them)."""
        arrays: dict[str, np.ndarray | None] = {
            name: np.full(_shape(kind, n, max_rows, block), -1, dtype) if padded or name not in _PADDED else None
            for name, dtype, kind in _LAYOUT}
        return cls(**arrays)  # type: ignore[arg-type]

    @property
    def capacity(self) -> int:
        """How many entries these arrays hold: a step of any batch of at most this many
        (the rest are padding entries)."""
        return int(np.shape(self.status)[0])

    def check(self, n: int, max_rows: int, block: int) -> None:
        """Raise unless every array has its dtype and shape for one capacity of at least ``n``
        entries, C-contiguous, aligned and writable (the core writes through raw pointers:
        nothing else is safe)."""
        StepOutputs.checked_arrays(self, n, max_rows, block)

    def checked_arrays(self, n: int, max_rows: int, block: int) -> tuple[np.ndarray | None, ...]:
        """Every field read once, in the core's order, and checked as :meth:`check` does: the
        very arrays checked, which a step writes through (the binding holds them for the
        call, so a field that changes after the check, a property that makes a new array
        each time, or another thread replacing one, can never hand the core other memory).
        Their capacity is the first one's (``status``): at least ``n``."""
        arrays: list[np.ndarray | None] = []
        capacity = -1
        for name, dtype, kind in _LAYOUT:
            arr = getattr(self, name)
            arrays.append(arr)
            if arr is None and name in _PADDED:
                continue
            if capacity < 0:
                capacity = arr.shape[0] if isinstance(arr, np.ndarray) and arr.ndim >= 1 else n
                if capacity < n:
                    raise ValueError(f"step outputs: {capacity} entries for a batch of {n}: a StepOutputs "
                                     "serves any batch of at most its capacity")
            _check_array("step outputs", name, arr, dtype, _shape(kind, capacity, max_rows, block))
        return tuple(arrays)

    def checked_plan_arrays(self, n: int) -> tuple[np.ndarray | None, ...]:
        """What ``Stager.step_rows`` reads of a step's answers, in the core's order: the plan
        arrays (:data:`_PLAN`: status, skip, start, n_rows, pos_base), each read once and
        checked (dtype, shape: one capacity of at least ``n``, C-contiguous, aligned), None
        for the others (not read). Lighter than :meth:`checked_arrays`: a pass that reads
        five per-entry arrays need not check the rest."""
        arrays: list[np.ndarray | None] = [None] * len(_LAYOUT)
        capacity = -1
        for k, name, dtype in _PLAN_AT:
            arr = getattr(self, name)
            if not isinstance(arr, np.ndarray):
                raise TypeError(f"step outputs: {name} must be a numpy array, got {type(arr).__name__}")
            if capacity < 0:
                capacity = arr.shape[0] if arr.ndim == 1 else -1
                if 0 <= capacity < n:
                    raise ValueError(f"step outputs: {capacity} entries for a batch of {n}: a StepOutputs "
                                     "serves any batch of at most its capacity")
            if arr.dtype != dtype or arr.ndim != 1 or arr.shape[0] != capacity:
                want = (max(capacity, n),)
                raise ValueError(f"step outputs: {name} must be {dtype.name} of shape {want}, "
                                 f"got {arr.dtype.name} of shape {arr.shape}")
            if not arr.flags.c_contiguous or not arr.flags.aligned:
                raise ValueError(f"step outputs: {name} must be C-contiguous and aligned")
            arrays[k] = arr
        return tuple(arrays)

    def errors(self) -> np.ndarray:
        """The indices of the entries whose status is an error."""
        return np.flatnonzero(self.status >= STEP_FIRST_ERROR)


@dataclass
class StepRows:
    """The CSR rows of a step's batch (``Stager.step_rows``; ``cuda.DeviceStep(...,
    rows="csr")``): the unpadded layout's gather, one call over ``row_offsets[-1]`` rows,
    as ``draft_many``'s ``BatchPlan`` lays its rows out. For a capacity of ``N`` entries:

    * ``row_offsets`` int64 ``(N + 1,)``: entry i's rows are ``[row_offsets[i],
      row_offsets[i + 1])`` (an entry not stepped, skipped or padding has none);
    * ``row_slots`` int64 ``(N * max_rows,)``: their global slots (what the padded
      ``StepOutputs.row_slots[i, :n_rows[i]]`` hold, concatenated);
    * ``row_positions`` int32 ``(N * max_rows,)``: their drafter positions.

    Only the first ``row_offsets[-1]`` elements of the flat arrays are written; the rest
    keep what they held. ``row_slots`` / ``row_positions`` may be None (not written).
    Reusable step after step (fixed buffers)."""

    row_offsets: np.ndarray
    row_slots: np.ndarray | None
    row_positions: np.ndarray | None

    @classmethod
    def empty(cls, capacity: int, max_rows: int) -> StepRows:
        """Arrays for ``capacity`` entries (``max_rows``: ``Stager.step_layout[1]``), -1 filled."""
        capacity, max_rows = int(capacity), int(max_rows)
        if capacity < 0 or max_rows < 0:
            raise ValueError(f"StepRows.empty: capacity and max_rows must be >= 0, got {capacity}, {max_rows}")
        return cls(np.zeros(capacity + 1, np.int64), np.full(capacity * max_rows, -1, np.int64),
                   np.full(capacity * max_rows, -1, np.int32))

    @property
    def capacity(self) -> int:
        """How many entries these arrays hold."""
        return int(np.shape(self.row_offsets)[0]) - 1

    @property
    def total(self) -> int:
        """How many rows the last pass wrote (``row_offsets[-1]``)."""
        return int(self.row_offsets[-1])

    def entry(self, i: int) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Entry i's slots and positions (views)."""
        lo, hi = int(self.row_offsets[i]), int(self.row_offsets[i + 1])
        return (None if self.row_slots is None else self.row_slots[lo:hi],
                None if self.row_positions is None else self.row_positions[lo:hi])

    def check(self, n: int, max_rows: int) -> None:
        """Raise unless the arrays are laid out for one capacity of at least ``n`` entries."""
        StepRows.checked_arrays(self, n, max_rows)

    def checked_arrays(self, n: int, max_rows: int) -> tuple[np.ndarray | None, ...]:
        """``(row_offsets, row_slots, row_positions)``, each read once and checked (dtype,
        shape, C-contiguous, aligned, writable): the very arrays a pass writes through (see
        :meth:`StepOutputs.checked_arrays`). Their capacity is ``row_offsets``': at least ``n``."""
        offsets = self.row_offsets
        arrays: list[np.ndarray | None] = [offsets, self.row_slots, self.row_positions]
        if not isinstance(offsets, np.ndarray) or offsets.ndim != 1 or offsets.shape[0] < 1:
            raise ValueError("step rows: row_offsets must be a 1-d int64 array of capacity + 1 entries")
        capacity = offsets.shape[0] - 1
        if capacity < n:
            raise ValueError(f"step rows: {capacity} entries for a batch of {n}: StepRows serve any batch of at "
                             "most their capacity")
        for name, arr, dtype, want in (("row_offsets", offsets, np.int64, (capacity + 1,)),
                                       ("row_slots", arrays[1], np.int64, (capacity * max_rows,)),
                                       ("row_positions", arrays[2], np.int32, (capacity * max_rows,))):
            if arr is None and name != "row_offsets":
                continue
            _check_array("step rows", name, arr, dtype, want)
        return tuple(arrays)


def _check() -> None:
    """StepOutputs names the core's outputs, in its order (checked at import: an output the
    core gains fails ``import dspark_core`` until it is named here, not a step later)."""
    ours = tuple(f.name for f in fields(StepOutputs))
    core = tuple(name for name, _, _ in _LAYOUT)
    if ours != core:
        raise ImportError(f"dspark_core.stager.device_step.StepOutputs has fields {ours}; the core's step "
                          f"writes {core}: the package and its core disagree")


_check()
