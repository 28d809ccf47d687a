"""``dspark-core kernels``: the dispatch table of this machine.

First what the build compiled for CUDA (``build: CUDA kernels: ...``, the
line the build wrote into the package: :mod:`dspark_core.cuda.build_note`), then
for each kernel family of the core's registry (:mod:`dspark_core.kernels`):
the paths this CPU and build support, the best one, the active one (after
``DSPARK_SIMD``), and for each kernel the path whose code runs it. ``--json``
prints the same as one JSON object (``"build"``: the note, or null).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``kernels`` subcommand on ``subparsers``."""
    p = subparsers.add_parser(
        "kernels",
        help="show which instruction-set path each kernel runs on this machine",
        description="Print the runtime dispatch table: per kernel family its supported, best and active "
        "paths (DSPARK_SIMD forces them), and the path whose code runs each kernel.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
    return p


def table() -> dict[str, dict[str, Any]]:
    """Per family: its supported / best / active paths and the kernel table."""
    from .. import kernels

    return {
        family: {
            "supported": kernels.supported(family),
            "best": kernels.best(family),
            "active": kernels.active(family),
            "kernels": kernels_of,
        }
        for family, kernels_of in kernels.dispatch_table().items()
    }


#: Printed where the package holds no build note (a build from before the note was recorded).
NO_NOTE = "not recorded by this build"


def run(args: argparse.Namespace) -> int:
    from .. import kernels
    from ..cuda.build_note import build_note

    t = table()
    note = build_note()
    if args.json:
        print(json.dumps({"build": note, "env": {kernels.ENV: os.environ.get(kernels.ENV, "")}, "families": t},
                         indent=1))
        return 0
    print(f"build: {note or NO_NOTE}")
    print(f"{kernels.ENV}={os.environ.get(kernels.ENV, '')!r}")
    for family, row in t.items():
        print(f"{family}: supported {', '.join(row['supported'])}; best {row['best']}; active {row['active']}")
        for kernel, path in row["kernels"].items():
            print(f"  {kernel:<18} {path}")
    return 0
