"""``dspark-core fuzz``: fuzz the C++ core against the pure-Python reference.

The same as ``python -m dspark_core.testing.fuzz`` (see :mod:`dspark_core.testing.fuzz`):
``--target ops|threads|snapshot|decode``, ``--runs N``, ``--max-time S``,
``--corpus DIR``, and ``CRASH_FILE...`` to replay inputs (no atheris needed)
with a readable op trace. Fuzzing itself needs atheris
(``pip install dspark_core[fuzz]``).
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``fuzz`` subcommand on ``subparsers``."""
    p = subparsers.add_parser(
        "fuzz",
        help="fuzz the C++ core against the reference (atheris), or replay crash files",
        description=(
            "Coverage-guided fuzzing (atheris) of the C++ core against the pure-Python reference: "
            "byte strings decode to Stager call sequences (target ops), snapshot bytes (snapshot) "
            "or stored rows (decode); every result is compared and the invariants are checked. "
            "With CRASH_FILE arguments the inputs are replayed without atheris and the op trace is printed. "
            "Exit status 1 on a finding."
        ),
    )
    from ..testing.fuzz import build_parser

    build_parser(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``fuzz``; returns the exit status."""
    from ..testing.fuzz import run as fuzz_run

    return fuzz_run(args)
