"""The ``dspark-core`` command: ``simulate`` (the main job), ``inspect``, ``capture``, ``fuzz``, ``kernels``.

Each subcommand lives in ``dspark_core.cli.<name>`` and provides
``add_parser(subparsers)``, which registers its parser with a ``run(args) -> int``
function as the ``func`` default.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Sequence

__all__ = ["main", "build_parser"]

#: Subcommands, in the order ``--help`` lists them.
COMMANDS = ("simulate", "inspect", "capture", "fuzz", "kernels")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered."""
    from .._version import __version__

    parser = argparse.ArgumentParser(
        prog="dspark-core",
        description="Drafter-staging core for capture-based speculative decoding.",
    )
    parser.add_argument("--version", action="version", version=f"dspark-core {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"dspark_core.cli.{name}").add_parser(sub)
    return parser


_GLOBAL_FLAGS = ("-v", "-vv", "-vvv", "--verbose")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``dspark-core``. Without a command it runs ``simulate``."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # Global flags first, then the command; no command (or only its options) means simulate.
    n_global = 0
    while n_global < len(args_list) and args_list[n_global] in _GLOBAL_FLAGS:
        n_global += 1
    rest = args_list[n_global:]
    if not rest or (rest[0].startswith("-") and rest[0] not in ("-h", "--help", "--version")):
        args_list = [*args_list[:n_global], "simulate", *rest]
    args = parser.parse_args(args_list)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
