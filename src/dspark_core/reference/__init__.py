"""The pure-Python twin of the C++ core: the test oracle.

:class:`ReferenceStager` implements the staging contract (docs/design.md
section 2) in plain Python and numpy, :class:`ReferencePrefixStore` the
prefix store (docs/prefix_cache.md); :mod:`dspark_core.reference.formats`
encodes and decodes rows with gguf-py and ml_dtypes, independently of the
core's conversion code.
"""

from __future__ import annotations

from . import formats
from .seq import SEMANTIC_STATS
from .stager import FAIL_STAGES, ReferenceStager, logger
from .prefix_store import SEMANTIC_PREFIX_STATS, ReferencePrefixStore

__all__ = ["ReferenceStager", "FAIL_STAGES", "SEMANTIC_STATS", "formats", "logger", "ReferencePrefixStore",
           "SEMANTIC_PREFIX_STATS"]
