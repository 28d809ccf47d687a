"""Stage 3: offline evaluation over the held-out captures, through the C++ Stager's plans.

For each document, mode and drafter the evaluation walks the document as a
speculative loop whose target accepts every row: from position 1 on, every
``STRIDE`` positions a round is planned by the Stager (``draft``), the drafter runs
on the plan's rows at the plan's positions (its cache cleared, cropped and
committed as the protocol says), the next ``STRIDE`` captured rows are processed
and accepted. Every staged row is checked bit for bit against the captured row of
its absolute position (f32 storage).

Recorded per round: the depth (``start``, the target position the round drafts
after) and, per draft, whether it equals the target's greedy label there (block
row ``k``: the label after ``start + k``). Teacher-forced on the document's text:
a draft past the first is scored against the target's greedy token on the real
prefix, which is the live loop's label wherever the text followed the target's
greedy choice.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from capture import Captured
from modes import Mode

__all__ = ["OfflineResult", "evaluate", "STRIDE"]

log = logging.getLogger("real_drafter")

#: Positions a round advances by: 16 rounds per depth bucket of T = 256 positions per document
#: (the rows between two rounds are processed as final rows, as after plain decodes).
STRIDE = 16


class StagedRowMismatch(AssertionError):
    """A staged row differed from the captured row of its position."""


@dataclass
class OfflineResult:
    """One (document, mode, drafter) walk: ``depth`` ``(R,)``, ``match`` bool ``(R, B)``, timings."""

    doc: str
    depth: np.ndarray
    match: np.ndarray
    rows_checked: int
    rebases: int
    drafter_s: float
    rounds: int
    max_position: int


def evaluate(cap: Captured, runtime: Any, mode: Mode, T: int, n_max: int) -> OfflineResult:
    """Walk ``cap`` with ``runtime`` under ``mode`` (see the module docstring)."""
    from dspark_core import Stager, StagerConfig

    kind = runtime.kind
    B = runtime.block_size
    W = mode.window(T, n_max, B)
    st = Stager(StagerConfig(cap.rows.shape[1], B, W, storage="f32", kind=kind))
    rows = np.asarray(cap.rows)
    toks = cap.tokens
    n = len(toks)
    st.begin(0)
    chain = kind == "chain"

    def process(lo: int, hi: int) -> None:
        kw = {"tokens": toks[lo:hi]} if chain else {}
        st.process(0, np.arange(lo, hi, dtype=np.int64), rows[lo:hi], **kw)

    process(0, 1)
    depth, match = [], []
    checked = 0
    runtime.drafter_s = 0.0
    runtime.max_position = -1
    s = 1
    while s + B <= n:
        plan = st.draft(0, s)
        assert plan.skip is None, f"round at {s} skipped: {plan.skip}"
        pos = np.asarray(plan.positions, np.int64)
        base = int(plan.pos_base)
        staged = np.asarray(plan.rows)
        if not np.array_equal(staged.view(np.uint32), rows[base + pos].view(np.uint32)):
            raise StagedRowMismatch(f"{cap.name}: a staged row at {s} differs from the captured row")
        checked += len(pos)
        runtime.position_offset = base if mode.absolute_positions else 0
        if plan.clear_cache:
            runtime.clear(0)
        last = int(toks[s])
        if chain:
            draft = runtime.decode_chain(0, pos, staged, plan.successors(last), plan.block_positions)
        else:
            block = [last] + [runtime.mask_token_id] * (B - 1)
            draft = runtime.decode(0, pos, staged, block, plan.block_positions)
        runtime.crop(0, int(plan.crop_from))
        st.commit(0)
        depth.append(s)
        match.append(np.asarray(draft) == cap.labels[s : s + B])
        hi = min(n, s + STRIDE)
        process(s, hi)
        st.accept(0, min(B, hi - s - 1))  # a no-op past B + 1 rows: they are final
        s = hi
    return OfflineResult(cap.name, np.asarray(depth, np.int32), np.asarray(match, bool), checked,
                         int(st.stats(0)["rebases"]), runtime.drafter_s, len(depth), runtime.max_position)
