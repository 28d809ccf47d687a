"""The reference twin's own configuration rules: every check and message a Stager's configuration
meets, written again.

``StagerConfig`` runs the binding's conversions and the core's option checks
(``check_options`` in csrc/src/stager.cpp); an oracle that borrowed them could
not tell a drifted rule from a correct one. So the limits, the name tables and
each message are spelled out here, from docs/design.md section 4, and
tests/test_reference_config.py compares every refusal, word for word, with
``StagerConfig``'s. The order is the core's: each integer field's kind, the
names (storage, stage dtype, strict, nonfinite, rows), then the values.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from ..errors import ConfigError
from .arguments import INT64_MAX, INT64_MIN, NONFINITE_POLICIES, STAGE_DTYPES
from .formats import STORAGES

__all__ = ["check_config", "MAX_WINDOW", "MAX_FEATURE_DIM", "MAX_SEQS", "ROW_MODES", "DRAFTER_KINDS", "COUNTS"]

#: The largest window (drafter positions) a Stager takes.
MAX_WINDOW = 1 << 30
#: The widest feature row.
MAX_FEATURE_DIM = 1 << 28
#: The most sequences (slots) one Stager holds.
MAX_SEQS = 1 << 16
#: Where the rows live: in the Stager, or in the server's table.
ROW_MODES = ("held", "external")
#: The drafters the rows serve: block (DSpark / DFlash) and chain (EAGLE-3, EAGLE, MTP).
DRAFTER_KINDS = ("block", "chain")
#: The integer fields, in the order they are checked.
COUNTS = ("feature_dim", "block_size", "window", "max_seqs", "max_failures")
#: Elements per q8_0 / q4_0 block: a quantized row is whole blocks.
QK = 32


def _stage_dtype(dtype: Any) -> str:
    if isinstance(dtype, str):
        name = dtype
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError as exc:
            raise ConfigError(f"stage_dtype {dtype!r} is not a dtype; use one of {STAGE_DTYPES}") from exc
    if name not in STAGE_DTYPES:
        raise ConfigError(f"stage_dtype {name!r} is not supported; use one of {STAGE_DTYPES}")
    return name


def check_config(config: Any) -> None:
    """Raise the ConfigError ``StagerConfig`` would for ``config`` (anything with its fields:
    ``feature_dim``, ``block_size``, ``window``, ``max_seqs``, ``storage``, ``max_failures``,
    ``stage_dtype``, ``nonfinite``, ``strict``, ``rows``); return when it is usable."""
    counts = {}
    for name in COUNTS:
        value = getattr(config, name)
        try:
            counts[name] = operator.index(value)
        except TypeError as exc:
            raise ConfigError(f"{name} must be an integer, got {value!r}") from exc
    if config.storage not in STORAGES:
        raise ConfigError(f"storage {config.storage!r} is not supported; use one of {STORAGES}")
    _stage_dtype(config.stage_dtype)
    if not isinstance(config.strict, bool):
        raise ConfigError(f"strict must be a bool, got {config.strict!r}")
    if config.nonfinite not in NONFINITE_POLICIES:
        raise ConfigError(f"nonfinite {config.nonfinite!r} is not supported; use one of {NONFINITE_POLICIES}")
    if config.rows not in ROW_MODES:
        raise ConfigError(f"rows {config.rows!r} is not supported; use one of {ROW_MODES}")
    if config.kind not in DRAFTER_KINDS:
        raise ConfigError(f"kind {config.kind!r} is not a drafter kind; use one of {DRAFTER_KINDS}")
    # The values, as the core sees them: an integer beyond int64 is quoted as the nearest int64.
    d, b, w, n, f = (min(max(counts[name], INT64_MIN), INT64_MAX) for name in COUNTS)
    for name, v in zip(COUNTS, (d, b, w, n, f)):
        if v < 1:
            raise ConfigError(f"{name} must be >= 1, got {v}")
    # A rebase keeps W / 2 rows and must still fit a block.
    if w <= 2 * b:
        raise ConfigError(f"window ({w}) must be greater than 2 * block_size (2 * {b} = {2 * b})")
    if w > MAX_WINDOW:
        raise ConfigError(f"window ({w}) must be <= 2**30")
    if d > MAX_FEATURE_DIM:
        raise ConfigError(f"feature_dim ({d}) must be <= 2**28")
    if n > MAX_SEQS:
        raise ConfigError(f"max_seqs ({n}) exceeds the limit {MAX_SEQS}")
    if config.storage in ("q8_0", "q4_0") and d % QK != 0:
        raise ConfigError(f"dspark: storage {config.storage} needs feature_dim % 32 == 0, got feature_dim {d} "
                          "(a positive multiple of 32: whole blocks)")
