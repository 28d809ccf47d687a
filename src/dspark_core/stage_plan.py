"""What ``Stager.draft`` returns: the rows to stage and where to put them.

A :class:`StagePlan` tells the server, for one sequence and one round:

* ``clear_cache``: remove the drafter's whole sequence first;
* ``rows`` at drafter ``positions``: the context rows to decode;
* the block of ``B`` query rows at ``block_positions``;
* ``crop_from``: afterwards remove drafter cache positions ``>= crop_from``.

Positions are *drafter* positions (``abs_pos - pos_base``), always inside
``[0, window)``. A plan with ``skip`` set stages nothing and opens no round.

Every plan also carries ``slots``: the ring slot of each staged row (int64,
in plan order), in both row modes. In external-row mode
(``StagerConfig(rows="external")``) the Stager holds no rows: the server
reads them from its own table at ``plan.slots`` (``DeviceRing.gather``), and
``plan.rows`` / ``plan.encoded_rows`` raise.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from .core_tables import FAIL_STAGES, SKIP_REASONS

__all__ = ["StagePlan", "BatchPlan", "SKIP_REASONS", "FAIL_STAGES", "DISABLED_WARNING"]

#: The one warning logged when a sequence is disabled (sequence, failures, stage).
DISABLED_WARNING = (
    "sequence %d: drafting disabled after %d consecutive drafter failures (last: %s); begin() re-enables it"
)

_Decoder = Callable[[np.ndarray], np.ndarray]

_NO_SLOTS = np.zeros(0, np.int64)
_NO_SLOTS.flags.writeable = False

_EXTERNAL_ROWS = (
    "this plan comes from a Stager in external-row mode (rows='external'): it holds no rows; "
    "read them from your table at plan.slots (e.g. DeviceRing.gather(plan))"
)


def _no_slots() -> np.ndarray:
    """No staged slots: an empty int64 array."""
    return _NO_SLOTS


def _no_rows(feature_dim: int, stage_dtype: Any) -> np.ndarray:
    """No staged rows: ``(0, feature_dim)`` in the stage dtype."""
    return np.zeros((0, feature_dim), stage_dtype)


def _no_encoded(row_bytes: int) -> np.ndarray:
    """No encoded rows: ``(0, row_bytes)`` bytes."""
    return np.zeros((0, row_bytes), np.uint8)


class StagePlan:
    """One sequence's staging plan for one round (see module docstring).

    Attributes:
        seq: sequence id.
        start: the target's ``n_past`` the round was planned at.
        skip: ``None``, or why nothing is staged (one of :data:`SKIP_REASONS`).
        rebase: the drafter cache is rebuilt from retained rows this round.
        clear_cache: the server must remove the drafter's whole sequence first.
        positions: int32 drafter positions of ``rows``.
        block_positions: int32 drafter positions of the ``B`` block rows.
        crop_from: drafter cache positions ``>= crop_from`` are removed after decode.
        pos_base: absolute position of drafter position 0 this round.
        encoded_rows: uint8 ``(n, row_bytes)``: the staged rows in storage format
            (upload these and dequantize on the device to move 4-7x fewer bytes).
            Raises ValueError in external-row mode.
        slots: int64 ``(n,)``: the ring slot of each staged row, in plan order
            (both modes; at most two runs of consecutive slots).
        external: the plan is from an external-row Stager (no rows here).
        source: the Stager that made the plan (external mode; None in held
            mode): whose table ``slots`` index.
        round: the round this plan opened (unique within its Stager, from 1;
            0 for a skipped plan): the plan's ``slots`` may be read while
            ``source.open_round_id(seq) == round`` (``DeviceRing.gather``
            refuses a plan of a round that has closed).
    """

    __slots__ = (
        "seq",
        "start",
        "skip",
        "rebase",
        "clear_cache",
        "positions",
        "block_positions",
        "crop_from",
        "pos_base",
        "slots",
        "external",
        "source",
        "round",
        "_encoded",
        "_rows",
        "_decode",
    )

    def __init__(
        self,
        *,
        seq: int,
        start: int,
        skip: str | None,
        rebase: bool,
        clear_cache: bool,
        positions: np.ndarray,
        block_positions: np.ndarray,
        crop_from: int,
        pos_base: int,
        encoded_rows: np.ndarray | None,
        rows: np.ndarray | None = None,
        decode: _Decoder | None = None,
        slots: np.ndarray | None = None,
        external: bool = False,
        source: Any = None,
        round: int = 0,
    ) -> None:
        self.seq = seq
        self.start = start
        self.skip = skip
        self.rebase = rebase
        self.clear_cache = clear_cache
        self.positions = positions
        self.block_positions = block_positions
        self.crop_from = crop_from
        self.pos_base = pos_base
        self.slots = _no_slots() if slots is None else slots
        self.external = external
        self.source = source
        self.round = round
        self._encoded = encoded_rows
        self._rows = rows
        self._decode = decode

    @classmethod
    def skipped(cls, seq: int, start: int, reason: str, *, feature_dim: int, row_bytes: int,
                stage_dtype: np.dtype, external: bool = False) -> "StagePlan":
        """A plan that stages nothing and opens no round (``skip = reason``)."""
        return cls(
            seq=seq, start=start, skip=reason, rebase=False, clear_cache=False,
            positions=np.zeros(0, np.int32), block_positions=np.zeros(0, np.int32),
            crop_from=-1, pos_base=-1, encoded_rows=None if external else _no_encoded(row_bytes),
            rows=None if external else _no_rows(feature_dim, stage_dtype), external=external,
        )

    @property
    def encoded_rows(self) -> np.ndarray:
        """The staged rows in storage format, uint8 ``(n, row_bytes)`` (held mode only)."""
        if self.external:
            raise ValueError(_EXTERNAL_ROWS)
        assert self._encoded is not None
        return self._encoded

    @property
    def rows(self) -> np.ndarray:
        """The staged rows, ``(n, feature_dim)`` in the configured stage dtype.

        Decoded from ``encoded_rows`` on first access (a free view when the
        storage format is the stage dtype) and cached. Held mode only.
        """
        if self.external:
            raise ValueError(_EXTERNAL_ROWS)
        if self._rows is None:
            assert self._decode is not None
            self._rows = self._decode(self.encoded_rows)
            self._decode = None
        return self._rows

    @property
    def n_rows(self) -> int:
        """Number of context rows staged (excluding the block)."""
        return int(self.positions.shape[0])

    def __repr__(self) -> str:
        if self.skip is not None:
            return f"StagePlan(seq={self.seq}, start={self.start}, skip={self.skip!r})"
        pos = self.positions
        span = f"[{pos[0]}, {pos[-1] + 1})" if len(pos) else "[]"
        return (
            f"StagePlan(seq={self.seq}, start={self.start}, rebase={self.rebase}, "
            f"clear_cache={self.clear_cache}, rows={len(pos)} at {span}, "
            f"block=[{self.block_positions[0]}, {self.block_positions[-1] + 1}), "
            f"crop_from={self.crop_from}, pos_base={self.pos_base})"
        )


class BatchPlan:
    """Plans for several sequences staged as one drafter batch (``draft_many``).

    Attributes:
        plans: one :class:`StagePlan` per requested sequence, in request order.
        seqs: the requested sequence ids.
        positions: int32 drafter positions of all context rows, concatenated.
        row_seq: int32 sequence id of each concatenated context row.
        skips: ``{seq: reason}`` for the sequences that were skipped.
        slots: int64 ring slot of each concatenated context row (both modes).
        external: the plans come from an external-row Stager (``rows`` and
            ``encoded_rows`` raise; gather the rows at ``slots``).
    """

    __slots__ = ("plans", "seqs", "positions", "row_seq", "skips", "slots", "external", "_rows", "_encoded",
                 "_empty_rows", "_empty_encoded")

    def __init__(
        self,
        plans: Sequence[StagePlan],
        *,
        feature_dim: int = 0,
        row_bytes: int = 0,
        stage_dtype: Any = np.float32,
        external: bool = False,
    ) -> None:
        """``feature_dim``, ``row_bytes``, ``stage_dtype``: the shapes and dtype of
        :attr:`rows` / :attr:`encoded_rows` for an empty batch, ``(0, D)`` and
        ``(0, row_bytes)``, as a skipped plan's (so shapes never depend on it)."""
        self.plans = list(plans)
        self.external = external
        self._empty_rows = _no_rows(feature_dim, stage_dtype)
        self._empty_encoded = _no_encoded(row_bytes)
        self.seqs = [p.seq for p in self.plans]
        active = [p for p in self.plans if p.skip is None]
        self.skips = {p.seq: p.skip for p in self.plans if p.skip is not None}
        if active:
            self.positions = np.concatenate([p.positions for p in active]).astype(np.int32, copy=False)
            self.row_seq = np.concatenate(
                [np.full(p.n_rows, p.seq, dtype=np.int32) for p in active]
            )
            self.slots = np.concatenate([p.slots for p in active]).astype(np.int64, copy=False)
        else:
            self.positions = np.zeros(0, dtype=np.int32)
            self.row_seq = np.zeros(0, dtype=np.int32)
            self.slots = _no_slots()
        self._rows: np.ndarray | None = None
        self._encoded: np.ndarray | None = None

    def _active(self) -> list[StagePlan]:
        return [p for p in self.plans if p.skip is None]

    @property
    def rows(self) -> np.ndarray:
        """All staged context rows, concatenated in plan order (stage dtype; held mode only)."""
        if self.external:
            raise ValueError(_EXTERNAL_ROWS)
        if self._rows is None:
            parts = [p.rows for p in self.plans]
            self._rows = np.concatenate(parts) if parts else self._empty_rows
        return self._rows

    @property
    def encoded_rows(self) -> np.ndarray:
        """All staged context rows in storage format, concatenated (uint8; held mode only)."""
        if self.external:
            raise ValueError(_EXTERNAL_ROWS)
        if self._encoded is None:
            parts = [p.encoded_rows for p in self.plans]
            self._encoded = np.concatenate(parts) if parts else self._empty_encoded
        return self._encoded

    @property
    def block_positions(self) -> dict[int, np.ndarray]:
        """``{seq: block positions}`` for the sequences with an open round."""
        return {p.seq: p.block_positions for p in self._active()}

    @property
    def crop_from(self) -> dict[int, int]:
        """``{seq: crop_from}`` for the sequences with an open round."""
        return {p.seq: p.crop_from for p in self._active()}

    @property
    def clear_cache(self) -> dict[int, bool]:
        """``{seq: clear_cache}`` for the sequences with an open round."""
        return {p.seq: p.clear_cache for p in self._active()}

    def __len__(self) -> int:
        return len(self.plans)

    def __repr__(self) -> str:
        return f"BatchPlan(seqs={self.seqs}, rows={len(self.positions)}, skips={self.skips})"
