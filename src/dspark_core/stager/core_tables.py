"""The core's tables and limits: storages, block geometry, element types, row modes,
non-finite policies, skip reasons, fail stages, and the numeric limits of a Stager.

One source of truth: the C++ core's enums and constants, read through the
binding (``_ext._row_format`` walks each enum's name function until it ends),
so a value the core gains (a new non-finite policy, say) appears here without
an edit. Every module of the package takes these names and limits from here;
the reference twin, the test oracle, spells out its own. :func:`_check` runs
at import: a core whose tables disagree with its own ``row_bytes`` fails
``import dspark_core`` instead of a call later.

Tuple index == the C++ enum value (``Storage``, ``ElemType``, ``RowMode``,
``NonFinite``, ``FailStage``; ``Skip`` counts from 1, its 0 being "no skip").
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from .._ext import _row_format as _core

__all__ = [
    "STORAGES",
    "STORAGE_FORMATS",
    "StorageFormat",
    "ELEM_TYPES",
    "ROW_MODES",
    "DRAFTER_KINDS",
    "NONFINITE_POLICIES",
    "SKIP_REASONS",
    "FAIL_STAGES",
    "TRIM_CHUNK",
    "MAX_POSITION",
    "MAX_WINDOW",
    "MAX_FEATURE_DIM",
    "MAX_SEQS_LIMIT",
    "check_stager_options",
    "w_keep",
    "ring_rows",
]


@dataclass(frozen=True)
class StorageFormat:
    """How one storage lays out a row: ``block_elems`` elements per ``block_bytes``-byte block.

    ``block_elems`` is 1 for the float formats and 32 for q8_0 / q4_0 (GGML
    blocks: an fp16 scale then 32 int8 / 16 bytes of packed nibbles).
    """

    name: str
    code: int  #: the core's ``Storage`` value (snapshots record it)
    block_elems: int
    block_bytes: int

    @property
    def quantized(self) -> bool:
        return self.block_elems > 1

    def row_bytes(self, feature_dim: int) -> int:
        """Bytes of one row of ``feature_dim`` elements (the core's ``row_bytes``: a q
        format needs a positive multiple of ``block_elems``, else ConfigError)."""
        return int(_core.row_bytes(self.name, max(feature_dim, 0)))


#: Storage formats of the feature buffer, in the core's enum order.
STORAGES: tuple[str, ...] = tuple(_core.STORAGES)

#: Block geometry of each storage (name -> :class:`StorageFormat`).
STORAGE_FORMATS: Mapping[str, StorageFormat] = MappingProxyType(
    {
        name: StorageFormat(name, code, elems, nbytes)
        for code, (name, (elems, nbytes)) in enumerate(zip(STORAGES, _core.STORAGE_BLOCKS))
    }
)

#: What ``Stager.process`` does with NaN / Inf inputs (``StagerConfig.nonfinite``).
#: :func:`dspark_core.formats.quantize_rows` also accepts ``"keep"`` (convert as-is).
NONFINITE_POLICIES: tuple[str, ...] = tuple(_core.NONFINITE_POLICIES)

#: Why ``draft`` staged nothing (``StagePlan.skip``), in the order the core checks them.
SKIP_REASONS: tuple[str, ...] = tuple(_core.SKIP_REASONS)

#: Where a drafter round can fail: ``fail(seq, stage)``.
FAIL_STAGES: tuple[str, ...] = tuple(_core.FAIL_STAGES)

#: Element types rows come in (``process``) and are staged out in (``stage_dtype``).
ELEM_TYPES: tuple[str, ...] = tuple(_core.ELEM_TYPES)

#: Who holds the feature rows: the Stager ("held") or their owner ("external").
ROW_MODES: tuple[str, ...] = tuple(_core.ROW_MODES)

#: The drafters the rows serve: "block" (DSpark / DFlash: context rows and a
#: block of queries per round) and "chain" (EAGLE-3, EAGLE, MTP: each row with
#: the id of the token after it, one drafted token per step).
DRAFTER_KINDS: tuple[str, ...] = tuple(_core.DRAFTER_KINDS)

#: Head rows below the horizon are dropped this many at a time (off the per-round path).
TRIM_CHUNK: int = _core.TRIM_CHUNK
#: Positions and counts stay below this (so that ``pos + block`` never overflows int64).
MAX_POSITION: int = _core.MAX_POSITION
#: Upper bounds of a window and a row width (drafter positions are int32 in a
#: plan; the snapshot header stores them as u32).
MAX_WINDOW: int = _core.MAX_WINDOW
MAX_FEATURE_DIM: int = _core.MAX_FEATURE_DIM
#: Upper bound on ``max_seqs`` (a sanity limit, not a memory reservation).
MAX_SEQS_LIMIT: int = _core.MAX_SEQS_LIMIT

#: The core's derived sizes of a configuration ``(block_size, window)``: ``K``, the rows
#: a rebase keeps, and the rows a sequence ever holds (its ring's slots).
w_keep = _core.w_keep
ring_rows = _core.ring_rows

#: The core's check of a configuration: ConfigError naming the first unusable
#: value (codes are indices into the tables above).
check_stager_options = _core.check_stager_options


def _check() -> None:
    """The tables agree with the core's own row_bytes and hold distinct, usable names."""
    for what, names in (
        ("storages", STORAGES),
        ("element types", ELEM_TYPES),
        ("row modes", ROW_MODES),
        ("drafter kinds", DRAFTER_KINDS),
        ("non-finite policies", NONFINITE_POLICIES),
        ("skip reasons", SKIP_REASONS),
        ("fail stages", FAIL_STAGES),
    ):
        if not names or len(set(names)) != len(names) or not all(n.isidentifier() for n in names):
            raise ImportError(f"dspark_core: the core's {what} table is malformed: {names!r}")
    if len(_core.STORAGE_BLOCKS) != len(STORAGES):
        raise ImportError("dspark_core: the core's storage table and block table differ in length")
    for fmt in STORAGE_FORMATS.values():
        for n_blocks in (1, 3):
            dim = n_blocks * fmt.block_elems
            if fmt.block_bytes < 1 or fmt.row_bytes(dim) != n_blocks * fmt.block_bytes:
                raise ImportError(f"dspark_core: storage {fmt.name!r}: block table disagrees with row_bytes")
    # StagerConfig's default; "keep" is the conversion-only policy of formats.quantize_rows.
    if "error" not in NONFINITE_POLICIES or "keep" in NONFINITE_POLICIES:
        raise ImportError(f"dspark_core: unexpected non-finite policies {NONFINITE_POLICIES!r}")


_check()
