"""Fuzzing and invariant-checking helpers for the Stager (and for your server loop).

Three pieces, all deterministic (the same bytes always give the same calls):

* :func:`decode_ops` turns any byte string into a :class:`~dspark_core.StagerConfig`
  and a list of :class:`Op` (every Stager operation, with valid *and* invalid
  arguments, on several sequences, every storage format). Each op takes a fixed
  six-byte record, so flipping one byte changes one op and leaves the rest of
  the sequence alone: a coverage-guided fuzzer's small mutations stay
  meaningful. Positions are symbolic (``at="end"``, ``delta=-1``) and are
  resolved against the sequence's state when the op runs, so most calls are
  valid continuations and the interesting invalid ones are one byte away.
* :func:`run_differential` applies the ops to the C++-backed
  :class:`dspark_core.Stager` and to the pure-Python
  :class:`~dspark_core.reference.ReferenceStager` and compares every result
  (exception type, plan fields, staged bytes, state, counters, snapshot
  bytes); any difference raises :class:`Desync` with a readable op trace.
  With ``external=True`` an external-row core runs alongside, its rows in a
  numpy mirror table kept as an owner keeps them (:class:`ExternalShadow`),
  checked against the held core after every call; :func:`replay_threads`
  replays the calls made from several threads against a serial replay.
* :func:`check_invariants` (one-shot) and :class:`InvariantChecker` (a proxy
  you wrap around any Stager-like object, e.g. the one inside your server's
  loop) check the protocol's guarantees after every call: positions
  contiguous, drafter positions inside ``[0, W)``, the block fits, staged rows
  are the rows the server gave, ``clear_cache`` whenever the drafter cache
  cannot be trusted, the buffer bound, no round left open after commit/fail.
  Over an external-row Stager the checker owns the rows (a numpy mirror of
  the row table, filled at the slots ``process`` returns, moved by ``fork`` /
  ``shift``) and checks each plan's rows read at ``plan.slots``.

Example: fuzz the core against the reference::

    >>> from dspark_core.testing import decode_ops, run_differential
    >>> config, ops = decode_ops(bytes(range(64)))
    >>> report = run_differential(config, ops)      # raises Desync on any difference
    >>> report.n_calls > 0
    True

Example: check your own loop (any object with the Stager API)::

    >>> import numpy as np
    >>> from dspark_core import Stager, StagerConfig
    >>> from dspark_core.testing import InvariantChecker
    >>> cfg = StagerConfig(feature_dim=32, block_size=4, window=16)
    >>> st = InvariantChecker(Stager(cfg))          # same API, checks every call
    >>> st.process(0, np.arange(10), np.ones((10, 32), np.float32))
    >>> plan = st.draft(0, 10)
    >>> st.commit(0)

A violated invariant raises :class:`InvariantViolation` (an ``AssertionError``).
"""

from __future__ import annotations

from .data import make_rows
from .differential import _Runner  # noqa: F401 - the fuzz targets drive the runner op by op
from .differential import ALLOWED_ERRORS, Desync, ExternalShadow, RunReport, replay_threads, run_differential
from .invariants import InvariantChecker, InvariantViolation, check_invariants, check_plan
from .ops import CONFIG_BYTES, MAX_OPS, OP_BYTES, OPS, Call, Op, decode_config, decode_ops, encode_config, encode_ops

__all__ = [
    "Op",
    "Call",
    "Desync",
    "InvariantViolation",
    "RunReport",
    "OPS",
    "ALLOWED_ERRORS",
    "CONFIG_BYTES",
    "OP_BYTES",
    "MAX_OPS",
    "decode_config",
    "decode_ops",
    "encode_config",
    "encode_ops",
    "make_rows",
    "run_differential",
    "replay_threads",
    "ExternalShadow",
    "check_plan",
    "check_invariants",
    "InvariantChecker",
]
