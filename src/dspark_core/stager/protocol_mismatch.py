"""Loud protocol mismatches: how a server whose ``n_past`` disagrees with its buffered rows is told.

``draft(seq, n_past)`` on a sequence that holds rows (and is not disabled)
is out of protocol when ``n_past`` is not the sequence's buffered end (its
newest row + 1): the server forgot ``accept()`` after a verify batch (the
rejected rows are still buffered), a ``rollback()`` after its target rolled
back, or a ``process()`` of some target decode. The skip that follows
(``"missing_rows"``, or ``"no_context"`` for an ``n_past`` lagging behind rows
already in the drafter's cache) would repeat every round, so the C++ core
reports it: with ``StagerConfig(strict=True)`` it raises
:class:`~dspark_core.errors.StateError` before anything changes; otherwise the
plan carries the facts and a flag set on the sequence's first mismatch since
its last ``begin()``. The binding logs that one with :func:`log_mismatch`, and a
sequence that ``fail`` disabled with :func:`log_disabled`: deciding *how* to
tell is this module's only job (the binding holds no logging policy); *what*
is out of protocol, and the cause in words, are the core's. See
docs/protocol.md section 3.
"""

from __future__ import annotations

import logging

from .stage_plan import DISABLED_WARNING

__all__ = ["MISMATCH_WARNING", "log_mismatch", "log_disabled"]

logger = logging.getLogger("dspark_core")

#: The one warning per sequence (until ``begin``): sequence, n_past, skip, newest row, cause.
MISMATCH_WARNING = "sequence %d: draft(n_past=%d) skipped (%s): the newest buffered row is %d; %s"


def log_mismatch(seq: int, n_past: int, skip: str, newest: int, cause: str) -> None:
    """Log a protocol mismatch the core reported (once per sequence until ``begin``)."""
    logger.warning(MISMATCH_WARNING, seq, n_past, skip, newest, cause)


def log_disabled(seq: int, failures: int, stage: str) -> None:
    """Log a sequence's drafting disabled by ``failures`` consecutive drafter failures (the
    core's report: ``fail`` returns the count that disabled it), ``stage`` the last one's."""
    logger.warning(DISABLED_WARNING, seq, failures, stage)
