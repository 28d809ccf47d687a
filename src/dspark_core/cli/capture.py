"""``dspark-core capture --target MODEL.gguf``: a speculative session on a real llama.cpp target.

The target is a real model run by llama.cpp (through llama-cpp-python, the
optional extra ``pip install 'dspark_core[llama-cpp]'``); the feature rows are
its captured hidden states at the tap layers
(:class:`~dspark_core.engines.llama_cpp.LlamaCppCapture`). The session runs
greedy speculative decoding through :class:`~dspark_core.sim.loop.SpeculativeLoop`
with windowed staging (f32 storage); the drafter is a stand-in fed with the
staged rows (:class:`~dspark_core.engines.standin_drafter.LookupDrafter`:
there is no trained drafter for an arbitrary target, so acceptance only says
how repetitive the text is). The command then:

* checks every staged row against the captured row of its position (bit for
  bit in f32) and replays the recorded session on every other storage,
  checking each staged row against the CPU encode of the captured row;
* compares the output with the engine's own plain greedy decode (prefill in
  ``n_batch`` chunks, then one token per decode) and reports the first
  divergence, if any: verify batches evaluate B + 1 tokens at once and
  llama.cpp's numerics depend slightly on batch shape;
* times that greedy decode twice on the same weights, on a context with the
  capture callback and on one without, and reports the capture overhead;
* prints the massive-activation figures of the captured rows and what each
  storage does with them under each non-finite policy (computed by staging
  them, not assumed).

Before loading the model it checks the engine build: a llama-cpp-python built
with the host's native CPU flags on a CPU with AMX segfaults in its first
decode of some models (:func:`~dspark_core.engines.llama_cpp.crash_prone_build`).
When that is the case (``--engine-check auto``, the default; ``always`` checks
any build) the first decode runs in a child process first, and a crash there
is reported with the fix (rebuild with ``CMAKE_ARGS="-DGGML_NATIVE=OFF"``)
instead of killing the command without a word.

Exit status: 0 when every check passed (a divergence from plain greedy is
reported, not a failure), 1 when a staged row or plan was wrong, 2 for a bad
option, a missing llama-cpp-python, an unreadable model or an engine build
that crashes.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import math
import os
import sys
import time
from importlib import resources
from typing import Any, Callable

import numpy as np

__all__ = ["add_parser", "run", "capture_session", "check_engine", "format_report", "DEFAULTS", "ENGINE_CHECKS", "prompt_tokens"]

logger = logging.getLogger("dspark_core")

DEFAULTS: dict[str, Any] = {
    "context": 2000,
    "generate": 300,
    "block": 8,
    "window": 512,
    "n_batch": 512,
}


#: ``--engine-check`` modes: probe the first decode in a child process when the build is
#: known to crash on this CPU, always, or never.
ENGINE_CHECKS = ("auto", "always", "never")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``capture`` subcommand on ``subparsers``."""
    d = DEFAULTS
    p = subparsers.add_parser(
        "capture",
        help="run a speculative session on a real llama.cpp model, staging its captured hidden states",
        description=(
            "Run greedy speculative decoding with a real llama.cpp target (needs llama-cpp-python: "
            "pip install 'dspark_core[llama-cpp]'): capture the target's hidden states at the tap layers, "
            "stage them through the Stager with windowing, check every staged row against the captured row "
            "(f32 bit for bit; the other storages by replaying the session against the CPU encode), compare "
            "the output with the engine's plain greedy decode, time the capture callback, and report the "
            "rows' massive activations and what each storage and non-finite policy does with them."
        ),
    )
    p.add_argument("--target", required=True, metavar="MODEL.gguf", help="the target model (a llama.cpp GGUF)")
    p.add_argument("--layers", default=None, metavar="L1,L2,...",
                   help="tap layers, l_out indices in drafter order (default: --drafter's, else 2, n_layer/2, n_layer-3)")
    p.add_argument("--drafter", default=None, metavar="DRAFTER.gguf",
                   help="take the tap layers and block size from a drafter GGUF's metadata")
    p.add_argument("--layer-shift", type=int, default=0, metavar="N",
                   help="subtract N from --drafter's layer ids (1 for files storing hidden_states indices)")
    p.add_argument("--prompt-file", default=None, metavar="FILE.txt",
                   help="prompt text, repeated until --context tokens (default: a bundled English essay)")
    p.add_argument("--context", type=int, default=d["context"], metavar="N", help=f"prompt tokens (default {d['context']})")
    p.add_argument("--generate", type=int, default=d["generate"], metavar="N",
                   help=f"tokens to generate (default {d['generate']})")
    p.add_argument("--block", type=int, default=None, metavar="B",
                   help=f"drafter block size (default: --drafter's, else {d['block']})")
    p.add_argument("--window", type=int, default=d["window"], metavar="W",
                   help=f"drafter window, positions [0, W) (default {d['window']})")
    p.add_argument("--n-batch", type=int, default=d["n_batch"], metavar="N",
                   help=f"tokens per llama_decode: prefill chunk size (default {d['n_batch']})")
    p.add_argument("--threads", type=int, default=None, metavar="N", help="CPU threads (default: all available)")
    p.add_argument("--stager", choices=("auto", "core", "reference"), default="auto",
                   help="Stager implementation (default auto: the C++ core if built)")
    p.add_argument("--engine-check", choices=ENGINE_CHECKS, default="auto",
                   help="run llama.cpp's first decode in a child process before the session, so that an engine "
                        "build that crashes is reported with its fix: auto (default) when the build is known to "
                        "crash on this CPU (native AMX kernels), always, or never")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=run)
    return p


# ----------------------------------------------------------------------------
# the session


def prompt_tokens(engine: Any, n: int, text: str | None = None) -> list[int]:
    """``n`` tokens of ``text`` (default: the bundled essay), BOS first, the text repeated as needed."""
    if text is None:
        text = resources.files("dspark_core.engines").joinpath("sample_text.txt").read_text(encoding="utf-8")
    if not text.strip():
        raise ValueError("the prompt text is empty")
    toks = engine.tokenize(text, add_bos=True)
    body = engine.tokenize("\n\n" + text, add_bos=False)
    while len(toks) < n:
        toks += body
    return toks[:n]


def greedy_lockstep(plain: Any, cap: Any, prompt: list[int], n_generate: int) -> dict[str, Any]:
    """The engine's own greedy decode on two contexts sharing the weights, step by step:
    ``plain`` (no callback) and ``cap`` (capturing). Prefill in ``n_batch`` chunks, then one
    token per decode; each chunk / token runs on both contexts back to back, so load changes on
    the machine hit both timings alike. Returns both token streams, per-step times and the rows."""
    plain.reset()
    cap.reset()
    nb = cap.n_batch
    n_pre = len(prompt)
    rows = np.empty((n_pre + n_generate - 1, cap.feature_dim), np.float32)
    t_pre = np.zeros((2, -(-n_pre // nb)))
    nxt = [0, 0]
    for j, lo in enumerate(range(0, n_pre, nb)):
        chunk = prompt[lo : lo + nb]
        for k, eng in enumerate((plain, cap)):
            t0 = time.perf_counter()
            r = eng.evaluate(chunk, logits="last", out=rows[lo : lo + len(chunk)] if k else None)
            t_pre[k, j] = time.perf_counter() - t0
            nxt[k] = int(r.next_tokens[-1])
    toks = [[nxt[0]], [nxt[1]]]
    t_dec = np.zeros((2, n_generate - 1))
    for i in range(n_generate - 1):
        for k, eng in enumerate((plain, cap)):
            t0 = time.perf_counter()
            r = eng.evaluate([toks[k][-1]], logits="all", out=rows[n_pre + i : n_pre + i + 1] if k else None)
            t_dec[k, i] = time.perf_counter() - t0
            toks[k].append(int(r.next_tokens[0]))
    return {
        "plain_tokens": np.asarray(toks[0], np.int64), "capture_tokens": np.asarray(toks[1], np.int64),
        "prefill_s": t_pre.sum(axis=1), "decode_s": t_dec.sum(axis=1),
        "decode_step_ms": 1e3 * np.median(t_dec, axis=1) if n_generate > 1 else np.zeros(2),
        "decode_overhead_ms": 1e3 * float(np.median(t_dec[1] - t_dec[0])) if n_generate > 1 else 0.0,
        "rows": rows,
    }


def check_engine(target: str, mode: str = "auto", *, threads: int | None = None,
                 say: Callable[[str], None] = lambda s: None) -> str | None:
    """The engine-build check of ``--engine-check`` (see the module docstring).

    Returns why the build is known to crash on this CPU (None when it is not).

    Raises:
        ImportError: llama-cpp-python is missing.
        FileNotFoundError: no model at ``target`` (when a first decode is probed).
        EngineCrash: the first decode, in a child process, was killed by a signal.
    """
    from ..engines.llama_cpp import (
        EngineCrash, cpu_flags, crash_message, crash_prone_build, probe_first_decode, system_info,
    )

    if mode not in ENGINE_CHECKS:
        raise ValueError(f"engine check must be one of {ENGINE_CHECKS}, got {mode!r}")
    if mode == "never":
        return None
    reason = crash_prone_build(cpu_flags(), system_info())  # needs llama_cpp: ImportError first
    if mode == "auto" and reason is None:
        return None
    if not os.path.isfile(target):
        raise FileNotFoundError(f"no model file at {target}")
    say("first decode in a child process (" + ("this engine build is known to crash on this CPU)" if reason
                                              else "--engine-check always)"))
    probe = probe_first_decode(target, n_threads=threads)
    if probe.crashed:
        raise EngineCrash(crash_message(target, probe, reason))
    if probe.returncode is None:
        logger.warning("the engine check's first decode timed out in its child process; going on without it")
    elif probe.returncode == 0 and reason:
        logger.warning("%s; this build's first decode survived in a child process, so the session goes on", reason)
    return reason


def _first_divergence(a: np.ndarray, b: np.ndarray) -> int | None:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    if len(diff):
        return int(diff[0])
    return None if len(a) == len(b) else n


def _policies() -> tuple[str, ...]:
    """The Stager's non-finite policies, the ones that keep the most of a row first."""
    from ..stager.config import NONFINITE_POLICIES

    first = [p for p in ("error", "clamp") if p in NONFINITE_POLICIES]
    return (*first, *(p for p in NONFINITE_POLICIES if p not in first))


def _outcome_rows(rows: np.ndarray, prompt_len: int, n: int) -> np.ndarray:
    """Up to ``n`` rows for the storage x policy table: BOS, each layer's largest row, ordinary rows."""
    a = np.abs(rows[:prompt_len])
    pick = [0, int(np.argmax(a.max(axis=1)))]
    pick += [int(i) for i in np.linspace(1, prompt_len - 1, n, dtype=np.int64)]
    seen: list[int] = []
    for i in pick:
        if i not in seen:
            seen.append(i)
    return rows[np.asarray(seen[:n])]


def capture_session(
    *,
    target: str,
    layers: tuple[int, ...] | None = None,
    drafter: str | None = None,
    layer_shift: int = 0,
    prompt_text: str | None = None,
    context: int = DEFAULTS["context"],
    generate: int = DEFAULTS["generate"],
    block: int | None = None,
    window: int = DEFAULTS["window"],
    n_batch: int = DEFAULTS["n_batch"],
    threads: int | None = None,
    stager: str = "auto",
    engine_check: str = "auto",
    say: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
    """Run the whole command and return its results (what ``--json`` prints).

    Raises:
        ImportError: llama-cpp-python is missing.
        ValueError / ConfigError: settings that cannot work.
        EngineCrash: the engine build crashes in its first decode (:func:`check_engine`).
        StagingMismatch: a staged row or plan is wrong (a bug).
    """
    from ..stager.config import STORAGES, StagerConfig
    from ..gguf.drafter_info import DrafterInfo
    from ..engines.activations import massive_activations, storage_outcomes
    from ..engines.checked_stager import CheckedStager, replay
    from ..engines.llama_cpp import LlamaCppCapture, default_tap_layers, load_llama, tap_layers_from
    from ..engines.standin_drafter import LookupDrafter
    from ..sim.loop import SpeculativeLoop
    from .simulate_setup import make_stager

    if context < 2 or generate < 1:
        raise ValueError("--context must be >= 2 and --generate >= 1")
    t_start = time.perf_counter()
    info = None
    if drafter is not None:
        info = DrafterInfo.from_gguf(drafter)
        if layers is None:
            layers = tap_layers_from(info, layer_shift)
        if block is None:
            block = int(info.block_size)
    block = DEFAULTS["block"] if block is None else block
    check_engine(target, engine_check, threads=threads, say=say)
    say(f"loading {target}")
    llm = load_llama(target, n_threads=threads)
    n_ctx = context + generate + block + 2
    common = dict(n_ctx=n_ctx, n_batch=n_batch, n_threads=threads, verify_max=block + 1)
    plain = LlamaCppCapture(llm, (), **common)  # type: ignore[arg-type]
    if layers is None:
        layers = default_tap_layers(plain.n_layer)
    cap = LlamaCppCapture(llm, layers, **common)  # type: ignore[arg-type]
    D, E = cap.feature_dim, cap.n_embd
    if info is not None and info.feature_dim is not None and info.feature_dim != D:
        raise ValueError(
            f"the drafter reads rows of {info.feature_dim} values, but {len(cap.layers)} tap layers of this "
            f"target's n_embd {E} give {D}: wrong target, or wrong --layer-shift"
        )
    prompt = prompt_tokens(cap, context, prompt_text)

    # 1. the engine's own greedy decode, without and with the capture callback (same weights, same shapes)
    say("plain greedy decode, with and without the capture callback (lockstep)")
    g = greedy_lockstep(plain, cap, prompt, generate)
    plain.close()
    greedy_tokens = g["plain_tokens"]

    # 2. the speculative session: real target, real rows, windowed f32 staging, every staged row checked
    cfg = StagerConfig(D, block, window, storage="f32")
    inner, kind = make_stager(stager, cfg)
    checked = CheckedStager(inner)
    draft_model = LookupDrafter(lambda: cap.tokens, D, block)
    loop = SpeculativeLoop(checked, draft_model, cap, prefill_chunk=n_batch, use_draft_many=False)
    say("speculative session")
    cap.reset()
    t0 = time.perf_counter()
    res = loop.run([prompt], generate)
    session_s = time.perf_counter() - t0
    seq = res.sequences[0]
    stats = checked.stats(0)

    # 3. every other storage replays the recorded session (the first policy that accepts the rows)
    say("replaying the session on every storage")
    replays = [{
        "storage": "f32", "nonfinite": cfg.nonfinite, "row_bytes": cfg.row_bytes, "rejected": [],
        "staged_rows_checked": checked.staged_rows_checked, "rebases": int(stats["rebases"]),
        "staged_rows": int(stats["staged_rows"]), "peak_rows": seq.peak_rows,
        "peak_bytes": seq.peak_rows * cfg.row_bytes,
    }]
    for storage in STORAGES[1:]:
        rejected = []
        for policy in _policies():
            st, _ = make_stager(stager, cfg.replace(storage=storage, nonfinite=policy))
            try:
                r = replay(checked.trace, st)
            except ValueError as exc:
                rejected.append({"nonfinite": policy, "error": str(exc)})
                continue
            replays.append({**r.__dict__, "rejected": rejected})
            break
        else:
            replays.append({"storage": storage, "nonfinite": None, "rejected": rejected})

    # 4. massive activations of the captured rows, and what each storage x policy does with them
    rows = g["rows"]
    acts = massive_activations(rows, cap.layers, E)
    sample = _outcome_rows(rows, context, 32)
    small_w = max(2 * block + 1, len(sample) + block + 1)

    def fresh(storage: str, policy: str) -> Any:
        return make_stager(stager, StagerConfig(D, block, small_w, storage=storage, nonfinite=policy))[0]

    outcomes = storage_outcomes(sample, fresh, STORAGES, _policies())

    n_gen = len(greedy_tokens)
    result: dict[str, Any] = {
        "config": {
            "target": os.path.basename(target), "n_layer": cap.n_layer, "n_embd": E, "layers": list(cap.layers),
            "feature_dim": D, "context": context, "generate": generate, "block": block, "window": window,
            "n_batch": n_batch, "threads": cap.n_threads, "stager": kind,
        },
        "session": {
            "rows_captured": int(sum(len(c[3]) for c in checked.trace if c[0] == "process")),
            "rounds": seq.rounds, "skips": sum(seq.skips.values()), "acceptance": seq.acceptance,
            "tokens_per_round": len(seq.tokens) / max(1, seq.rounds + sum(seq.skips.values())),
            "rebases": int(stats["rebases"]), "staged_rows": int(stats["staged_rows"]),
            "staged_rows_checked": checked.staged_rows_checked, "max_drafter_pos": seq.max_drafter_pos,
            "peak_rows": seq.peak_rows, "wall_s": session_s,
            "drafter_rows_consumed": draft_model.rows_consumed,
        },
        "greedy": {
            "tokens": n_gen,
            "callback_changes_tokens": not np.array_equal(greedy_tokens, g["capture_tokens"]),
            "session_first_divergence": _first_divergence(seq.tokens, greedy_tokens),
            "session_matching_tokens": int(np.sum(seq.tokens[:n_gen] == greedy_tokens[: len(seq.tokens)])),
            "plain_prefill_s": float(g["prefill_s"][0]), "capture_prefill_s": float(g["prefill_s"][1]),
            "plain_decode_s": float(g["decode_s"][0]), "capture_decode_s": float(g["decode_s"][1]),
            "plain_decode_step_ms": float(g["decode_step_ms"][0]),
            "capture_decode_step_ms": float(g["decode_step_ms"][1]),
            "decode_overhead_ms": g["decode_overhead_ms"],
            "callback_copy_s": cap.callback_s,
        },
        "storages": replays,
        "activations": [a.__dict__ for a in acts],
        "outcome_rows": len(sample),
        "outcomes": [o.__dict__ for o in outcomes],
        "text_tail": cap.detokenize(greedy_tokens[-40:]),
    }
    result["wall_s"] = time.perf_counter() - t_start
    cap.close()
    return result


# ----------------------------------------------------------------------------
# output


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    ws = [max(len(head[i]), *(len(r[i]) for r in rows)) for i in range(len(head))]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, ws)))  # noqa: E731
    return [line(head), "-" * (sum(ws) + 2 * (len(ws) - 1)), *(line(r) for r in rows)]


def format_report(r: dict[str, Any]) -> str:
    """The human-readable report of :func:`capture_session`'s result."""
    c, s, g = r["config"], r["session"], r["greedy"]
    ctx, gen = c["context"], c["generate"]
    L = []
    L.append(
        f"dspark-core capture: {c['target']} (n_layer {c['n_layer']}, n_embd {c['n_embd']}), tap layers "
        f"{','.join(map(str, c['layers']))} -> D={c['feature_dim']}; {ctx:,}-token prompt + {gen:,} generated, "
        f"block B={c['block']}, window W={c['window']}, n_batch {c['n_batch']}, {c['threads']} threads, Stager: {c['stager']}"
    )
    L.append("")
    L.append("speculative session (real target, captured rows, windowed f32 staging, stand-in lookup drafter)")
    L += [
        f"  rows captured                     {s['rows_captured']:,} (prefill {ctx:,} + verify batches of B+1)",
        f"  drafter rounds / skips            {s['rounds']:,} / {s['skips']:,}"
        f"   acceptance {100 * s['acceptance']:.1f}%, {s['tokens_per_round']:.2f} tokens / round",
        f"  rebases                           {s['rebases']:,}",
        f"  staged rows                       {s['staged_rows']:,} (largest drafter position {s['max_drafter_pos']})",
        f"  staged rows == captured rows      {s['staged_rows_checked']:,} of {s['staged_rows']:,} checked, bit for bit (f32)",
        f"  session time                      {s['wall_s']:.1f} s",
    ]
    div = g["session_first_divergence"]
    L.append(
        "  output vs plain greedy decode     "
        + ("identical, all {:,} tokens".format(g["tokens"]) if div is None else
           f"DIVERGES at generated token {div} ({g['session_matching_tokens']} of {g['tokens']} tokens equal): "
           "verify batches of B+1 tokens round differently from single-token decodes")
    )
    L.append("")
    ntok = g["tokens"]
    pre_o = (g["capture_prefill_s"] - g["plain_prefill_s"]) / ctx
    dec_o = g["decode_overhead_ms"]
    L.append("capture overhead (the engine's greedy decode on two contexts sharing the weights, without and with the")
    L.append("capture callback, each chunk / token on both back to back; tokens compared step by step)")
    L += ["  " + x for x in _table(
        ["", "without", "with capture", "overhead / token"],
        [
            [f"prefill, {ctx:,} tokens (total)", f"{g['plain_prefill_s']:.2f} s", f"{g['capture_prefill_s']:.2f} s",
             f"{1e6 * pre_o:+.0f} us ({100 * (g['capture_prefill_s'] / g['plain_prefill_s'] - 1):+.1f}%)"],
            [f"decode, {ntok - 1:,} x 1 token (median)", f"{g['plain_decode_step_ms']:.1f} ms",
             f"{g['capture_decode_step_ms']:.1f} ms",
             f"{1e3 * dec_o:+.0f} us ({100 * dec_o / g['plain_decode_step_ms']:+.1f}%)"],
        ],
    )]
    L.append(f"  row copies inside the callback: {1e3 * g['callback_copy_s']:.1f} ms in all; "
             f"tokens with vs without the callback: {'DIFFERENT' if g['callback_changes_tokens'] else 'identical'}")
    L.append("")
    L.append("every storage (the recorded session replayed; staged rows checked against the CPU encode of the captured row)")
    rows = []
    for st in r["storages"]:
        if st.get("nonfinite") is None:
            rows.append([st["storage"], "all rejected", "-", "-", "-", "-"])
            continue
        pol = st["nonfinite"] + (" (" + ", ".join(x["nonfinite"] for x in st["rejected"]) + ": rejected)" if st["rejected"] else "")
        rows.append([st["storage"], pol, f"{st['row_bytes']:,}", f"{st['peak_rows']:,}", _fmt_bytes(st["peak_bytes"]),
                     f"{st['staged_rows_checked']:,} / {st['staged_rows']:,}"])
    L += ["  " + x for x in _table(["storage", "nonfinite policy", "B/row", "peak rows", "peak bytes", "staged == encode"], rows)]
    L.append("")
    L.append(f"massive activations of the captured rows ({ntok + ctx - 1:,} tokens, token 0 is BOS; a channel is massive")
    L.append("when its median |x| over the tokens exceeds 20x its layer's median |x|)")
    arows = []
    for a in r["activations"]:
        top = ", ".join(f"{ch} ({v:,.0f})" for ch, v in zip(a["massive_channels"][:3], a["massive_channel_max"][:3]))
        arows.append([f"layer {a['layer']}", f"{a['max_abs']:,.1f}", f"{a['max_token']} / {a['max_channel']}",
                      f"{a['max_abs_rest']:,.1f}", f"{a['median_abs']:.3f}", f"{len(a['massive_channels'])}", top or "-"])
    L += ["  " + x for x in _table(
        ["", "max |x|", "at token / channel", "max |x| after BOS", "median |x|", "massive ch.", "largest (their max |x|)"],
        arows)]
    L.append("")
    L.append(f"what each storage stages for them ({r['outcome_rows']} rows incl. BOS and the largest row, through a Stager;"
             " the value at the largest |x|)")
    orows = []
    for o in r["outcomes"]:
        v = "-" if o["staged_max"] is None else (f"{o['staged_max']:,.1f}" if math.isfinite(o["staged_max"]) else str(o["staged_max"]))
        orows.append([o["storage"], o["nonfinite"], o["outcome"], f"{o['input_max']:,.1f}", v, f"{o['nonfinite_staged']:,}",
                      f"{o['changed_beyond_rounding']:,}", f"{o['small_lost']:,}" if o["storage"].startswith("q") else "-"])
    L += ["  " + x for x in _table(
        ["storage", "policy", "outcome", "input", "staged", "non-finite", "replaced", "small -> 0"], orows)]
    L.append("  (replaced: values further from the input than the format's rounding; small -> 0: nonzero values in a q block")
    L.append("   holding a massive value that decode to 0, since the block scale is set by the massive value)")
    L.append("")
    L.append(f"total run time {r['wall_s']:.1f} s")
    return "\n".join(L)


def _json_default(o: Any) -> Any:
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        v = float(o)
        return v if math.isfinite(v) else None
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``dspark-core capture``; returns the exit status."""
    from ..engines.checked_stager import StagingMismatch
    from ..engines.llama_cpp import EngineCrash
    from ..errors import ConfigError

    # A crash inside the engine that no check foresaw still says where it happened.
    if not faulthandler.is_enabled():
        try:
            faulthandler.enable()
        except (AttributeError, ValueError, OSError):  # stderr without a file descriptor
            pass

    layers = None
    if args.layers:
        try:
            layers = tuple(int(x) for x in args.layers.split(",") if x.strip())
        except ValueError:
            print(f"dspark-core capture: --layers must be integers separated by commas, got {args.layers!r}", file=sys.stderr)
            return 2
    text = None
    if args.prompt_file:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            print(f"dspark-core capture: cannot read {args.prompt_file}: {exc}", file=sys.stderr)
            return 2
    quiet = bool(args.quiet)

    def say(msg: str) -> None:
        if not quiet:
            print(f"[capture] {msg}", file=sys.stderr, flush=True)

    try:
        result = capture_session(
            target=args.target, layers=layers, drafter=args.drafter, layer_shift=args.layer_shift, prompt_text=text,
            context=args.context, generate=args.generate, block=args.block, window=args.window, n_batch=args.n_batch,
            threads=args.threads, stager=args.stager, engine_check=args.engine_check, say=say,
        )
    except ImportError as exc:
        print(f"dspark-core capture: {exc}", file=sys.stderr)
        return 2
    except EngineCrash as exc:
        print(f"dspark-core capture: {exc}", file=sys.stderr)
        return 2
    except StagingMismatch as exc:
        print(f"dspark-core capture: check failed: {exc}", file=sys.stderr)
        return 1
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"dspark-core capture: {exc}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(result, sys.stdout, indent=2, default=_json_default)
        sys.stdout.write("\n")
    else:
        print(format_report(result))
    return 0
