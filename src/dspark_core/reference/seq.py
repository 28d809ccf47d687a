"""One sequence of the reference twin (:class:`_Seq`), the counters it keeps and what a
call needs of its state: the data :mod:`.stager` and its mixins (:mod:`.device_step`,
:mod:`.tree`) and :mod:`.prefix_store` share, in a module that imports none of them.
The rules that change it are :class:`.stager.ReferenceStager`'s."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .ring import RingModel

__all__ = ["ANY", "OPEN", "READY", "RESERVED", "SEMANTIC_STATS", "TREE", "_Seq"]

#: Counters both the core and the reference keep (``stats``), equal after every call.
SEMANTIC_STATS = (
    "rounds", "commits", "failures", "rebases", "staged_rows", "restaged_rows", "skips",
    "skips_disabled", "skips_empty", "skips_no_context", "skips_missing_rows", "skips_drafting_off",
    "verified_rounds", "accepted_tokens", "trims", "trimmed_rows", "rows", "peak_rows", "live_rows",
)


@dataclass
class _Seq:
    started: bool = False
    end: int = 0
    horizon: int = 0
    n_cache: int = 0
    pos_base: int = 0
    restage_owed: bool = False
    first_round: bool = True
    disabled: bool = False
    failures: int = 0
    accept_open: bool = False
    tentative: int = 0
    open_round: tuple[int, int] | None = None  # (start, base)
    round: int = 0  # the open round's id (plan.round)
    rows: dict[int, np.ndarray] = field(default_factory=dict)  # abs position -> encoded row (uint8)
    # A chain drafter's: abs position -> the token id kept beside its row (both row modes).
    tokens: dict[int, int] = field(default_factory=dict)
    head: int = 0  # the core's ring head: it holds [head, end) (bookkeeping only)
    stats: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SEMANTIC_STATS[:-1], 0))
    ring: RingModel = field(default_factory=lambda: RingModel(0))  # replaced by the Stager's
    # A reservation (reserve .. confirm / cancel): the whole sequence as it was
    # before it, which cancel puts back; None when there is none.
    reservation: _Seq | None = None
    # The request's drafting switch (disable / enable); cancel keeps the current one.
    drafting_off: bool = False
    # A committed round whose verify count has not come: the next accept that acts
    # counts it in ``accepted`` (k accepted drafts at [k]; sized by the Stager).
    verify_owed: bool = False
    accepted: list[int] = field(default_factory=list)
    # An open tree verify batch (process_tree .. accept_path): its nodes' parents.
    # Its rows are the tentative ones, the root at end - tentative (tree.py).
    tree: list[int] | None = None


#: What a call needs of its sequence's state: no open round, no reservation and
#: no tree verify batch (every call but the ones below), an open round (commit,
#: fail), a reservation (confirm, cancel), nothing (end), or a tree verify
#: batch (accept_path).
READY, OPEN, RESERVED, ANY, TREE = "ready", "open", "reserved", "any", "tree"
