"""Stager configuration: the window, block and storage a Stager runs with.

Every rule a configuration must follow is the C++ core's
(``dspark::check_options``), which :class:`StagerConfig` calls on
construction, as the Stager's constructor does again (it never trusts its
caller): each count ``>= 1``, ``window > 2 * block_size`` (a rebase keeps
``w_keep = window // 2`` rows and still has room for a block), the limits
below, and whole GGML blocks of 32 for the q formats; so is every size
derived from a configuration (``w_keep``, ``ring_rows``, ``row_bytes``).
This module converts what a Python caller passes (integers, names, dtypes),
and picks a window from a server's settings (:func:`window_for`).
"""

from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..rows import _bf16
from .core_tables import (
    DRAFTER_KINDS,
    ELEM_TYPES,
    MAX_FEATURE_DIM,
    MAX_SEQS_LIMIT,
    MAX_WINDOW,
    NONFINITE_POLICIES,
    ROW_MODES,
    STORAGE_FORMATS,
    STORAGES,
    TRIM_CHUNK,
    check_stager_options,
)
from ..errors import ConfigError
from .core_tables import ring_rows as core_ring_rows
from .core_tables import w_keep as core_w_keep

__all__ = [
    "TRIM_CHUNK",
    "STORAGES",
    "STAGE_DTYPES",
    "NONFINITE_POLICIES",
    "ROW_MODES",
    "DRAFTER_KINDS",
    "MAX_SEQS_LIMIT",
    "MAX_WINDOW",
    "MAX_FEATURE_DIM",
    "StagerConfig",
    "window_for",
    "stage_dtype_name",
    "positive_int",
    "storage_row_bytes",
]

#: dtypes ``plan.rows`` can be staged in: the core's element types.
STAGE_DTYPES = ELEM_TYPES

#: The int64 range the core's fields hold; a Python int beyond it is clamped
#: to it (the core rejects every value that far out, naming the field).
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def stage_dtype_name(dtype: Any) -> str:
    """Normalise a stage dtype (``np.float32``, ``"bfloat16"``, ...) to its name."""
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


def _integer(name: str, value: Any) -> int:
    """``value`` as an int, or a ConfigError naming ``name``."""
    try:
        return operator.index(value)
    except TypeError as exc:
        raise ConfigError(f"{name} must be an integer, got {value!r}") from exc


def positive_int(name: str, value: Any, minimum: int = 1) -> int:
    """``value`` as an int ``>= minimum``, or a ConfigError naming ``name``."""
    v = _integer(name, value)
    if v < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {v}")
    return v


def storage_row_bytes(storage: str, feature_dim: int) -> int:
    """Bytes of one feature row of width ``feature_dim`` stored as ``storage``.

    ``f32``: ``4 D``; ``f16`` / ``bf16``: ``2 D``; ``q8_0``: ``D / 32 * 34``;
    ``q4_0``: ``D / 32 * 18`` (GGML block layouts; q formats need ``D % 32 == 0``).
    From the core's block table (:data:`dspark_core.stager.core_tables.STORAGE_FORMATS`);
    equals ``formats.row_bytes``.
    """
    if storage not in STORAGE_FORMATS:
        raise ConfigError(f"storage {storage!r} is not supported; use one of {STORAGES}")
    return STORAGE_FORMATS[storage].row_bytes(feature_dim)


def window_for(n_ctx_train: int, n_batch: int, cap: int | None = None) -> int:
    """The drafter window: ``min(n_ctx_train, n_batch)``, lowered (never raised) by ``cap``."""
    w = min(positive_int("n_ctx_train", n_ctx_train), positive_int("n_batch", n_batch))
    if cap is not None:
        w = min(w, positive_int("window cap", cap))
    return w


@dataclass(frozen=True)
class StagerConfig:
    """Configuration of a :class:`~dspark_core.Stager` (and of the reference twin).

    Args:
        feature_dim: width ``D`` of a feature row (``n_capture * n_embd_target``).
        block_size: drafter block size ``B`` (query rows per round).
        window: ``W``, the drafter positions ``[0, W)`` the drafter may run at.
            Must be greater than ``2 * block_size``.
        max_seqs: number of sequences (slots), ids ``0 .. max_seqs - 1``.
        storage: buffer storage format, one of :data:`STORAGES`.
        max_failures: consecutive ``fail`` calls after which a sequence is
            disabled (until ``begin``).
        stage_dtype: dtype of ``plan.rows`` (``float32``, ``float16`` or ``bfloat16``).
        nonfinite: what a value the rows cannot carry does: NaN, +-Inf, or a
            finite value whose encoding overflows (e.g. |x| >= 65520 in f16
            storage or when staged as float16; a q8_0 / q4_0 block whose fp16
            scale overflows). ``"error"`` (default) rejects the call,
            ``"zero"`` stores 0, ``"clamp"`` clamps to the largest value the
            storage (and stage dtype) can hold (NaN -> 0), ``"clamp_f16"``
            clamps to +-65504 as well (llama.cpp's fp16 drafter caches).
        strict: raise :class:`StateError` from ``draft`` when the server's
            ``n_past`` disagrees with the buffered rows (a forgotten
            ``accept`` / ``rollback`` / ``process``) instead of skipping with
            ``"missing_rows"`` and logging one warning per sequence.
        rows: ``"held"`` (the Stager keeps the rows; plans carry them) or
            ``"external"`` (the server keeps them in a table of
            ``max_seqs * ring_rows`` rows: ``process`` returns the slots to
            write, plans carry ``slots``, ``fork`` / ``shift`` return the
            copies to apply; see docs/external_rows.md).
        kind: the drafter the rows serve, one of :data:`DRAFTER_KINDS`:
            ``"block"`` (DSpark / DFlash, default) or ``"chain"`` (EAGLE-3,
            EAGLE, MTP heads: ``process`` then takes ``tokens=``, the id of
            the token the target read at each row's position, which the
            Stager keeps beside the row; plans carry them, see
            :meth:`StagePlan.successors`). Windows, rebases and recovery are
            the same for both; a tree verify batch takes each node's id, a
            reservation its rows' and a prefix hit the prompt's; the device
            step serves block drafters only.

    Raises:
        ConfigError: for any value that cannot work, naming it.
    """

    feature_dim: int
    block_size: int
    window: int
    max_seqs: int = 1
    storage: str = "f32"
    max_failures: int = 3
    stage_dtype: str = "float32"
    nonfinite: str = "error"
    strict: bool = False
    rows: str = "held"
    kind: str = "block"

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        ints = ("feature_dim", "block_size", "window", "max_seqs", "max_failures")
        for name in ints:
            set_(self, name, _integer(name, getattr(self, name)))
        if self.storage not in STORAGES:
            raise ConfigError(f"storage {self.storage!r} is not supported; use one of {STORAGES}")
        set_(self, "stage_dtype", stage_dtype_name(self.stage_dtype))
        if not isinstance(self.strict, bool):
            raise ConfigError(f"strict must be a bool, got {self.strict!r}")
        if self.nonfinite not in NONFINITE_POLICIES:
            raise ConfigError(f"nonfinite {self.nonfinite!r} is not supported; use one of {NONFINITE_POLICIES}")
        if self.rows not in ROW_MODES:
            raise ConfigError(f"rows {self.rows!r} is not supported; use one of {ROW_MODES}")
        if self.kind not in DRAFTER_KINDS:
            raise ConfigError(f"kind {self.kind!r} is not a drafter kind; use one of {DRAFTER_KINDS}")
        # Every value rule is the core's (ConfigError naming the first unusable value).
        d, b, w, n, f = (min(max(getattr(self, name), _INT64_MIN), _INT64_MAX) for name in ints)
        check_stager_options(d, b, w, n, STORAGES.index(self.storage), f, NONFINITE_POLICIES.index(self.nonfinite),
                             STAGE_DTYPES.index(self.stage_dtype), ROW_MODES.index(self.rows),
                             DRAFTER_KINDS.index(self.kind))

    # -- derived values -------------------------------------------------
    @property
    def w_keep(self) -> int:
        """``K``: rows kept on a rebase, ``min(W // 2, W - B)`` (== ``W // 2`` since ``W > 2B``; the core's)."""
        return core_w_keep(self.block_size, self.window)

    @property
    def ring_rows(self) -> int:
        """Upper bound on rows a sequence ever holds, ``W + TRIM_CHUNK + B + 1`` (the core's):
        its ring's slots. Sequence ``s`` owns the global slots ``[s * ring_rows, (s + 1) * ring_rows)``."""
        return core_ring_rows(self.block_size, self.window)

    @property
    def max_buffered_rows(self) -> int:
        """Deprecated name of :attr:`ring_rows`."""
        warnings.warn("StagerConfig.max_buffered_rows is deprecated; use StagerConfig.ring_rows",
                      DeprecationWarning, stacklevel=2)
        return self.ring_rows

    @property
    def external_rows(self) -> bool:
        """True in external-row mode (``rows="external"``)."""
        return self.rows == "external"

    @property
    def chain(self) -> bool:
        """True for a chain drafter's Stager (``kind="chain"``): token ids beside the rows."""
        return self.kind == "chain"

    @property
    def row_bytes(self) -> int:
        """Bytes of one stored row."""
        return storage_row_bytes(self.storage, self.feature_dim)

    @property
    def numpy_stage_dtype(self) -> np.dtype:
        """``stage_dtype`` as a numpy dtype (bfloat16 from ml_dtypes)."""
        return _bf16.as_dtype(self.stage_dtype)

    def snapshot_fingerprint(self) -> tuple[int, int, int, int, int, int, int]:
        """What a snapshot must match to be restored, as its header stores it:
        ``(feature_dim, storage code, window, block_size, row_bytes, nonfinite code, stage_dtype code)``.

        The nonfinite policy and the staged type are part of it: they bound
        what the stored rows may hold (no NaN under ``"zero"``, finite once
        narrowed to float16, ...), which the restoring Stager relies on
        (format v2; a version-1 snapshot records neither and is not checked
        for them)."""
        return (self.feature_dim, STORAGES.index(self.storage), self.window, self.block_size, self.row_bytes,
                NONFINITE_POLICIES.index(self.nonfinite), STAGE_DTYPES.index(self.stage_dtype))

    def replace(self, **changes: Any) -> "StagerConfig":
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    # -- constructors ---------------------------------------------------
    @classmethod
    def from_limits(
        cls,
        feature_dim: int,
        block_size: int,
        n_ctx_train: int,
        n_batch: int,
        cap: int | None = None,
        **kw: Any,
    ) -> "StagerConfig":
        """Window from the drafter's trained range and the batch size.

        ``window = min(n_ctx_train, n_batch)``, lowered by ``cap`` when given.
        """
        return cls(feature_dim, block_size, window_for(n_ctx_train, n_batch, cap), **kw)

    @classmethod
    def from_plan(cls, plan: Any, feature_dim: int | None = None, **kw: Any) -> "StagerConfig":
        """Configuration from a :class:`~dspark_core.ContextPlan` (see ``plan_context``).

        ``feature_dim`` defaults to the plan's (taken from the drafter GGUF when
        its tensors give it); ``max_seqs`` to the plan's ``n_parallel``.
        """
        d = feature_dim if feature_dim is not None else getattr(plan, "feature_dim", None)
        if d is None:
            raise ConfigError("feature_dim is unknown: the plan does not give it, pass feature_dim=")
        kw.setdefault("max_seqs", plan.n_parallel)
        kw.setdefault("storage", plan.storage)
        kw.setdefault("kind", getattr(plan, "kind", "block"))
        return cls(d, plan.block_size, plan.window, **kw)
