"""Context planning: size the drafter's context to its window, not the target's.

:func:`plan_context` turns a drafter's metadata (:class:`~dspark_core.DrafterInfo`)
and the server's settings into the numbers a server needs to create the drafter
context and the staging buffer:

* ``window = min(n_ctx_train, n_batch)``, lowered (never raised) by an explicit
  cap: the ``window_cap`` argument and the ``DSPARK_WINDOW_CAP`` environment
  variable (the smaller of those given). ``window > 2 * block_size`` or a
  :class:`~dspark_core.ConfigError` naming both numbers.
* ``w_keep = min(window // 2, window - block_size)``, the rows a rebase keeps.
* drafter ``n_ctx`` = ``window`` per sequence (the drafter never addresses a
  position ``>= window``), ``window * n_parallel`` in total (llama.cpp's
  unified KV cache). A drafter without a window needs the target's full context here.
* drafter ``n_batch = window``: a round stages at most ``window`` rows
  (context rows + the block; the rebase trigger guarantees it).
* drafter ``n_ubatch = n_batch``: the capture drafter decodes a whole round
  in one micro-batch. The block's query rows attend to each other (the block
  is predicted in parallel, not causally) and the round's feature rows enter
  as one embedding input, so a round must not be split across ubatches
  (llama.cpp runs non-causal attention only within one ubatch: it requires
  ``n_ubatch >= n_tokens`` there). The reference systems raised
  ``n_ubatch = n_batch`` for the dspark drafter; the plan keeps it. What changes is
  ``n_batch`` itself: it is the window, so the compute buffer is bounded by
  the window instead of the target's context (the multi-GB boot OOM).
* ``n_batch_draft_many = window * n_parallel``: one ``draft_many`` batch holds
  every sequence's round, so a server that decodes all slots in one call needs
  this ``n_batch`` (and ``n_ubatch``) instead; per-sequence decodes need only
  ``window``. Both are bounded by the window, never by the target's context.
* ``n_outputs_max = n_parallel * (1 + block_size)`` (block logits per sequence,
  plus one).
* peak feature-buffer rows per sequence ``window + TRIM_CHUNK + block_size + 1``
  and their bytes in the chosen storage format.
"""

from __future__ import annotations

import logging
import os
import warnings as _warnings
from dataclasses import dataclass
from typing import Any

from .stager.config import STORAGES, TRIM_CHUNK, positive_int, storage_row_bytes, window_for
from .stager.core_tables import ring_rows as core_ring_rows
from .stager.core_tables import w_keep as core_w_keep
from .gguf.drafter_info import DrafterInfo, DrafterMetadataError, inherited_context_warning
from .errors import ConfigError

__all__ = ["ContextPlan", "plan_context", "row_bytes", "WINDOW_CAP_ENV", "format_table"]

logger = logging.getLogger("dspark_core")

#: Environment variable that may lower (never raise) the window.
WINDOW_CAP_ENV = "DSPARK_WINDOW_CAP"

#: Bytes of one stored row (pure Python; the same function as StagerConfig.row_bytes uses).
row_bytes = storage_row_bytes


def _env_cap() -> int | None:
    raw = os.environ.get(WINDOW_CAP_ENV)
    if raw is None or not raw.strip():
        return None
    try:
        v = int(raw.strip(), 10)
    except ValueError:
        raise ConfigError(f"{WINDOW_CAP_ENV}={raw!r} is not a positive integer") from None
    if v < 1:
        raise ConfigError(f"{WINDOW_CAP_ENV}={raw!r} is not a positive integer")
    return v


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "- (feature_dim unknown)"
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if x < 1024 or unit == "TiB":
            return f"{n:,} bytes ({x:.1f} {unit})" if unit != "B" else f"{n:,} bytes"
        x /= 1024
    return f"{n:,} bytes"  # pragma: no cover


def format_table(rows: list[tuple[str, str]], title: str | None = None) -> str:
    """Two aligned columns (label, value), with an optional title line."""
    width = max((len(k) for k, _ in rows), default=0)
    lines = [title] if title else []
    lines += [f"  {k.ljust(width)}  {v}" for k, v in rows]
    return "\n".join(lines)


@dataclass(frozen=True)
class ContextPlan:
    """How to size the drafter context and the staging buffer (see :func:`plan_context`).

    Attributes:
        path: the drafter file the plan is for.
        block_size: ``B``.
        feature_dim: ``D``, or ``None`` when the drafter file does not give it.
        storage: feature-buffer storage format.
        n_parallel: sequences (server slots).
        target_n_ctx: the target's context, if given.
        n_ctx_train: the drafter's trained range used.
        target_n_batch: the server's ``n_batch`` the window was bounded by.
        window: ``W``, the drafter positions ``[0, W)`` it may run at.
        window_source: what bound the window: ``"n_ctx_train"``, ``"n_batch"`` or ``"cap"``.
        window_cap: the effective cap (the smaller of the argument and the
            environment variable), or ``None``.
        window_cap_source: ``"window_cap"`` or ``"DSPARK_WINDOW_CAP"``, or ``None``.
        w_keep: ``K = min(W // 2, W - B)``, rows a rebase keeps.
        n_ctx_seq: drafter context per sequence (``W``).
        n_ctx: drafter context in total (``W * n_parallel``, unified KV).
        n_batch: drafter ``n_batch`` (``W``: a round stages at most ``W`` rows).
        n_ubatch: drafter ``n_ubatch`` (``= n_batch``: a round is one ubatch).
        n_batch_draft_many: ``W * n_parallel``: ``n_batch`` (and ``n_ubatch``) for
            decoding every sequence's round in one ``draft_many`` batch.
        n_outputs_max: ``n_parallel * (1 + B)``.
        ring_rows: ``W + TRIM_CHUNK + B + 1``, the rows a sequence ever holds
            (``StagerConfig.ring_rows``, the core's). Formerly
            ``peak_rows_per_seq`` (deprecated alias; the JSON key is ``ring_rows``).
        row_bytes: bytes per stored row, or ``None``.
        peak_feature_bytes_per_seq: ``ring_rows * row_bytes``, or ``None``.
        peak_feature_bytes: ``peak_feature_bytes_per_seq * n_parallel``, or ``None``.
        unwindowed_n_ctx: the drafter context a drafter without a window
            needs (the target's ``n_ctx``), for comparison; ``None`` without
            ``target_n_ctx``. Formerly ``anchor_n_ctx`` (deprecated alias).
        unwindowed_n_batch: that drafter's ``n_batch`` (``target_n_ctx + B``).
            Formerly ``anchor_n_batch`` (deprecated alias).
        warnings: warnings about the inputs (each logged once).
        kind: the drafter's kind (``"block"`` or ``"chain"``; ``DrafterInfo.kind``),
            which ``StagerConfig.from_plan`` passes on.
    """

    path: str
    block_size: int
    feature_dim: int | None
    storage: str
    n_parallel: int
    target_n_ctx: int | None
    n_ctx_train: int
    target_n_batch: int
    window: int
    window_source: str
    window_cap: int | None
    window_cap_source: str | None
    w_keep: int
    n_ctx_seq: int
    n_ctx: int
    n_batch: int
    n_ubatch: int
    n_batch_draft_many: int
    n_outputs_max: int
    ring_rows: int
    row_bytes: int | None
    peak_feature_bytes_per_seq: int | None
    peak_feature_bytes: int | None
    unwindowed_n_ctx: int | None
    unwindowed_n_batch: int | None
    warnings: tuple[str, ...] = ()
    kind: str = "block"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["warnings"] = list(self.warnings)
        return d

    def table_rows(self) -> list[tuple[str, str]]:
        """``(label, value)`` rows for a human-readable table."""
        src = self.window_source
        if src == "cap":
            src = f"cap {self.window_cap} from {self.window_cap_source}"
        bound = f"min(n_ctx_train {self.n_ctx_train}, n_batch {self.target_n_batch}"
        bound += f", cap {self.window_cap})" if self.window_cap is not None else ")"
        rows = [
            ("target n_ctx", "-" if self.target_n_ctx is None else str(self.target_n_ctx)),
            ("n_parallel", str(self.n_parallel)),
            ("storage", self.storage),
            ("window", f"{self.window}  = {bound}, bound by {src}"),
            ("w_keep", f"{self.w_keep}  = min(W // 2, W - B)"),
            ("drafter n_ctx / seq", str(self.n_ctx_seq)),
            ("drafter n_ctx", f"{self.n_ctx}  = {self.n_ctx_seq} * {self.n_parallel}"),
            ("drafter n_batch", str(self.n_batch)),
            ("drafter n_ubatch", f"{self.n_ubatch}  (a round decodes in one ubatch)"),
            ("n_batch, draft_many", f"{self.n_batch_draft_many}  = {self.window} * {self.n_parallel} (all slots in one batch)"),
            ("n_outputs_max", f"{self.n_outputs_max}  = {self.n_parallel} * (1 + {self.block_size})"),
            (
                "ring rows / seq",
                f"{self.ring_rows}  = W + {TRIM_CHUNK} + B + 1 (the most a sequence holds)",
            ),
            ("row bytes", "-" if self.row_bytes is None else f"{self.row_bytes:,}"),
            ("peak buffer / seq", _fmt_bytes(self.peak_feature_bytes_per_seq)),
            ("peak buffer total", _fmt_bytes(self.peak_feature_bytes)),
        ]
        if self.unwindowed_n_ctx is not None:
            rows.append(("unwindowed n_ctx", f"{self.unwindowed_n_ctx}  (full target context, for comparison)"))
            rows.append(("unwindowed n_batch", f"{self.unwindowed_n_batch}  (n_ctx + B)"))
        return rows

    @property
    def anchor_n_ctx(self) -> int | None:
        """Deprecated name of :attr:`unwindowed_n_ctx`."""
        _renamed("anchor_n_ctx", "unwindowed_n_ctx")
        return self.unwindowed_n_ctx

    @property
    def peak_rows_per_seq(self) -> int:
        """Deprecated name of :attr:`ring_rows`."""
        _renamed("peak_rows_per_seq", "ring_rows")
        return self.ring_rows

    @property
    def anchor_n_batch(self) -> int | None:
        """Deprecated name of :attr:`unwindowed_n_batch`."""
        _renamed("anchor_n_batch", "unwindowed_n_batch")
        return self.unwindowed_n_batch

    def format_table(self) -> str:
        """The plan as an aligned two-column table."""
        return format_table(self.table_rows(), "context plan")


def _renamed(old: str, new: str) -> None:
    _warnings.warn(f"ContextPlan.{old} is deprecated; use ContextPlan.{new}", DeprecationWarning, stacklevel=3)


def plan_context(
    info: DrafterInfo,
    target_n_ctx: int | None,
    n_batch: int,
    n_parallel: int = 1,
    storage: str = "f32",
    n_draft: int | None = None,
    window_cap: int | None = None,
) -> ContextPlan:
    """Plan the drafter context and staging buffer for ``info``.

    Args:
        info: the drafter's metadata (:meth:`DrafterInfo.from_gguf`).
        target_n_ctx: the target's context (``None`` if unknown). A drafter
            ``context_length`` equal to it looks inherited and draws a warning.
        n_batch: the server's ``n_batch``; the window never exceeds it.
        n_parallel: sequences (server slots).
        storage: feature-buffer storage format (``f32``, ``f16``, ``bf16``,
            ``q8_0``, ``q4_0``).
        n_draft: the draft length the server asks for; it must equal the
            drafter's ``block_size`` (``None``: use ``block_size``).
        window_cap: lowers the window (never raises it); so does the
            ``DSPARK_WINDOW_CAP`` environment variable. The smaller one applies.

    Returns:
        The :class:`ContextPlan`.

    Raises:
        ConfigError: a non-positive or non-integer argument, an unknown storage,
            an invalid ``DSPARK_WINDOW_CAP``, ``n_draft != block_size``, an
            unknown ``n_ctx_train``, ``window <= 2 * block_size``, or a q storage
            with ``feature_dim % 32 != 0``.
    """
    B = info.block_size
    n_batch = positive_int("n_batch", n_batch)
    n_parallel = positive_int("n_parallel", n_parallel)
    target = None if target_n_ctx is None else positive_int("target_n_ctx", target_n_ctx)
    if storage not in STORAGES:
        raise ConfigError(f"storage {storage!r} is not supported; use one of {STORAGES}")
    if n_draft is not None and positive_int("n_draft", n_draft) != B:
        raise ConfigError(f"draft length ({n_draft}) must equal the drafter's block_size ({B})")
    if info.n_ctx_train is None:
        raise DrafterMetadataError(
            info.path,
            f"the drafter's trained context is unknown (no {info.architecture}.trained_context_length "
            f"or {info.architecture}.context_length key): pass n_ctx_train= (inspect --n-ctx-train)",
        )
    n_ctx_train = info.n_ctx_train

    # the cap: the smaller of the argument and the environment, lowering only
    caps: list[tuple[int, str]] = []
    if window_cap is not None:
        caps.append((positive_int("window_cap", window_cap), "window_cap"))
    env = _env_cap()
    if env is not None:
        caps.append((env, WINDOW_CAP_ENV))
    cap, cap_src = min(caps) if caps else (None, None)

    window = window_for(n_ctx_train, n_batch, cap)
    if cap is not None and cap < min(n_ctx_train, n_batch):
        window_source = "cap"
    elif n_ctx_train <= n_batch:
        window_source = "n_ctx_train"
    else:
        window_source = "n_batch"
    if window <= 2 * B:
        bound = f"min(n_ctx_train {n_ctx_train}, n_batch {n_batch}" + (f", cap {cap})" if cap is not None else ")")
        raise ConfigError(
            f"{info.path}: window ({window}) must be greater than 2 * block_size "
            f"(2 * {B} = {2 * B}); the window is {bound}"
        )

    warnings = list(info.warnings)
    if (
        not info.warnings
        and target is not None
        and info.n_ctx_train_source == f"{info.architecture}.context_length"
    ):
        w = inherited_context_warning(info.n_ctx_train_source, n_ctx_train, info.architecture, target)
        if w is not None:
            logger.warning("%s: %s", info.path, w)
            warnings.append(w)

    D = info.feature_dim
    rb = None if D is None else row_bytes(storage, D)
    ring = core_ring_rows(B, window)
    per_seq = None if rb is None else ring * rb
    return ContextPlan(
        kind=info.kind,
        path=info.path,
        block_size=B,
        feature_dim=D,
        storage=storage,
        n_parallel=n_parallel,
        target_n_ctx=target,
        n_ctx_train=n_ctx_train,
        target_n_batch=n_batch,
        window=window,
        window_source=window_source,
        window_cap=cap,
        window_cap_source=cap_src,
        w_keep=core_w_keep(B, window),
        n_ctx_seq=window,
        n_ctx=window * n_parallel,
        n_batch=window,
        n_ubatch=window,
        n_batch_draft_many=window * n_parallel,
        n_outputs_max=n_parallel * (1 + B),
        ring_rows=ring,
        row_bytes=rb,
        peak_feature_bytes_per_seq=per_seq,
        peak_feature_bytes=None if per_seq is None else per_seq * n_parallel,
        unwindowed_n_ctx=target,
        unwindowed_n_batch=None if target is None else target + B,
        warnings=tuple(warnings),
    )
