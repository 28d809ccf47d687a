"""What ``Stager.draft`` returns: the rows to stage and where to put them.

A :class:`StagePlan` tells the server, for one sequence and one round:

* ``clear_cache``: remove the drafter's whole sequence first;
* ``rows`` at drafter ``positions``: the context rows to decode;
* the block of ``B`` query rows at ``block_positions``;
* ``crop_from``: afterwards remove drafter cache positions ``>= crop_from``.

Positions are *drafter* positions (``abs_pos - pos_base``), always inside
``[0, window)``. A plan with ``skip`` set stages nothing and opens no round.

``encoded_runs`` / ``row_runs`` give the staged rows as they lie in the ring:
one array per run of consecutive slots (at most two). They are slices of the
plan's own copy, or, from ``draft(seq, n_past, copy=False)``, read-only views
of the ring itself (zero-copy; valid until the sequence's rows next change).

Every plan also carries ``slots``: the ring slot of each staged row (int64,
in plan order), in both row modes. In external-row mode
(``StagerConfig(rows="external")``) the Stager holds no rows: the server
reads them from its own table at ``plan.slots`` (``DeviceRing.gather``), and
``plan.rows`` / ``plan.encoded_rows`` raise.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from .._ext import _row_format
from .core_tables import FAIL_STAGES, SKIP_REASONS

__all__ = ["StagePlan", "split_runs", "BatchPlan", "BatchContext", "PaddedRows", "PagedRows", "BATCH_ARRAYS", "SKIP_REASONS", "FAIL_STAGES", "DISABLED_WARNING"]

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


def consecutive_runs(slots: np.ndarray) -> list[tuple[int, int]]:
    """The index ranges ``[a, b)`` of ``slots`` that hold consecutive slots (``s, s + 1, ...``),
    in order: one copy of ``b - a`` rows each (none for no slots)."""
    if len(slots) == 0:
        return []
    gaps = (np.flatnonzero(np.diff(slots) != 1) + 1).tolist()
    return list(zip((0, *gaps), (*gaps, len(slots))))


def split_runs(rows: np.ndarray, slots: np.ndarray) -> tuple[np.ndarray, ...]:
    """``rows`` (one per slot, in plan order) cut where ``slots`` stop being consecutive:
    one slice per run of the ring (at most two; none for no rows)."""
    return tuple(rows[a:b] for a, b in consecutive_runs(slots))


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
        encoded_runs: ``encoded_rows`` as they lie in the ring, one uint8
            ``(n_k, row_bytes)`` array per run of consecutive slots (at most
            two, none when nothing is staged); from ``draft(copy=False)``,
            read-only views of the ring (zero-copy).
        row_runs: the same runs in the stage dtype (views when the storage
            format is the stage dtype, else decoded).
        zero_copy: the plan's runs are views of the ring (``draft(copy=False)``):
            valid until the next call that may change the sequence's rows
            (any call on it but ``commit``, ``fail`` and the read-only ones).
        slots: int64 ``(n,)``: the ring slot of each staged row, in plan order
            (both modes; at most two runs of consecutive slots).
        external: the plan is from an external-row Stager (no rows here).
        source: the Stager that made the plan (external mode; None in held
            mode): whose table ``slots`` index.
        round: the round this plan opened (unique within its Stager, from 1;
            0 for a skipped plan): the plan's ``slots`` may be read while
            ``source.open_round_id(seq) == round`` (``DeviceRing.gather``
            refuses a plan of a round that has closed).
        tokens: a chain drafter's Stager (``kind="chain"``): int32 ``(n,)``,
            the id of the token the target read at each staged row's
            position, kept beside the row (both row modes); None for a block
            drafter's. :meth:`successors` pairs each row with the id after it.
    """

    __slots__ = (
        "seq",
        "start",
        "skip",
        "rebase",
        "clear_cache",
        "_positions",
        "_block_positions",
        "_n_rows",
        "_block_size",
        "crop_from",
        "pos_base",
        "slots",
        "external",
        "source",
        "round",
        "_encoded",
        "_rows",
        "_decode",
        "_runs",
        "_row_runs",
        "zero_copy",
        "tokens",
    )

    def __init__(
        self,
        *,
        seq: int,
        start: int,
        skip: str | None,
        rebase: bool,
        clear_cache: bool,
        positions: np.ndarray | None = None,
        block_positions: np.ndarray | None = None,
        crop_from: int,
        pos_base: int,
        encoded_rows: np.ndarray | None,
        rows: np.ndarray | None = None,
        decode: _Decoder | None = None,
        slots: np.ndarray | None = None,
        external: bool = False,
        source: Any = None,
        round: int = 0,
        encoded_runs: tuple[np.ndarray, ...] | None = None,
        n_rows: int | None = None,
        block_size: int | None = None,
        tokens: np.ndarray | None = None,
    ) -> None:
        """The fields the class docstring names. ``positions`` / ``block_positions`` may be
        left out for ``n_rows`` / ``block_size``: they are then made from ``crop_from`` on
        first access (``crop_from - n_rows + k`` and ``crop_from + k``), which a plan the
        caller never asks them of does not pay for."""
        if (positions is None) != (n_rows is not None) or (block_positions is None) != (block_size is not None):
            raise TypeError("StagePlan: give positions or n_rows, and block_positions or block_size")
        self.seq = seq
        self.start = start
        self.skip = skip
        self.rebase = rebase
        self.clear_cache = clear_cache
        self._positions = positions
        self._n_rows = int(positions.shape[0]) if positions is not None else int(n_rows)  # type: ignore[arg-type]
        self._block_positions = block_positions
        self._block_size = block_size
        self.crop_from = crop_from
        self.pos_base = pos_base
        self.slots = _no_slots() if slots is None else slots
        self.external = external
        self.source = source
        self.round = round
        self._encoded = encoded_rows
        self._rows = rows
        self._decode = decode
        # Given (views of the ring): encoded_rows / rows derive from them;
        # otherwise they are cut from encoded_rows / rows on first access.
        self._runs = encoded_runs
        self._row_runs: tuple[np.ndarray, ...] | None = None
        self.zero_copy = encoded_runs is not None
        self.tokens = tokens

    def successors(self, next_token: int) -> np.ndarray:
        """What a chain drafter (EAGLE-3, EAGLE, MTP) consumes beside each staged row: the
        id of the token after it, int32 ``(n,)``. That is ``tokens[1:]``, then ``next_token``
        for the newest row: the token this round drafts from (sampled at ``start``, not
        yet processed). Raises ValueError for a block drafter's plan (no tokens kept) or
        a ``next_token`` outside ``[0, 2**31)``."""
        if self.tokens is None:
            raise ValueError("successors: this plan is from a block drafter's Stager, which keeps no token ids "
                             "(StagerConfig(kind='chain') keeps them)")
        t = operator.index(next_token)
        if not 0 <= t < 2**31:
            raise ValueError(f"successors: next_token must be a token id in [0, 2**31), got {t}")
        out = np.empty(len(self.tokens), np.int32)
        out[:-1] = self.tokens[1:]
        if len(out):
            out[-1] = t
        return out

    @classmethod
    def skipped(cls, seq: int, start: int, reason: str, *, feature_dim: int, row_bytes: int,
                stage_dtype: np.dtype, external: bool = False, chain: bool = False) -> "StagePlan":
        """A plan that stages nothing and opens no round (``skip = reason``); ``chain``:
        a chain drafter's (no tokens, rather than none kept)."""
        return cls(
            seq=seq, start=start, skip=reason, rebase=False, clear_cache=False,
            positions=np.zeros(0, np.int32), block_positions=np.zeros(0, np.int32),
            crop_from=-1, pos_base=-1, encoded_rows=None if external else _no_encoded(row_bytes),
            rows=None if external else _no_rows(feature_dim, stage_dtype), external=external,
            tokens=np.zeros(0, np.int32) if chain else None,
        )

    @property
    def encoded_rows(self) -> np.ndarray:
        """The staged rows in storage format, uint8 ``(n, row_bytes)`` (held mode only).

        Of a zero-copy plan: its one run (a view), or the runs joined (a
        read-only copy, made on first access) when the rows wrap the ring.
        """
        if self.external:
            raise ValueError(_EXTERNAL_ROWS)
        if self._encoded is None:
            runs = self._runs
            assert runs, "a plan with no rows carries its empty encoded_rows"
            if len(runs) == 1:
                self._encoded = runs[0]
            else:
                self._encoded = np.concatenate(runs)
                self._encoded.flags.writeable = False
        return self._encoded

    @property
    def encoded_runs(self) -> tuple[np.ndarray, ...]:
        """``encoded_rows`` as they lie in the ring: one array per run of consecutive
        slots (views of the ring for a zero-copy plan). Held mode only."""
        if self.external:
            raise ValueError(_EXTERNAL_ROWS)
        if self._runs is None:
            self._runs = split_runs(self.encoded_rows, self.slots)
        return self._runs

    @property
    def row_runs(self) -> tuple[np.ndarray, ...]:
        """``rows`` as they lie in the ring, one ``(n_k, feature_dim)`` array per run:
        free views when the storage format is the stage dtype (of the ring
        itself for a zero-copy plan), else decoded run by run. Held mode only."""
        if self._row_runs is None:
            if self.zero_copy:
                assert self._decode is not None
                self._row_runs = tuple(self._decode(r) for r in self.encoded_runs)
            else:
                self._row_runs = split_runs(self.rows, self.slots)
        return self._row_runs

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
            if not self.zero_copy:  # row_runs still decodes from the runs
                self._decode = None
        return self._rows

    @property
    def positions(self) -> np.ndarray:
        """int32 drafter positions of ``rows``: ``[crop_from - n_rows, crop_from)``."""
        if self._positions is None:
            self._positions = np.arange(self.crop_from - self._n_rows, self.crop_from, dtype=np.int32)
        return self._positions

    @property
    def block_positions(self) -> np.ndarray:
        """int32 drafter positions of the ``B`` block rows: ``[crop_from, crop_from + B)``."""
        if self._block_positions is None:
            assert self._block_size is not None
            self._block_positions = np.arange(self.crop_from, self.crop_from + self._block_size, dtype=np.int32)
        return self._block_positions

    @property
    def n_rows(self) -> int:
        """Number of context rows staged (excluding the block)."""
        return self._n_rows

    @property
    def first_row(self) -> int:
        """Absolute position of the first staged context row (``start - n_rows``; ``start``
        when nothing is staged): the core plan's ``first_row``."""
        return self.start - self._n_rows

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


class PagedRows(NamedTuple):
    """A batch's context rows in a paged KV cache (:meth:`BatchPlan.paged`)."""

    block_tables: np.ndarray  # int32 (N, M): each sequence's blocks from its window's first
    slots: np.ndarray  # int64, one per context row: where its KV goes


class PaddedRows(NamedTuple):
    """A batch's context rows in a fixed shape ``(N, max_rows)`` (:meth:`BatchPlan.padded`).

    Row ``r`` of the ``i``-th sequence of the batch is at ``[i, r]``; every
    other entry is ``-1`` (padding: a gather skips it). The shape depends
    only on the batch size and ``max_rows``, so it stays the same from step to
    step, as a CUDA graph's inputs must.
    """

    positions: np.ndarray  # int32 drafter positions
    slots: np.ndarray  # int64 global slots


#: A zero-copy batch's rows: ``views[i]``, the runs of its ``i``-th sequence.
_Runs = Sequence["tuple[np.ndarray, ...]"]

#: Where each per-sequence array lies in a packed plan's two arrays (the core's
#: batch layout, pack_plans): row of ``meta`` (int64) / of ``flags`` (uint8).
_META_ROW = {name: k for k, name in enumerate(_row_format.BATCH_META_ROWS)}
_FLAG_ROW = {name: k for k, name in enumerate(_row_format.BATCH_FLAG_ROWS)}


#: A :class:`BatchPlan`'s arrays (per sequence, then per context row): what two
#: batches that plan the same rounds agree on, dtype and shape included.
BATCH_ARRAYS = ("seqs", "skip_code", "active", "rebase", "clear_cache", "start", "pos_base", "crop_from", "round",
                "n_rows", "block_positions", "row_offsets", "positions", "slots", "row_seq")


class BatchContext(NamedTuple):
    """What every :class:`BatchPlan` of one Stager shares (its maker builds it once): values only."""

    block_size: int
    feature_dim: int
    row_bytes: int
    stage_dtype: Any
    max_plan_rows: int
    storage: str  #: how the rows are stored (held mode: what ``rows`` decodes from)
    view_rows: bool  #: the stored bytes are the stage dtype's (the core's ``staged_as_stored``)
    external: bool
    source: Any


class BatchPlan:
    """One drafter batch for several sequences (``draft_many``), as arrays.

    Per sequence, aligned with :attr:`seqs` (request order, skipped sequences
    included; ``N = len(seqs)``):

    * ``seqs`` int64: the sequence ids;
    * ``skip_code`` uint8: 0 when the sequence's round opened, else
      ``1 + SKIP_REASONS.index(reason)``; ``active`` (bool) is ``skip_code == 0``;
    * ``rebase``, ``clear_cache`` bool;
    * ``start`` int64 (the ``n_past`` planned at), ``pos_base`` int64 (-1 when
      skipped), ``crop_from`` int64 (-1 when skipped), ``round`` int64 (0 when
      skipped), ``n_rows`` int64 (context rows);
    * ``block_positions`` int32 ``(N, B)``: the block's drafter positions
      (``crop_from + k``; -1 when skipped).

    The context rows of every sequence, concatenated in request order (CSR):
    the rows of ``seqs[i]`` are ``[row_offsets[i], row_offsets[i + 1])``:

    * ``row_offsets`` int64 ``(N + 1,)`` (the ``cu_seqlens`` of the context rows);
    * ``positions`` int32 drafter positions, ``slots`` int64 ring slots,
      ``row_seq`` int64 the sequence of each row;
    * ``rows`` / ``encoded_rows`` (held mode only): ``(total, feature_dim)``
      in the stage dtype / ``(total, row_bytes)`` uint8;
    * ``encoded_runs`` / ``row_runs`` (held mode only): the same rows as they
      lie in the rings, one array per run of consecutive slots (at most two
      per sequence), with ``run_offsets`` int64 ``(N + 1,)``: the runs of
      ``seqs[i]`` are ``encoded_runs[run_offsets[i]:run_offsets[i + 1]]``;
    * ``tokens`` int32 (a chain drafter's Stager; None for a block drafter's):
      the token id kept beside each row, as :attr:`StagePlan.tokens`.

    ``draft_many(seqs, n_pasts, copy=False)`` (held mode) copies no row:
    ``zero_copy`` is then true and ``encoded_runs`` / ``row_runs`` are
    read-only views of the rings (each sequence's valid until the next call
    that may change its rows, as ``draft(copy=False)``'s); ``encoded_rows`` /
    ``rows`` are the runs joined, a read-only copy made on first access.

    :meth:`padded` gives the same rows in a fixed shape ``(N, max_rows)`` for
    CUDA graphs. For scripting, :attr:`plans` (one :class:`StagePlan` per
    sequence, what ``draft`` would have returned), :meth:`plan` (by sequence
    id) and :attr:`skips` (``{seq: reason}``) are built on first use and kept.

    A value: it holds arrays and calls nothing of its maker. What it derives
    (the padded layout, decoded rows) it computes from its own arrays with the
    core's layout and format kernels (``_ext._row_format``), as it uses numpy.
    """

    # No __slots__: an attribute a plan never set reads the class default
    # below (None), so a packed plan sets seven attributes and nothing else
    # (draft_many of one sequence must cost no more than a draft).
    _meta: np.ndarray | None = None
    _flags: np.ndarray | None = None
    _seqs: np.ndarray | None = None
    _skip_code: np.ndarray | None = None
    _rebase: np.ndarray | None = None
    _clear_cache: np.ndarray | None = None
    _start: np.ndarray | None = None
    _pos_base: np.ndarray | None = None
    _crop_from: np.ndarray | None = None
    _round: np.ndarray | None = None
    _row_offsets: np.ndarray | None = None
    _encoded: np.ndarray | None = None
    _rows: np.ndarray | None = None
    _plans: list[StagePlan] | None = None
    _index: dict[int, int] | None = None
    _skips: dict[int, str] | None = None
    _block_positions: np.ndarray | None = None
    _row_seq: np.ndarray | None = None
    _active: np.ndarray | None = None
    _n_rows: np.ndarray | None = None
    _views: "_Runs | None" = None  # zero-copy: the runs of sequence i, by index
    _runs: tuple[np.ndarray, ...] | None = None
    _row_runs: tuple[np.ndarray, ...] | None = None
    _run_offsets: np.ndarray | None = None
    tokens: np.ndarray | None = None

    def __init__(
        self,
        *,
        seqs: np.ndarray,
        skip_code: np.ndarray,
        rebase: np.ndarray,
        clear_cache: np.ndarray,
        start: np.ndarray,
        pos_base: np.ndarray,
        crop_from: np.ndarray,
        round: np.ndarray,
        row_offsets: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        block_size: int,
        feature_dim: int,
        row_bytes: int,
        stage_dtype: Any,
        max_plan_rows: int,
        storage: str,
        view_rows: bool,
        encoded_rows: np.ndarray | None = None,
        rows: np.ndarray | None = None,
        external: bool = False,
        source: Any = None,
        views: _Runs | None = None,
        tokens: np.ndarray | None = None,
    ) -> None:
        """Arrays as the class docstring names them (what the reference twin makes).

        ``encoded_rows`` (held mode): the rows in storage format (``storage``);
        ``rows``: the same rows decoded, or None to decode them on first access
        (a view when ``view_rows``: the stored bytes are the stage dtype's).
        ``views`` (a zero-copy plan, held mode; ``encoded_rows`` then None):
        ``views[i]`` is the runs of the ``i``-th sequence.
        ``max_plan_rows``: the most context rows one plan stages (``W - B``),
        :meth:`padded`'s default width.
        """
        self._ctx = BatchContext(block_size, feature_dim, row_bytes, stage_dtype, max_plan_rows, storage, view_rows,
                                 external, source)
        self._seqs = seqs
        self._skip_code = skip_code
        self._rebase = rebase
        self._clear_cache = clear_cache
        self._start = start
        self._pos_base = pos_base
        self._crop_from = crop_from
        self._round = round
        self._row_offsets = row_offsets
        self.positions = positions
        self.slots = slots
        self._encoded = encoded_rows
        self._rows = rows
        self._views = views
        self.tokens = tokens

    @classmethod
    def packed(cls, ctx: BatchContext, meta: np.ndarray, flags: np.ndarray, positions: np.ndarray,
               slots: np.ndarray, encoded_rows: np.ndarray | None, views: _Runs | None = None,
               tokens: np.ndarray | None = None) -> "BatchPlan":
        """A plan over the arrays the core filled in one pass (``draft_many``, the core's
        ``pack_plans``).

        ``meta``: int64 ``(len(BATCH_META_ROWS), N + 1)``, rows named by the
        core's ``BATCH_META_ROWS`` (``seqs``, ``start``, ``pos_base``,
        ``crop_from``, ``round`` in the first ``N`` columns, then
        ``row_offsets``); ``flags``: uint8 ``(len(BATCH_FLAG_ROWS), N)``, rows
        ``skip_code``, ``rebase``, ``clear_cache``. The per-sequence arrays are
        views of these rows, taken on first access. ``views``: as for the
        constructor. ``tokens``: the flat token ids (a chain drafter's Stager).
        """
        self = cls.__new__(cls)
        self._ctx = ctx
        self._meta = meta
        self._flags = flags
        self.positions = positions
        self.slots = slots
        self._encoded = encoded_rows
        self._views = views
        if tokens is not None:
            self.tokens = tokens
        return self

    # -- what every plan of its Stager shares -------------------------------
    @property
    def block_size(self) -> int:
        return self._ctx.block_size

    @property
    def feature_dim(self) -> int:
        return self._ctx.feature_dim

    @property
    def row_bytes(self) -> int:
        return self._ctx.row_bytes

    @property
    def stage_dtype(self) -> Any:
        return self._ctx.stage_dtype

    @property
    def max_plan_rows(self) -> int:
        return self._ctx.max_plan_rows

    @property
    def external(self) -> bool:
        return self._ctx.external

    @property
    def source(self) -> Any:
        return self._ctx.source

    # -- the per-sequence arrays (views of a packed plan's rows, taken once) --
    def _meta_row(self, name: str) -> np.ndarray:
        assert self._meta is not None
        k = _META_ROW[name]
        return self._meta[k] if name == "row_offsets" else self._meta[k, :self._meta.shape[1] - 1]

    def _flag_row(self, name: str) -> np.ndarray:
        assert self._flags is not None
        return self._flags[_FLAG_ROW[name]]

    @property
    def seqs(self) -> np.ndarray:
        if self._seqs is None:
            self._seqs = self._meta_row("seqs")
        return self._seqs

    @property
    def start(self) -> np.ndarray:
        if self._start is None:
            self._start = self._meta_row("start")
        return self._start

    @property
    def pos_base(self) -> np.ndarray:
        if self._pos_base is None:
            self._pos_base = self._meta_row("pos_base")
        return self._pos_base

    @property
    def crop_from(self) -> np.ndarray:
        if self._crop_from is None:
            self._crop_from = self._meta_row("crop_from")
        return self._crop_from

    @property
    def round(self) -> np.ndarray:
        if self._round is None:
            self._round = self._meta_row("round")
        return self._round

    @property
    def row_offsets(self) -> np.ndarray:
        if self._row_offsets is None:
            self._row_offsets = self._meta_row("row_offsets")
        return self._row_offsets

    @property
    def skip_code(self) -> np.ndarray:
        if self._skip_code is None:
            self._skip_code = self._flag_row("skip_code")
        return self._skip_code

    @property
    def rebase(self) -> np.ndarray:
        if self._rebase is None:
            self._rebase = self._flag_row("rebase").view(np.bool_)
        return self._rebase

    @property
    def clear_cache(self) -> np.ndarray:
        if self._clear_cache is None:
            self._clear_cache = self._flag_row("clear_cache").view(np.bool_)
        return self._clear_cache

    # -- derived arrays (computed once) -------------------------------------
    @property
    def active(self) -> np.ndarray:
        """bool ``(N,)``: the sequences whose round opened (not skipped)."""
        if self._active is None:
            self._active = self.skip_code == 0
        return self._active

    @property
    def n_rows(self) -> np.ndarray:
        """int64 ``(N,)``: context rows staged per sequence (``np.diff(row_offsets)``)."""
        if self._n_rows is None:
            self._n_rows = np.diff(self.row_offsets)
        return self._n_rows

    @property
    def block_positions(self) -> np.ndarray:
        """int32 ``(N, B)``: the drafter positions of each sequence's block (-1 when skipped)."""
        if self._block_positions is None:
            bp = self.crop_from.astype(np.int32)[:, None] + np.arange(self.block_size, dtype=np.int32)
            bp[~self.active] = -1
            self._block_positions = bp
        return self._block_positions

    @property
    def row_seq(self) -> np.ndarray:
        """int64 ``(total,)``: the sequence id of each context row."""
        if self._row_seq is None:
            self._row_seq = np.repeat(self.seqs, self.n_rows)
        return self._row_seq

    @property
    def zero_copy(self) -> bool:
        """The plan's runs are views of the rings (``draft_many(..., copy=False)``)."""
        return self._views is not None

    @property
    def encoded_rows(self) -> np.ndarray:
        """All staged context rows in storage format, uint8 ``(total, row_bytes)`` (held mode only).

        Of a zero-copy plan: its runs joined (a read-only copy, made on first access).
        """
        if self.external:
            raise ValueError(_EXTERNAL_ROWS)
        if self._encoded is None:
            runs = self.encoded_runs
            self._encoded = np.concatenate(runs) if runs else _no_encoded(self.row_bytes)
            self._encoded.flags.writeable = False
        return self._encoded

    @property
    def rows(self) -> np.ndarray:
        """All staged context rows, ``(total, feature_dim)`` in the stage dtype (held mode only)."""
        if self.external:
            raise ValueError(_EXTERNAL_ROWS)
        if self._rows is None:
            self._rows = self._as_rows(self.encoded_rows)
        return self._rows

    def _as_rows(self, enc: np.ndarray) -> np.ndarray:
        """Encoded rows in the stage dtype, read-only (a plan's rows are what was staged, never
        a buffer to write in): a view when the storage format is the stage dtype, else decoded
        by the core's format kernel."""
        if self._ctx.view_rows:
            rows = enc.view(self.stage_dtype).reshape(len(enc), self.feature_dim)
        else:
            rows = _row_format.decode(np.ascontiguousarray(enc), self._ctx.storage, self.feature_dim,
                                      self.stage_dtype)
        rows.flags.writeable = False
        return rows

    def _runs_at(self, i: int) -> tuple[np.ndarray, ...]:
        """The runs of the ``i``-th sequence: its views, or its rows cut where its slots break."""
        if self._views is not None:
            return self._views[i]
        a, b = int(self.row_offsets[i]), int(self.row_offsets[i + 1])
        return split_runs(self.encoded_rows[a:b], self.slots[a:b])

    @property
    def encoded_runs(self) -> tuple[np.ndarray, ...]:
        """The staged rows as they lie in the rings: one uint8 ``(n_k, row_bytes)`` array per run
        of consecutive slots, sequence after sequence (views of the rings for a zero-copy plan;
        held mode only). The runs of ``seqs[i]``: ``[run_offsets[i], run_offsets[i + 1])``."""
        if self.external:
            raise ValueError(_EXTERNAL_ROWS)
        if self._runs is None:
            per_seq = [self._runs_at(i) for i in range(len(self.seqs))]
            offsets = np.zeros(len(per_seq) + 1, np.int64)
            offsets[1:] = np.cumsum([len(r) for r in per_seq])
            self._runs = tuple(r for runs in per_seq for r in runs)
            self._run_offsets = offsets
        return self._runs

    @property
    def run_offsets(self) -> np.ndarray:
        """int64 ``(N + 1,)``: where each sequence's runs start in :attr:`encoded_runs` (held mode only)."""
        self.encoded_runs  # noqa: B018 - computes both
        assert self._run_offsets is not None
        return self._run_offsets

    @property
    def row_runs(self) -> tuple[np.ndarray, ...]:
        """:attr:`encoded_runs` in the stage dtype: views when the storage format is the stage
        dtype (of the rings themselves for a zero-copy plan), else decoded run by run."""
        if self._row_runs is None:
            self._row_runs = tuple(self._as_rows(r) for r in self.encoded_runs)
        return self._row_runs

    # -- the fixed shape of a CUDA graph ------------------------------------
    def padded(self, max_rows: int | None = None, *, positions_out: np.ndarray | None = None,
               slots_out: np.ndarray | None = None) -> PaddedRows:
        """The context rows as ``(N, max_rows)`` arrays, padding ``-1`` (:class:`PaddedRows`).

        ``max_rows`` (default :attr:`max_plan_rows`, ``W - B``: every plan
        fits) fixes the shape; a plan with more rows raises ``ValueError``
        naming its sequence (a server that pads to a small width runs the
        rare large rounds, rebases, outside its graph). ``positions_out``
        (int32) / ``slots_out`` (int64), C-contiguous ``(N, max_rows)``: write
        into these (a graph's fixed input buffers) instead of new arrays.
        """
        m = self.max_plan_rows if max_rows is None else max_rows
        if not isinstance(m, (int, np.integer)) or isinstance(m, bool) or m < 0:
            raise ValueError(f"padded: max_rows must be an integer >= 0, got {max_rows!r}")
        shape = (len(self.seqs), int(m))
        pos = _padded_out(positions_out, shape, np.int32, "positions_out")
        slots = _padded_out(slots_out, shape, np.int64, "slots_out")
        _row_format.pad_rows(self.seqs, self.row_offsets, self.positions, int(m), pos)
        _row_format.pad_rows(self.seqs, self.row_offsets, self.slots, int(m), slots)
        return PaddedRows(pos, slots)

    def paged(self, block_tables: Any, block_tokens: int, *, null_block: int = 0,
              tables_out: np.ndarray | None = None, slots_out: np.ndarray | None = None) -> PagedRows:
        """Where the context rows' KV lives in a paged KV cache (vLLM's, SGLang's): :class:`PagedRows`.

        A windowed drafter keeps drafter position ``p`` of sequence ``i`` in the
        request's own blocks from its window's start: ``block_tables[i]`` (int32
        ``(N, M)``, the request's KV blocks of ``block_tokens`` positions each)
        shifted left by ``pos_base[i] // block_tokens`` columns, the columns
        past the table reading ``null_block`` (every column of a skipped
        sequence's), and each context row at slot ``shifted[i, p // block_tokens]
        * block_tokens + p % block_tokens``. The drafter's attention then reads
        only its window. ``tables_out`` (int32 ``(N, M)``) / ``slots_out`` (int64,
        one per context row): write into these instead of new arrays. Raises
        ``ValueError`` naming the sequence when a row's block lies past its table
        (nothing written).
        """
        n = len(self.seqs)
        bt = np.asarray(block_tables)
        shape = (n, int(bt.shape[1]) if bt.ndim == 2 else 0)
        tables = np.empty(shape, np.int32) if tables_out is None else tables_out
        slots = np.empty(len(self.positions), np.int64) if slots_out is None else slots_out
        _row_format.paged_rows(self.seqs, self.pos_base, self.row_offsets, self.positions, bt, int(block_tokens),
                               int(null_block), tables, slots)
        return PagedRows(tables, slots)

    # -- the per-sequence view (scripting) ----------------------------------
    def successors(self, lasts: Any) -> np.ndarray:
        """:meth:`StagePlan.successors` for the whole batch in one array: int32, flat as the
        context rows (``row_offsets``): for sequence ``i``'s rows, the id after each row, its
        newest row's being ``lasts[i]`` (the token its round drafts from). ``lasts``: one id
        per sequence of the batch (a skipped sequence's is not read: it has no rows). Raises
        ValueError for a block drafter's plan (no tokens kept), a ``lasts`` of another
        length, or an id outside ``[0, 2**31)`` where it is read."""
        if self.tokens is None:
            raise ValueError("successors: this plan is from a block drafter's Stager, which keeps no token ids "
                             "(StagerConfig(kind='chain') keeps them)")
        last = np.asarray(lasts)
        if last.ndim != 1 or last.shape[0] != len(self.seqs):
            raise ValueError(f"successors: {len(self.seqs)} sequences for lasts of shape {last.shape}")
        if last.size and last.dtype.kind not in "iu":
            raise TypeError(f"successors: lasts must be token ids (integers), got dtype {last.dtype}")
        offsets = self.row_offsets
        newest = offsets[1:] - 1
        has_rows = offsets[1:] > offsets[:-1]
        given = last[has_rows].astype(np.int64)
        bad = np.flatnonzero((given < 0) | (given >= 2**31))
        if bad.size:
            i = int(np.flatnonzero(has_rows)[bad[0]])
            raise ValueError(f"successors: lasts[{i}] must be a token id in [0, 2**31), got {int(last[i])}")
        out = np.empty(len(self.tokens), np.int32)
        out[:-1] = self.tokens[1:]
        out[newest[has_rows]] = given  # each sequence's newest row: its own next token, never the next sequence's
        return out

    @property
    def plans(self) -> list[StagePlan]:
        """One :class:`StagePlan` per sequence, in request order (built on first access)."""
        if self._plans is None:
            self._plans = [self._plan_at(i) for i in range(len(self.seqs))]
        return self._plans

    def plan(self, seq: int) -> StagePlan:
        """The :class:`StagePlan` of sequence ``seq`` (``KeyError`` if it is not in the batch)."""
        if self._index is None:
            self._index = {int(s): i for i, s in enumerate(self.seqs.tolist())}
        return self.plans[self._index[int(seq)]]

    @property
    def skips(self) -> dict[int, str]:
        """``{seq: reason}`` for the skipped sequences."""
        if self._skips is None:
            codes = self.skip_code.tolist()
            self._skips = {int(s): SKIP_REASONS[c - 1] for s, c in zip(self.seqs.tolist(), codes) if c}
        return self._skips

    def _plan_at(self, i: int) -> StagePlan:
        seq, start = int(self.seqs[i]), int(self.start[i])
        code = int(self.skip_code[i])
        if code:
            return StagePlan.skipped(seq, start, SKIP_REASONS[code - 1], feature_dim=self.feature_dim,
                                     row_bytes=self.row_bytes, stage_dtype=self.stage_dtype, external=self.external,
                                     chain=self.tokens is not None)
        a, b = int(self.row_offsets[i]), int(self.row_offsets[i + 1])
        crop = int(self.crop_from[i])
        enc = rows = runs = None
        decode: _Decoder | None = None
        if self._views is not None:  # zero-copy: the sequence's own views
            runs = self._views[i]
            decode = self._as_rows
            if not runs:  # nothing staged: no run to view
                enc = _no_encoded(self.row_bytes)
        elif not self.external:
            enc = self.encoded_rows[a:b]
            if self._rows is not None:
                rows = self._rows[a:b]
            elif self._ctx.view_rows:
                rows = self._as_rows(enc)  # a view: nothing to decode
            else:
                decode = self._as_rows
        return StagePlan(
            seq=seq, start=start, skip=None, rebase=bool(self.rebase[i]), clear_cache=bool(self.clear_cache[i]),
            positions=self.positions[a:b], block_size=self.block_size,
            crop_from=crop, pos_base=int(self.pos_base[i]), encoded_rows=enc, rows=rows, decode=decode,
            slots=self.slots[a:b], external=self.external, source=self.source, round=int(self.round[i]),
            encoded_runs=runs, tokens=None if self.tokens is None else self.tokens[a:b],
        )

    def __len__(self) -> int:
        return len(self.seqs)

    def __repr__(self) -> str:
        return f"BatchPlan(seqs={self.seqs.tolist()}, rows={len(self.positions)}, skips={self.skips})"


def _padded_out(out: np.ndarray | None, shape: tuple[int, int], dtype: Any, name: str) -> np.ndarray:
    if out is None:
        return np.empty(shape, dtype)
    if not isinstance(out, np.ndarray) or out.dtype != dtype or out.shape != shape or not out.flags.c_contiguous \
            or not out.flags.writeable:
        raise ValueError(f"padded: {name} must be a writable C-contiguous {np.dtype(dtype)} array of shape {shape}")
    return out
