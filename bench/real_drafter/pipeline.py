"""The stages in order, each cached: capture, train, offline, live (what :mod:`run` calls).

Returns one JSON-able dict of everything measured: the drafters (with the metadata
``DrafterInfo.from_hf_config`` read back from each saved ``config.json``), per drafter
and mode the offline rounds and the live runs of every document, the checks and the
time of each stage.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

import capture as cap_stage
import corpus
import live_loop
import modes as md
import offline
import train as tr
from cache import Cache, key_of
from runtime import runtime_for
from vocab import Embedding

__all__ = ["run_pipeline", "drafter_id"]

log = logging.getLogger("real_drafter")

#: Version of the offline and live records (part of their cache keys).
RECORD_VERSION = 1


def drafter_id(kind: str, pos_kind: str, seed: int) -> str:
    return f"{kind}{'+abs' if pos_kind == 'rope+abs' else ''} s{seed}"


def _read_back(trained: tr.Trained) -> dict[str, Any]:
    """The saved config.json as ``DrafterInfo.from_hf_config`` reads it (checked against the drafter)."""
    from dspark_core import DrafterInfo

    c = trained.config
    info = DrafterInfo.from_hf_config(trained.path / "config.json",
                                      block_size=None if c.kind == "block" else c.block_size)
    got = {"kind": info.kind, "block_size": info.block_size, "n_ctx_train": info.n_ctx_train,
           "target_layers": list(info.target_layers), "feature_dim": info.feature_dim,
           "architecture": info.architecture}
    want = {"kind": c.kind, "block_size": c.block_size, "n_ctx_train": c.n_ctx_train,
            "target_layers": list(run_layers()), "feature_dim": c.feature_dim}
    got["matches"] = all(got[k] == v for k, v in want.items())
    return got


def run_layers() -> tuple[int, ...]:
    from run import LAYERS

    return LAYERS


def run_pipeline(model: str, cache_dir: Path, plan: Any, threads: int, live: bool = True) -> dict[str, Any]:
    """Every stage of ``plan`` (see :mod:`run`)."""
    from run import B, T, machine

    cache = Cache(cache_dir)
    layers = run_layers()
    result: dict[str, Any] = {"machine_start": machine(), "timings": {}, "T": T, "B": B, "layers": list(layers),
                              "threads": threads}
    timings = result["timings"]

    # 1. capture
    t0 = time.perf_counter()
    train_caps = cap_stage.capture(cache, model, layers, corpus.load(plan.train_docs), plan.train_tokens, threads)
    eval_caps = cap_stage.capture(cache, model, layers, corpus.load(plan.eval_docs), plan.eval_tokens, threads)
    timings["capture_s"] = time.perf_counter() - t0
    result["positions"] = {"train": int(sum(len(c.tokens) for c in train_caps)),
                           "eval": int(sum(len(c.tokens) for c in eval_caps))}
    emb = Embedding(model)

    # 2. train
    t0 = time.perf_counter()
    specs = [("block", "rope", s) for s in plan.seeds] + [("chain", "rope", s) for s in plan.seeds]
    specs.append(("block", "rope+abs", plan.seeds[0]))
    drafters: dict[str, tr.Trained] = {}
    result["drafters"] = {}
    for kind, pos_kind, seed in specs:
        steps = plan.block_steps if kind == "block" else plan.chain_steps
        s = tr.TrainSettings(kind=kind, pos_kind=pos_kind, T=T, block_size=B, steps=steps, seed=seed)
        trained = tr.train(cache, train_caps, emb, s, layers, Path(model).name)
        did = drafter_id(kind, pos_kind, seed)
        drafters[did] = trained
        meta = json.loads((trained.path / "train.json").read_text())
        result["drafters"][did] = {
            "kind": kind, "pos_kind": pos_kind, "seed": seed, "steps": steps, "train_s": trained.train_s,
            "key": trained.path.name, "draft_vocab": int(len(trained.d2t)), "label_coverage": meta["coverage"],
            "final_loss": float(np.mean([h[0] for h in meta["history"][-20:]])),
            "final_train_top1": float(np.mean([h[1] for h in meta["history"][-20:]])),
            "config_read_back": _read_back(trained),
        }
    timings["train_s"] = time.perf_counter() - t0

    # 3. offline
    t0 = time.perf_counter()
    offline.STRIDE = plan.offline_stride
    result["offline"] = {}
    n_max = max(len(c.tokens) for c in eval_caps)
    rows_checked = 0
    for did, trained in drafters.items():
        ms = md.OFFLINE if trained.config.kind == "block" and trained.config.pos_kind == "rope" else (
            md.LIVE if trained.config.pos_kind == "rope" else (md.ABSOLUTE, md.WINDOWED, md.MASKED))
        rt = runtime_for(trained, emb)
        result["offline"][did] = {}
        for mode in ms:
            rec = _offline_cached(cache, trained, eval_caps, rt, mode, n_max, plan.offline_stride)
            result["offline"][did][mode.name] = rec
            rows_checked += sum(d["rows_checked"] for d in rec)
        log.info("offline %s: %s", did, ", ".join(
            f"{m}: {100 * _agree(r):.1f}%" for m, r in result["offline"][did].items()))
    timings["offline_s"] = time.perf_counter() - t0
    result["offline_rows_checked"] = rows_checked

    # 4. live
    t0 = time.perf_counter()
    result["live"] = {}
    if live:
        live_ids = [d for d in drafters if drafters[d].config.pos_kind == "rope"]
        docs = eval_caps[: plan.live_docs]
        depths = [b * T + T // 8 for b in plan.live_buckets]
        engine = prefill = None
        try:
            for i, cap in enumerate(docs):
                external = i % 2 == 1
                key_base = {"capture": cap.key, "depths": depths, "G": plan.generate, "external": external,
                            "threads": threads, "version": RECORD_VERSION}
                todo = [(d, m) for d in live_ids for m in md.LIVE
                        if not cache.done("live", key_of({**key_base, "drafter": drafters[d].path.name, "mode": m.name}))]
                probes = None
                if todo:
                    if engine is None:
                        n_ctx = n_max + plan.generate + 2 * B + 8
                        prefill = cap_stage.open_target(model, layers, n_ctx, threads, verify_max=B + 1)
                        # one token per ubatch: verify rows bit-equal to one-token decodes (live_loop)
                        engine = cap_stage.open_target(prefill.llama, layers, n_ctx, threads, verify_max=B + 1,
                                                       n_ubatch=1)
                    tp = time.perf_counter()
                    probes = live_loop.prepare_probes(prefill, engine, cap, depths, plan.generate)
                    log.info("live %s: prefilled to %s in %.0f s", cap.name, depths, time.perf_counter() - tp)
                for did in live_ids:
                    rt = runtime_for(drafters[did], emb)
                    for mode in md.LIVE:
                        k = key_of({**key_base, "drafter": drafters[did].path.name, "mode": mode.name})
                        recs = _live_cached(cache, k, engine, probes, rt, mode, n_max, external)
                        result["live"].setdefault(did, {}).setdefault(mode.name, []).extend(recs)
                log.info("live %s (%s rows) done: %.0f s so far", cap.name, "external" if external else "held",
                         time.perf_counter() - t0)
        finally:
            for e in (engine, prefill):
                if e is not None:
                    e.close()
    timings["live_s"] = time.perf_counter() - t0

    # checks
    runs = [r for per in result["live"].values() for recs in per.values() for r in recs]
    result["checks"] = {
        "live_runs": len(runs), "live_lossless": sum(r["lossless"] for r in runs),
        "live_rows_checked": int(sum(r["rows_checked"] for r in runs)),
        "offline_rows_checked": rows_checked,
        "configs_read_back": all(d["config_read_back"]["matches"] for d in result["drafters"].values()),
    }
    c = result["checks"]
    c["ok"] = bool(c["live_lossless"] == c["live_runs"] and c["configs_read_back"])
    return result


def _agree(recs: list[dict[str, Any]]) -> float:
    return sum(float(np.sum(d["agree"])) for d in recs) / max(1, sum(len(d["depth"]) * d["B"] for d in recs))


def _offline_cached(cache: Cache, trained: tr.Trained, caps: list[cap_stage.Captured], rt: Any, mode: md.Mode,
                    n_max: int, stride: int) -> list[dict[str, Any]]:
    inputs = {"drafter": trained.path.name, "captures": [c.key for c in caps], "mode": asdict(mode),
              "stride": stride, "n_max": n_max, "version": RECORD_VERSION}
    key = key_of(inputs)
    if cache.done("offline", key):
        return json.loads((cache.dir("offline", key) / "records.json").read_text())
    d = cache.fresh("offline", key, inputs)
    recs = []
    for cap in caps:
        r = offline.evaluate(cap, rt, mode, trained.config.n_ctx_train, n_max)
        m = r.match
        prefix = np.cumprod(m, axis=1).sum(axis=1)  # leading drafts equal to the labels
        recs.append({"doc": r.doc, "depth": r.depth.tolist(), "agree": m.sum(1).tolist(), "prefix": prefix.tolist(),
                     "B": int(m.shape[1]), "rows_checked": r.rows_checked, "rebases": r.rebases,
                     "drafter_s": r.drafter_s, "rounds": r.rounds, "max_position": r.max_position})
    (d / "records.json").write_text(json.dumps(recs))
    cache.finish("offline", key)
    return recs


def _live_cached(cache: Cache, key: str, engine: Any, probes: Any, rt: Any, mode: md.Mode, n_max: int,
                 external: bool) -> list[dict[str, Any]]:
    if cache.done("live", key):
        return json.loads((cache.dir("live", key) / "records.json").read_text())
    from run import T

    d = cache.fresh("live", key, {"key": key})
    recs = []
    for probe in probes:
        r = live_loop.run_probe(engine, probe, rt, mode, T, n_max, external)
        if not r.lossless:
            log.error("live %s at %d, %s: output diverges from the greedy decode at token %s",
                      r.doc, r.depth, mode.name, r.first_divergence)
        before = r.rounds_n_past - r.rounds_accepted - 1  # each round's start
        recs.append({"doc": r.doc, "depth": r.depth, "lossless": r.lossless, "first_divergence": r.first_divergence,
                     "start": before.tolist(), "accepted": r.rounds_accepted.tolist(),
                     "drafted": r.rounds_drafted.tolist(), "drafter_s": r.drafter_s, "loop_s": r.loop_s,
                     "rows_checked": r.rows_checked, "rebases": r.rebases, "max_drafter_pos": r.max_drafter_pos,
                     "rows_mode": r.rows_mode, "greedy_s": probe.greedy_s, "generated": int(len(probe.greedy))})
    (d / "records.json").write_text(json.dumps(recs))
    cache.finish("live", key)
    return recs
