"""Typed stubs of the private Cython module ``dspark_core._ext._row_format``.

Use :mod:`dspark_core.formats` instead; these wrappers do no coercion.
"""

from typing import Any

import numpy as np
import numpy.typing as npt

# The core's name tables (index == the C++ enum value); see dspark_core.stager.core_tables.
STORAGES: tuple[str, ...]
STORAGE_BLOCKS: tuple[tuple[int, int], ...]
NONFINITE_POLICIES: tuple[str, ...]
SKIP_REASONS: tuple[str, ...]
FAIL_STAGES: tuple[str, ...]
ROW_MODES: tuple[str, ...]
DRAFTER_KINDS: tuple[str, ...]
ELEM_TYPES: tuple[str, ...]
# The fields of the core's listed records (state() / stats() keys, PrefixHit fields).
SEQ_STATE_FIELDS: tuple[str, ...]
SEQ_STATS_FIELDS: tuple[str, ...]
PREFIX_HIT_FIELDS: tuple[str, ...]
PREFIX_STATS_FIELDS: tuple[str, ...]
STEP_CONFIG_FIELDS: tuple[str, ...]
STEP_OUTPUTS: tuple[tuple[str, int, str], ...]
STEP_STATE_FIELDS: tuple[str, ...]
# The rows of a batch plan's packed arrays (pack_plans): int64 meta, uint8 flags.
BATCH_META_ROWS: tuple[str, ...]
BATCH_FLAG_ROWS: tuple[str, ...]
ROUND_PLAN_FIELDS: tuple[str, ...]
# The stats fields that are gauges / peaks; every other stats field is a counter.
SEQ_STATS_GAUGES: tuple[str, ...]
SEQ_STATS_PEAKS: tuple[str, ...]
TRIM_CHUNK: int
MAX_POSITION: int
MAX_WINDOW: int
MAX_FEATURE_DIM: int
MAX_SEQS_LIMIT: int

def w_keep(block_size: int, window: int) -> int:
    """K, the rows a rebase keeps, of a configuration."""

def ring_rows(block_size: int, window: int) -> int:
    """The rows a sequence ever holds, its ring's slots, of a configuration."""

def check_stager_options(
    feature_dim: int,
    block_size: int,
    window: int,
    max_seqs: int,
    storage: int,
    max_failures: int,
    nonfinite: int,
    stage_dtype: int,
    rows: int,
    kind: int = 0,
) -> None:
    """The core's check of a Stager configuration (ConfigError naming the first unusable value)."""

def row_bytes(storage: str, dim: int) -> int:
    """Bytes of one row of ``dim`` elements stored as ``storage``."""

def storage_out_dtype(storage: str) -> np.dtype[Any]:
    """numpy dtype of :func:`encode`'s output for ``storage``."""

def encode(
    src: npt.NDArray[Any],
    storage: str,
    nonfinite: str = "error",
    out: npt.NDArray[Any] | None = None,
    staged: Any = ...,
) -> tuple[npt.NDArray[Any], int]:
    """Encode a C-contiguous 2-D float32/float16/bfloat16 array (bounds ``encode_bounds(storage, staged)``);
    returns (encoded, first_bad)."""

def decode(
    data: npt.NDArray[Any],
    storage: str,
    dim: int,
    out_dtype: Any = ...,
    out: npt.NDArray[Any] | None = None,
) -> npt.NDArray[Any]:
    """Decode whole rows stored as ``storage`` to (n, dim) of ``out_dtype``."""

def bounds(storage: str, staged: Any = ...) -> tuple[float, float]:
    """``(limit, clamp_to)`` of ``storage`` decoded to ``staged``."""

def staged_as_stored(storage: str, stage_dtype: Any) -> bool:
    """The core's rule: rows of ``storage`` staged as ``stage_dtype`` are their stored bytes."""

def pad_rows(seqs: npt.ArrayLike, row_offsets: npt.ArrayLike, values: npt.ArrayLike, max_rows: int,
             out: np.ndarray) -> None:
    """The core's padded layout (``BatchPlan.padded``)."""

def paged_rows(seqs: npt.ArrayLike, pos_base: npt.ArrayLike, row_offsets: npt.ArrayLike, positions: npt.ArrayLike,
               block_tables: npt.ArrayLike, block_tokens: int, null_block: int, tables_out: np.ndarray | None,
               slots_out: np.ndarray | None) -> None:
    """The core's paged layout (``BatchPlan.paged``)."""

def find_nonfinite(src: npt.NDArray[Any]) -> int:
    """Flat index of the first NaN/Inf, or -1."""

# The dispatch registry (see dspark_core.kernels).
KERNEL_FAMILIES: tuple[str, ...]
KERNEL_ENV: str
KERNEL_ENV_DEPRECATED: str

def kernel_paths(family: str) -> tuple[str, ...]:
    """Every path name of ``family``, portable first."""

def kernel_supported(family: str) -> tuple[str, ...]:
    """Supported paths of ``family``, portable first."""

def kernel_best(family: str) -> str:
    """The fastest supported path of ``family``."""

def kernel_active(family: str) -> str:
    """The path ``family`` runs now."""

def kernel_set(family: str, name: str) -> None:
    """Select a path of ``family`` process-wide (ValueError if unknown/unsupported)."""

def kernel_table(family: str) -> tuple[tuple[str, str], ...]:
    """(kernel, path whose code runs) for each kernel of ``family``."""

def kernel_env_status() -> str:
    """"unset", "used", "unknown" or "unsupported": what DSPARK_SIMD holds."""

def kernel_env_deprecated() -> bool:
    """Whether the deprecated DSPARK_CRC32C is set."""

def simd_paths() -> list[str]:
    """Supported row-format paths, scalar first."""

def best_simd_path() -> str:
    """The fastest supported row-format path."""

def active_simd_path() -> str:
    """The row-format path in use."""

def set_simd_path(name: str) -> None:
    """Select a row-format path process-wide (ValueError if unknown/unsupported)."""
