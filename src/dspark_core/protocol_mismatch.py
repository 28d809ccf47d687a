"""Loud protocol mismatches: a server whose ``n_past`` disagrees with the rows it buffered.

``draft(seq, n_past)`` skips with ``"missing_rows"`` when the newest buffered
row is not ``n_past - 1``. That is never an ordinary condition: the server
forgot ``accept()`` after a verify batch (the rejected rows are still
buffered), a ``rollback()`` after its target rolled back, or a ``process()``
of some target decode. Left silent, every later round skips too and
speculation is lost without a word. So both stagers (the core's and the
reference) log :data:`MISMATCH_WARNING` once per sequence until its next
``begin()``, or, with ``StagerConfig(strict=True)``, raise
:class:`~dspark_core.errors.StateError` before anything changes. Ordinary
skips (``disabled``, ``empty``, ``no_context``) are neither. See
docs/protocol.md.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from .errors import StateError

__all__ = ["MISMATCH_WARNING", "mismatch_cause", "would_miss_rows", "MismatchGuard"]

logger = logging.getLogger("dspark_core")

#: The one warning per sequence (until ``begin``): sequence, n_past, newest row, cause.
MISMATCH_WARNING = "sequence %d: draft(n_past=%d) skipped (missing_rows): the newest buffered row is %d; %s"


def mismatch_cause(n_past: int, end: int) -> str:
    """Why rows ``[.., end)`` do not end at ``n_past``, in words a server engineer can act on."""
    if end > n_past:
        return (
            f"rows {n_past}..{end - 1} are still buffered: was accept() not called after the verify batch "
            "(it keeps n_accepted + 1 of its rows), or is a rollback() to the target's n_past missing?"
        )
    return (
        f"rows {end}..{n_past - 1} were never processed: every target decode (prefill chunk, verify batch) "
        "must be passed to process()"
    )


def would_miss_rows(state: Mapping[str, Any], n_past: int) -> bool:
    """Whether ``draft`` at ``n_past`` would skip with ``"missing_rows"`` (the skip order of docs/design.md 2)."""
    return (
        not state["disabled"]
        and bool(state["started"])
        and n_past > state["n_cache"]
        and state["end"] != n_past
    )


class MismatchGuard:
    """Per-sequence mismatch handling shared by ``Stager`` and ``ReferenceStager``."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self._warned: set[int] = set()

    def reset(self, seq: int) -> None:
        """``begin(seq)``: the next mismatch of ``seq`` warns again."""
        self._warned.discard(seq)

    def check(self, seq: int, n_past: int, state: Mapping[str, Any]) -> None:
        """Strict mode: raise ``StateError`` when ``draft`` would skip on a mismatch."""
        if self.strict and would_miss_rows(state, n_past):
            end = int(state["end"])
            raise StateError(
                f"sequence {seq}: draft(n_past={n_past}) does not match the buffered rows (newest {end - 1}): "
                f"{mismatch_cause(n_past, end)} (strict=True; nothing changed)"
            )

    def skipped(self, seq: int, n_past: int, end: int) -> None:
        """A ``"missing_rows"`` skip happened: warn, once per sequence until ``begin``."""
        if seq not in self._warned:
            self._warned.add(seq)
            logger.warning(MISMATCH_WARNING, seq, n_past, end - 1, mismatch_cause(n_past, end))
