"""What ``dspark-core simulate``'s two workloads share: the defaults, the Stager and the rows' owner.

Its own module so that both commands take them from here: ``simulate`` (the
long workload and the parser) imports ``simulate_multiturn``, never the other
way round.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("dspark_core")

#: Embedded defaults: ``dspark-core simulate`` needs no arguments.
DEFAULTS: dict[str, Any] = {
    "context": 24000,
    "generate": 4000,
    "block": 8,
    "window": 512,
    "storage": "f32",
    "seqs": 1,
    "seed": 0,
    "feature_dim": 128,
    "deviation": 0.03,
    "prefill_chunk": 2048,
    "trained": None,  # the toy drafter's trained range; None: the window W
    "absolute_tokens": 64,
    "drafter": "dspark",
}

#: ``--drafter``: the toy drafter of each kind (a block drafter, DSpark / DFlash; a chain
#: drafter, EAGLE-3 / EAGLE / MTP) and the Stager kind it needs.
DRAFTERS: dict[str, str] = {"dspark": "block", "eagle3": "chain"}


_warned_fallback = False


def make_stager(kind: str, config: Any) -> tuple[Any, str]:
    """A Stager for ``config``: ``("core" | "reference")``; ``auto`` prefers the C++ core."""
    from ..reference import ReferenceStager

    if kind in ("auto", "core"):
        try:
            from .._ext._stager import Stager
        except ImportError as exc:
            if kind == "core":
                raise RuntimeError(f"the C++ core is not available ({exc})") from exc
            global _warned_fallback
            if not _warned_fallback:
                _warned_fallback = True
                logger.warning("C++ core not available (%s): using the pure-Python reference Stager", exc)
        else:
            return Stager(config), "core"
    return ReferenceStager(config), "reference"


def ring_owner(ring: str) -> str:
    """The owner ``--ring`` picks: ``"device"`` or ``"host"`` (``"auto"``: device when one is usable)."""
    if ring not in ("auto", "device", "host"):
        raise ValueError(f"ring must be 'auto', 'device' or 'host', got {ring!r}")
    if ring == "auto":
        from .. import cuda

        return "device" if cuda.available() else "host"
    return ring
