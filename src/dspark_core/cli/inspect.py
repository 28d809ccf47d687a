"""``dspark-core inspect DRAFTER``: a drafter's metadata and its context plan.

DRAFTER is a drafter GGUF, or a Hugging Face ``config.json`` (or the model
directory holding it: EAGLE-3, EAGLE and MTP chain drafters, DFlash / DSpark
block drafters; a chain drafter needs ``--block-size``, the tokens a round
drafts). Prints the metadata read from it (kind, block size, mask token, target
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
        help="show a drafter's metadata (GGUF or config.json) and the drafter context plan",
        description=(
            "Read a DSpark / DFlash drafter GGUF (metadata only, tensors are never loaded), or a drafter's "
            "Hugging Face config.json or model directory (EAGLE-3, EAGLE, MTP, DFlash, DSpark), "
            "and print its metadata and the context plan: the window W = min(n_ctx_train, n_batch) "
            "(lowered by --window-cap or DSPARK_WINDOW_CAP), w_keep, the drafter's n_ctx / n_batch / "
            "n_ubatch, n_outputs_max and the peak feature-buffer bytes."
        ),
    )
    p.add_argument("drafter", metavar="DRAFTER",
                   help="the drafter GGUF file, or its config.json (or the directory holding it)")
    p.add_argument("--block-size", type=int, default=None, metavar="B",
                   help="tokens a round drafts: required for a chain drafter's config.json (EAGLE-3, EAGLE, MTP: "
                        "the server's num_speculative_tokens); overrides a block drafter's config")
    p.add_argument("--target-ctx", type=int, default=None, metavar="N", help="the target's context size (n_ctx)")
    p.add_argument(
        "--n-batch", type=int, default=_DEFAULT_N_BATCH, metavar="N",
        help=f"the server's n_batch (default {_DEFAULT_N_BATCH})",
    )
    p.add_argument("--parallel", type=int, default=1, metavar="N", help="sequences / server slots (default 1)")
    p.add_argument("--storage", choices=STORAGES, default="f32", help="feature-buffer storage (default f32)")
    p.add_argument(
        "--n-ctx-train", type=int, default=None, metavar="N",
        help="override the drafter's trained context (wins over the GGUF keys and max_position_embeddings)",
    )
    p.add_argument("--n-draft", type=int, default=None, metavar="N", help="draft length; must equal block_size")
    p.add_argument("--window-cap", type=int, default=None, metavar="N", help="lower the window to at most N")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)
    return p


def _is_hf_config(path: str) -> bool:
    """A config.json (or a directory, which holds one), not a GGUF file."""
    import os

    return os.path.isdir(path) or path.endswith(".json")


def run(args: argparse.Namespace) -> int:
    """Run ``inspect``; returns the exit status (0, or 2 on a bad file or setting)."""
    from ..context_plan import format_table, plan_context
    from ..gguf.drafter_info import DrafterInfo

    # The report lists the metadata warnings itself: keep the logger from printing them twice.
    log = logging.getLogger("dspark_core")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        if _is_hf_config(args.drafter):
            info = DrafterInfo.from_hf_config(args.drafter, block_size=args.block_size, n_ctx_train=args.n_ctx_train,
                                              target_n_ctx=args.target_ctx)
        elif args.block_size is not None:
            raise ValueError("--block-size is for a config.json: a GGUF drafter states its block_size")
        else:
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
