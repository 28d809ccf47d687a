"""dspark_core: drafter staging for capture-based speculative decoding.

The package keeps a target model's captured feature rows in a compact
per-sequence buffer, stages them for a DSpark / DFlash block drafter inside
the positions it was trained on (windowing and rebasing), recovers from
drafter failures without losing its window, and converts rows between f32,
f16, bf16, q8_0 and q4_0 bit-exactly with ggml.

Layers: a C++ core (``csrc/``) -> Cython bindings (``_stager``,
``_row_format``) -> this Python layer (config, metadata, loop, CLI). The
pure-Python twin :class:`dspark_core.reference.ReferenceStager` implements
the same protocol and is the test oracle.
"""

from __future__ import annotations

from . import _old_paths
from ._ext._stager import PrefixStore, Stager
from .stager.config import TRIM_CHUNK, StagerConfig
from .stager.core_tables import FAIL_STAGES, NONFINITE_POLICIES, SKIP_REASONS, STORAGE_FORMATS, STORAGES, StorageFormat
from .context_plan import ContextPlan, plan_context
from .gguf.drafter_info import DrafterInfo, DrafterMetadataError
from .errors import ConfigError, StateError
from .formats import dequantize_rows, quantize_rows, row_bytes
from .prefix.host_table import HostPrefixTable
from .rows.host_ring import HostRing
from .sdk import get_cmake_dir, get_include, get_library_dir
from .stager.stage_plan import BatchPlan, StagePlan
from .prefix.hit import PrefixHit, PrefixMoves
from ._version import __version__

_old_paths.install()  # dspark_core.loop & co. (the flat layout's paths) still import, with a warning

__all__ = [
    "__version__",
    "Stager",
    "StagerConfig",
    "PrefixStore",
    "PrefixHit",
    "PrefixMoves",
    "StagePlan",
    "BatchPlan",
    "ConfigError",
    "StateError",
    "TRIM_CHUNK",
    "STORAGES",
    "STORAGE_FORMATS",
    "StorageFormat",
    "NONFINITE_POLICIES",
    "SKIP_REASONS",
    "FAIL_STAGES",
    "quantize_rows",
    "dequantize_rows",
    "row_bytes",
    "HostRing",
    "HostPrefixTable",
    "DrafterInfo",
    "DrafterMetadataError",
    "ContextPlan",
    "plan_context",
    "get_include",
    "get_library_dir",
    "get_cmake_dir",
]
