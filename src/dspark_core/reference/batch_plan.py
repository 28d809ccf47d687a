"""The reference's :class:`~dspark_core.stager.stage_plan.BatchPlan`: its per-sequence plans as arrays.

``ReferenceStager.draft_many`` plans each sequence as ``draft`` does (one
:class:`StagePlan` each) and lays the plans out here, field by field, in the
array form the core's batch plan has (CSR rows, per-sequence columns).
:meth:`BatchPlan.padded` lays a plan out with the core's ``pad_rows`` (a
BatchPlan is a value that computes what it derives itself); :func:`pad_rows`
is that layout spelled out again, and the differential tests compare the two
on the same arrays; :func:`paged_rows` is the core's paged layout
(:meth:`BatchPlan.paged`) spelled out the same way.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from ..stager.stage_plan import BatchPlan, StagePlan
from .arguments import SKIP_REASONS, batch_context

__all__ = ["batch_plan", "pad_rows", "paged_rows"]


def pad_rows(seqs: np.ndarray, row_offsets: np.ndarray, values: np.ndarray, max_rows: int, out: np.ndarray) -> None:
    """Rows ``[row_offsets[i], row_offsets[i + 1])`` of ``values`` into ``out[i, :]``, the rest -1.

    ``ValueError`` when the offsets do not rise from 0 to ``len(values)``, or
    (naming the sequence) when a sequence has more than ``max_rows`` rows;
    ``out`` is written only once every sequence fits.
    """
    n, total = len(seqs), len(values)
    cu = [int(v) for v in row_offsets]
    if cu[0] != 0 or cu[n] != total or any(cu[i + 1] < cu[i] for i in range(n)):
        raise ValueError(f"padded: row_offsets must rise from 0 to the {total} rows")
    for i in range(n):
        k = cu[i + 1] - cu[i]
        if k > max_rows:
            raise ValueError(batch_context("padded", i, int(seqs[i])) +
                             f"{k} context rows do not fit max_rows ({max_rows})")
    out[...] = -1
    for i in range(n):
        out[i, : cu[i + 1] - cu[i]] = values[cu[i]: cu[i + 1]]


def paged_rows(seqs: np.ndarray, pos_base: np.ndarray, row_offsets: np.ndarray, positions: np.ndarray,
               block_tables: np.ndarray, block_tokens: int, null_block: int, tables_out: np.ndarray | None,
               slots_out: np.ndarray | None) -> None:
    """Each window's KV blocks: the block table of sequence ``i`` from block ``pos_base[i] //
    block_tokens`` on (``null_block`` past it; all of it for a skipped sequence, ``pos_base <
    0``), and row ``r`` at ``table[p // block_tokens] * block_tokens + p % block_tokens``.

    ``ValueError`` for ``block_tokens < 1``, offsets that do not rise from 0 to
    ``len(positions)``, and (naming the sequence) a skipped sequence with rows or a
    row whose position is negative or past the table; nothing is written then.
    """
    n, total, m = len(seqs), len(positions), block_tables.shape[1]
    if block_tokens < 1:
        raise ValueError(f"paged: block_tokens must be at least 1, got {block_tokens}")
    cu = [int(v) for v in row_offsets]
    if cu[0] != 0 or cu[n] != total or any(cu[i + 1] < cu[i] for i in range(n)):
        raise ValueError(f"paged: row_offsets must rise from 0 to the {total} rows")
    for i in range(n):
        base = int(pos_base[i])
        if base < 0 and cu[i + 1] > cu[i]:
            raise ValueError(batch_context("paged", i, int(seqs[i])) +
                             f"a skipped plan (pos_base {base}) has no rows, got {cu[i + 1] - cu[i]}")
        for r in range(cu[i], cu[i + 1]):
            p = int(positions[r])
            if p < 0 or p // block_tokens >= m:
                raise ValueError(batch_context("paged", i, int(seqs[i])) +
                                 f"drafter position {p} lies outside the {m} blocks of {block_tokens} positions "
                                 "of its block table")
    for i in range(n):
        base = int(pos_base[i])
        table = [int(b) for b in block_tables[i]]
        first = m if base < 0 else base // block_tokens
        shifted = [table[j + first] if j + first < m else null_block for j in range(m)]
        if tables_out is not None:
            tables_out[i, :] = shifted
        if slots_out is not None:
            for r in range(cu[i], cu[i + 1]):
                p = int(positions[r])
                slots_out[r] = shifted[p // block_tokens] * block_tokens + p % block_tokens


def _column(plans: Sequence[StagePlan], field: str, dtype: Any) -> np.ndarray:
    return np.array([getattr(p, field) for p in plans], dtype).reshape(len(plans))


#: The storages whose bytes are a float dtype's (the twin's own statement of the
#: core's ``staged_as_stored``): rows staged in that dtype are a view of them.
_STORED_AS = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}


def _read_only(a: np.ndarray) -> np.ndarray:
    """A read-only view (a zero-copy plan's runs are, as the core's views of its rings)."""
    v = a.view()
    v.flags.writeable = False
    return v


def batch_plan(plans: Sequence[StagePlan], *, block_size: int, feature_dim: int, row_bytes: int, stage_dtype: Any,
               max_plan_rows: int, storage: str, external: bool, source: Any,
               decode: Callable[[np.ndarray], np.ndarray] | None = None, zero_copy: bool = False,
               chain: bool = False) -> BatchPlan:
    """The plans (one per sequence, in request order) as one :class:`BatchPlan`.

    ``decode`` (held mode): the encoded rows of all plans, concatenated, to
    the stage dtype (decoded here, by the twin). ``zero_copy``: the plans are
    ``copy=False`` plans; the batch hands out their runs (and decodes them
    itself when read). ``chain``: the plans carry token ids (a chain drafter's), joined here.
    """
    n_rows = [p.n_rows for p in plans]
    row_offsets = np.zeros(len(plans) + 1, np.int64)
    row_offsets[1:] = np.cumsum(n_rows, dtype=np.int64)
    positions = np.concatenate([np.zeros(0, np.int32), *(p.positions for p in plans)]).astype(np.int32)
    slots = np.concatenate([np.zeros(0, np.int64), *(p.slots for p in plans)]).astype(np.int64)
    enc = decoded = views = None
    if zero_copy:
        views = [tuple(_read_only(r) for r in p.encoded_runs) for p in plans]
    elif not external:
        enc = np.concatenate([np.zeros((0, row_bytes), np.uint8), *(p.encoded_rows for p in plans)])
        decoded = decode(enc) if decode is not None else None
    codes = [0 if p.skip is None else 1 + SKIP_REASONS.index(p.skip) for p in plans]
    return BatchPlan(
        seqs=_column(plans, "seq", np.int64), skip_code=np.array(codes, np.uint8).reshape(len(plans)),
        rebase=_column(plans, "rebase", np.bool_), clear_cache=_column(plans, "clear_cache", np.bool_),
        start=_column(plans, "start", np.int64), pos_base=_column(plans, "pos_base", np.int64),
        crop_from=_column(plans, "crop_from", np.int64), round=_column(plans, "round", np.int64),
        row_offsets=row_offsets, positions=positions, slots=slots, block_size=block_size,
        feature_dim=feature_dim, row_bytes=row_bytes, stage_dtype=stage_dtype, max_plan_rows=max_plan_rows,
        storage=storage, view_rows=_STORED_AS.get(storage) == np.dtype(stage_dtype).name, encoded_rows=enc,
        rows=decoded, external=external, source=source, views=views,
        tokens=np.concatenate([np.zeros(0, np.int32), *(p.tokens for p in plans)]).astype(np.int32) if chain else None,
    )
