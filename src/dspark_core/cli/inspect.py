"""``dspark-core inspect DRAFTER.gguf``: a drafter's metadata and its context plan.

Prints the metadata read from the drafter GGUF (block size, mask token, target
layers, trained range and where each came from) and the plan
:func:`~dspark_core.plan_context` derives from it (window, ``w_keep``, drafter
``n_ctx`` / ``n_batch`` / ``n_ubatch``, ``n_outputs_max``, peak feature-buffer
bytes), as an aligned table or, with ``--json``, as one JSON object
``{"drafter": {...}, "plan": {...}}``.

A bad file or setting prints one line to stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import logging
import json
import sys
from typing import Any

__all__ = ["add_parser", "run"]

_DEFAULT_N_BATCH = 2048  # llama.cpp's default -b


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``inspect`` subcommand on ``subparsers``."""
    from ..stager.config import STORAGES

    p = subparsers.add_parser(
        "inspect",
        help="show a drafter GGUF's metadata and the drafter context plan",
        description=(
            "Read a DSpark / DFlash drafter GGUF (metadata only, tensors are never loaded) "
            "and print its metadata and the context plan: the window W = min(n_ctx_train, n_batch) "
            "(lowered by --window-cap or DSPARK_WINDOW_CAP), w_keep, the drafter's n_ctx / n_batch / "
            "n_ubatch, n_outputs_max and the peak feature-buffer bytes."
        ),
    )
    p.add_argument("drafter", metavar="DRAFTER.gguf", help="the drafter GGUF file")
    p.add_argument("--target-ctx", type=int, default=None, metavar="N", help="the target's context size (n_ctx)")
    p.add_argument(
        "--n-batch", type=int, default=_DEFAULT_N_BATCH, metavar="N",
        help=f"the server's n_batch (default {_DEFAULT_N_BATCH})",
    )
    p.add_argument("--parallel", type=int, default=1, metavar="N", help="sequences / server slots (default 1)")
    p.add_argument("--storage", choices=STORAGES, default="f32", help="feature-buffer storage (default f32)")
    p.add_argument(
        "--n-ctx-train", type=int, default=None, metavar="N",
        help="override the drafter's trained context (wins over the GGUF keys)",
    )
    p.add_argument("--n-draft", type=int, default=None, metavar="N", help="draft length; must equal block_size")
    p.add_argument("--window-cap", type=int, default=None, metavar="N", help="lower the window to at most N")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``inspect``; returns the exit status (0, or 2 on a bad file or setting)."""
    from ..context_plan import format_table, plan_context
    from ..gguf.drafter_info import DrafterInfo

    # The report lists the metadata warnings itself: keep the logger from printing them twice.
    log = logging.getLogger("dspark_core")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        info = DrafterInfo.from_gguf(args.drafter, n_ctx_train=args.n_ctx_train, target_n_ctx=args.target_ctx)
        plan = plan_context(
            info,
            args.target_ctx,
            args.n_batch,
            n_parallel=args.parallel,
            storage=args.storage,
            n_draft=args.n_draft,
            window_cap=args.window_cap,
        )
    except (ValueError, OSError) as exc:  # ConfigError / DrafterMetadataError are ValueErrors
        msg = str(exc).replace("\n", " ")
        print(f"dspark-core inspect: error: {msg}", file=sys.stderr)
        return 2
    finally:
        log.setLevel(level)

    if args.json:
        out = {"drafter": info.to_dict(), "plan": plan.to_dict()}
        print(json.dumps(out, indent=2))
        return 0
    print(format_table(info.table_rows(), "drafter"))
    print()
    print(plan.format_table())
    for w in plan.warnings:
        print(f"\nwarning: {w}")
    return 0
