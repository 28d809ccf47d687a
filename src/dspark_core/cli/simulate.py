"""``dspark-core simulate``: a long-context speculative session, windowed vs absolute staging.

Runs the same greedy session twice through :class:`~dspark_core.sim.loop.SpeculativeLoop`
with the toy models of :mod:`dspark_core.sim.toy`:

* **windowed**: the Stager as configured (window ``W``): the drafter only ever
  runs at positions ``[0, W)`` and rebases when a round would not fit;
* **absolute**: the same session with the window disabled (``W`` larger than
  the whole session, so no rebase ever fires): rows are staged at their
  absolute target positions, as staging without a window does.

The toy drafter has a trained range (``--trained``, default ``W``): its position
encoding is defined on ``[0, trained)`` only, as a trained drafter's is on the
positions it was trained on, so absolute staging's acceptance falls past it while
windowed staging, which never leaves ``[0, W)``, keeps it: a toy model of the
effect measured with a 27B target and a drafter trained on 4,096 positions
(:data:`MEASURED`).

Every absolute round attends over every staged row (the whole prompt), about
50 times a windowed round's work at the default 24k-token prompt, so the absolute
baseline generates only the first ``--absolute-tokens`` tokens (default
64; 0: all of ``--generate``): its per-round figures and acceptance are
measured over those rounds, and the screen says so. numpy's OpenBLAS runs on one
thread meanwhile (:mod:`dspark_core.sim.blas_threads`): the toy's skinny products
ran up to 30x slower on two threads of a loaded machine.

``--drafter eagle3`` runs a toy chain drafter instead (the EAGLE-3 / EAGLE / MTP
shape, :mod:`dspark_core.sim.toy_chain`): it consumes each staged row with the
id of the token after it, which the Stager keeps beside the row
(``StagerConfig(kind="chain")``), and drafts one token per step; its trained
range breaks the same way (vllm #48894: EAGLE-3 past its 2,048 positions).

``--tree`` verifies each round as a draft tree instead (``Stager.process_tree`` /
``accept_path``: the greedy chain to depth ``(B + 1) // 2`` and the drafter's second
choices as leaves, ``B + 1`` nodes), and checks every accepted path against a linear
verify of the same tokens (:mod:`dspark_core.sim.tree_draft`).

Both columns of the summary are measured, not assumed. Both runs are checked to
be lossless (the output equals the target's own greedy decoding, token for
token). ``--check`` adds the "incremental equals recompute" check of every
round's drafter logits.

Exit status: 0 on success, 1 if a run was not lossless or a check failed,
2 for a bad option (or ``--plot`` without matplotlib).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import textwrap
import time
from typing import Any, Callable, TextIO

import numpy as np

from ..stager.core_tables import ROW_MODES
from .simulate_setup import DEFAULTS, DRAFTERS, make_stager, ring_owner

__all__ = ["add_parser", "run", "simulate", "DEFAULTS", "MEASURED"]

logger = logging.getLogger("dspark_core")

#: What the toy models, as measured in a llama.cpp server (27B target, drafter trained on 4,096 positions).
MEASURED = (
    "measured with a 27B target and a drafter trained on 4,096 positions: absolute staging's acceptance "
    "fell from 59% to 4.6% at about 28k tokens; windowed staging ran 1.36x over no speculation at a "
    "24k-deep prompt"
)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``simulate`` subcommand on ``subparsers``."""
    from ..stager.config import STORAGES

    d = DEFAULTS
    p = subparsers.add_parser(
        "simulate",
        help="run a long-context speculative session: windowed vs absolute staging (the default command)",
        description=(
            "Run a long-context greedy speculative-decoding session with toy target and drafter models, "
            "once with windowed staging and once with absolute-position staging (the window disabled), "
            "check that both are lossless, and print a comparison table."
        ),
    )
    p.add_argument("--context", type=int, default=d["context"], metavar="N",
                   help=f"prompt tokens per sequence (default {d['context']})")
    p.add_argument("--generate", type=int, default=d["generate"], metavar="N",
                   help=f"tokens to generate per sequence (default {d['generate']})")
    p.add_argument("--block", type=int, default=d["block"], metavar="B", help=f"drafter block size (default {d['block']})")
    p.add_argument("--window", type=int, default=d["window"], metavar="W",
                   help=f"drafter window, its trained positions [0, W) (default {d['window']}; must be > 2*B)")
    p.add_argument("--storage", choices=STORAGES, default=d["storage"], help=f"row storage format (default {d['storage']})")
    p.add_argument("--seqs", type=int, default=d["seqs"], metavar="N",
                   help=f"concurrent sequences, planned with draft_many (default {d['seqs']})")
    p.add_argument("--seed", type=int, default=d["seed"], help=f"seed of the toy models and prompts (default {d['seed']})")
    p.add_argument("--feature-dim", type=int, default=d["feature_dim"], metavar="D",
                   help=f"capture row width (default {d['feature_dim']}; a multiple of 32 for q formats)")
    p.add_argument("--deviation", type=float, default=d["deviation"], metavar="P",
                   help=f"toy target's rate of unpredictable tokens (default {d['deviation']})")
    p.add_argument("--prefill-chunk", type=int, default=d["prefill_chunk"], metavar="N",
                   help=f"prompt rows per process() call (default {d['prefill_chunk']})")
    p.add_argument("--trained", type=int, default=d["trained"], metavar="N",
                   help="the toy drafter's trained range: its position encoding is defined on [0, N) only "
                        "(default: W)")
    p.add_argument("--absolute-tokens", type=int, default=d["absolute_tokens"], metavar="N",
                   help="tokens the absolute baseline generates: each of its rounds attends over the whole prompt "
                        f"(default {d['absolute_tokens']}; 0: all of --generate)")
    p.add_argument("--fail-every", type=int, default=0, metavar="N",
                   help="inject a drafter failure every N-th drafter round (default 0: none)")
    p.add_argument("--check", action="store_true",
                   help="check every round's drafter logits against a from-scratch recompute (slower)")
    p.add_argument("--stager", choices=("auto", "core", "reference"), default="auto",
                   help="Stager implementation: the C++ core, the pure-Python reference, or auto (core if built)")
    p.add_argument("--rows", choices=ROW_MODES, default="held",
                   help="held: the Stager keeps the rows (default); external: an external-row Stager plans slots "
                        "and an owner keeps the rows (--ring)")
    p.add_argument("--ring", choices=("auto", "device", "host"), default="auto",
                   help="the owner of external rows: device (a CUDA DeviceRing; needs a CUDA build and device), "
                        "host (a HostRing in host memory, any machine) or auto (device when one is usable)")
    p.add_argument("--device-step", action="store_true",
                   help="with --rows external: drive the loop with the device step (Stager.step_many: accept, plan "
                        "and the verify rows' slots in one call, no host wait per step; docs/protocol.md 2.10)")
    p.add_argument("--drafter", choices=tuple(DRAFTERS), default=d["drafter"],
                   help="the toy drafter: dspark (a block drafter, DSpark / DFlash: context rows and a block of "
                        "queries per round) or eagle3 (a chain drafter, EAGLE-3 / EAGLE / MTP: each row with the "
                        f"id of the token after it, one draft per step) (default {d['drafter']})")
    p.add_argument("--tree", action="store_true",
                   help="verify each round as a draft tree (the greedy chain to depth (B+1)/2, the drafter's second "
                        "choices as leaves; process_tree / accept_path), each accepted path checked against a linear "
                        "verify of the same tokens (docs/design.md 2.11; not with --device-step)")
    p.add_argument("--only", choices=("both", "windowed", "absolute"), default="both", help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="draw acceptance against drafter position, and the largest drafter position and the "
                        "buffered rows over the session (three panels; needs matplotlib: pip install 'dspark_core[plot]')")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    from .simulate_multiturn import add_arguments as add_multiturn_arguments

    add_multiturn_arguments(p)  # --workload multiturn and its options
    p.set_defaults(func=run)
    return p


# ----------------------------------------------------------------------------
# helpers


class _Progress:
    """A minimal progress bar on a TTY stream (silent otherwise)."""

    def __init__(self, label: str, enabled: bool, stream: TextIO | None = None, width: int = 30) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.width = width
        self._t0 = time.perf_counter()
        self._last = 0.0

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if done < total and now - self._last < 0.1:
            return
        self._last = now
        frac = done / total if total else 1.0
        fill = int(self.width * frac)
        bar = "#" * fill + "-" * (self.width - fill)
        spent = now - self._t0
        eta = f", ~{spent * (total - done) / done:4.0f}s left" if 0 < done < total else ""
        self.stream.write(f"\r{self.label:<9} [{bar}] {done}/{total} tokens {spent:5.1f}s{eta}   ")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def simulate(
    *,
    context: int = DEFAULTS["context"],
    generate: int = DEFAULTS["generate"],
    block: int = DEFAULTS["block"],
    window: int = DEFAULTS["window"],
    storage: str = DEFAULTS["storage"],
    seqs: int = DEFAULTS["seqs"],
    seed: int = DEFAULTS["seed"],
    feature_dim: int = DEFAULTS["feature_dim"],
    deviation: float = DEFAULTS["deviation"],
    prefill_chunk: int = DEFAULTS["prefill_chunk"],
    fail_every: int = 0,
    check: bool = False,
    stager: str = "auto",
    rows: str = "held",
    ring: str = "auto",
    device_step: bool = False,
    tree: bool = False,
    drafter: str = DEFAULTS["drafter"],
    trained: int | None = DEFAULTS["trained"],
    absolute_tokens: int = DEFAULTS["absolute_tokens"],
    modes: tuple[str, ...] = ("windowed", "absolute"),
    progress: Callable[[str], Callable[[int, int], None]] | None = None,
) -> dict[str, Any]:
    """Run the session in each mode and return the results (what ``--json`` prints).

    ``ring``: the owner of external rows (``"device"``, ``"host"``, ``"auto"``: device when usable);
    ``tree``: verify each round as a draft tree (``SpeculativeLoop(tree=True)``);
    ``drafter``: ``"dspark"`` (the toy block drafter) or ``"eagle3"`` (the toy chain drafter);
    ``trained``: the toy drafter's trained range (``None``: ``window``);
    ``absolute_tokens``: tokens the absolute mode generates (0: ``generate``).
    ``progress(mode)``, if given, is called as each mode starts and returns the
    ``progress(done, total)`` callback of that mode's run.

    Raises:
        ConfigError / ValueError: for settings that cannot work.
    """
    from ..sim.blas_threads import single_blas_thread

    with single_blas_thread():
        return _simulate(
            context=context, generate=generate, block=block, window=window, storage=storage, seqs=seqs, seed=seed,
            feature_dim=feature_dim, deviation=deviation, prefill_chunk=prefill_chunk, fail_every=fail_every,
            check=check, stager=stager, rows=rows, ring=ring, device_step=device_step, tree=tree, drafter=drafter,
            trained=window if trained is None else trained,
            absolute_tokens=absolute_tokens, modes=modes, progress=progress,
        )


def mode_tokens(mode: str, generate: int, absolute_tokens: int) -> int:
    """Tokens a mode generates: all of ``generate``, but at most ``absolute_tokens`` (if > 0) for absolute."""
    if mode == "absolute" and absolute_tokens > 0:
        return min(generate, absolute_tokens)
    return generate


def acceptance_between(timelines: list[dict[str, list[int]]], lo: int, hi: float) -> float | None:
    """Acceptance over the rounds whose largest drafter position lies in ``[lo, hi)`` (None: no such round)."""
    drafted = accepted = 0
    for tl in timelines:
        pos = np.asarray(tl.get("max_pos", []), dtype=np.int64)
        sel = (pos >= lo) & (pos < hi)
        drafted += int(np.sum(np.asarray(tl.get("drafted", []), dtype=np.int64)[sel]))
        accepted += int(np.sum(np.asarray(tl.get("accepted", []), dtype=np.int64)[sel]))
    return accepted / drafted if drafted else None


def _simulate(
    *, context: int, generate: int, block: int, window: int, storage: str, seqs: int, seed: int, feature_dim: int,
    deviation: float, prefill_chunk: int, fail_every: int, check: bool, stager: str, rows: str, ring: str,
    device_step: bool, tree: bool, drafter: str, trained: int,
    absolute_tokens: int, modes: tuple[str, ...], progress: Callable[[str], Callable[[int, int], None]] | None,
) -> dict[str, Any]:
    from ..stager.config import StagerConfig
    from ..sim.loop import SpeculativeLoop
    from ..sim.toy import FlakyDrafter, ToyDrafter, ToyTarget, greedy_reference
    from ..sim.toy_chain import ToyChainDrafter

    if context < 1 or generate < 1 or seqs < 1:
        raise ValueError("--context, --generate and --seqs must be >= 1")
    if fail_every < 0:
        raise ValueError("--fail-every must be >= 0")
    if trained < 1:
        raise ValueError(f"--trained must be >= 1, got {trained}")
    if absolute_tokens < 0:
        raise ValueError(f"--absolute-tokens must be >= 0, got {absolute_tokens}")
    if device_step and (rows != "external" or check):
        raise ValueError("--device-step needs --rows external (the step hands out slots) and no --check")
    if tree and device_step:
        raise ValueError("--tree verifies on the host (the device step verifies linear batches): no --device-step")
    if drafter not in DRAFTERS:
        raise ValueError(f"--drafter must be one of {tuple(DRAFTERS)}, got {drafter!r}")
    kind = DRAFTERS[drafter]
    win_cfg = StagerConfig(feature_dim, block, window, max_seqs=seqs, storage=storage, rows=rows, kind=kind)
    # "absolute": a window no session position can reach, so no rebase ever fires; its w_keep
    # (W // 2) also exceeds the session, so nothing is ever trimmed: every row is held, as without a window
    abs_window = 2 * (context + mode_tokens("absolute", generate, absolute_tokens) + block + 1) + 1
    abs_cfg = win_cfg.replace(window=max(abs_window, window))

    def new_target() -> ToyTarget:
        return ToyTarget(feature_dim=feature_dim, lookahead=block, deviation=deviation, seed=seed)

    prompts = [
        np.random.default_rng(np.random.SeedSequence([seed, 0x9E, i])).integers(0, new_target().vocab_size, context)
        for i in range(seqs)
    ]
    t = time.perf_counter()
    ref_target = new_target()
    greedy = [greedy_reference(ref_target, p, generate) for p in prompts]
    greedy_s = time.perf_counter() - t

    out: dict[str, Any] = {
        "config": {
            "context": context, "generate": generate, "block": block, "window": window, "storage": storage,
            "seqs": seqs, "seed": seed, "feature_dim": feature_dim, "deviation": deviation,
            "prefill_chunk": prefill_chunk, "fail_every": fail_every, "check": check,
            "row_bytes": win_cfg.row_bytes, "absolute_window": abs_cfg.window, "rows": rows,
            "ring": ring_owner(ring) if rows == "external" else None, "device_step": device_step,
            "trained": trained, "absolute_tokens": absolute_tokens, "tree": tree, "drafter": drafter,
            "drafter_kind": kind,
        },
        "greedy_reference_s": greedy_s,
        "modes": {},
    }
    for mode in modes:
        cfg = win_cfg if mode == "windowed" else abs_cfg
        st, impl = make_stager(stager, cfg)
        out["stager"] = impl
        targets = [new_target() for _ in range(seqs)]
        toy = ToyChainDrafter if kind == "chain" else ToyDrafter
        model: Any = toy.for_target(targets[0], block, seed=seed, n_ctx_train=trained)
        if fail_every:
            model = FlakyDrafter(model, every=fail_every, stage="mixed", seed=seed)
        owner = None
        if rows == "external":
            from ..cuda import DeviceRing
            from ..rows.host_ring import HostRing

            # DeviceRing: RuntimeError without a CUDA device
            owner = DeviceRing(st) if out["config"]["ring"] == "device" else HostRing(st)
        loop_cls = SpeculativeLoop
        if device_step:
            from ..sim.device_step_loop import DeviceStepLoop

            loop_cls = DeviceStepLoop
        loop = loop_cls(st, model, targets, prefill_chunk=prefill_chunk, check_recompute=1 if check else 0,
                        ring=owner, **({"tree": True} if tree else {}))
        bar = progress(mode) if progress is not None else None
        n_gen = mode_tokens(mode, generate, absolute_tokens)
        res = loop.run(prompts, n_gen, progress=bar)
        if bar is not None and hasattr(bar, "close"):
            bar.close()
        summ = res.summary()
        # The Stager's own metrics (totals over the run's requests) against the loop's counts of
        # the rounds it committed and verified: a staging bug in the counters fails --check.
        totals = st.totals()
        summ["verified_rounds"] = totals.stats["verified_rounds"]
        summ["accepted_histogram"] = totals.accepted.tolist()
        summ["metrics_match"] = (
            totals.stats["accepted_tokens"] == sum(s.accepted for s in res.sequences)
            and totals.stats["verified_rounds"] * block == sum(s.drafted for s in res.sequences)
        )
        if check and not summ["metrics_match"]:
            raise AssertionError(f"{mode}: the Stager's acceptance metrics differ from the loop's counts")
        if tree and summ["tree_paths_linear"] != summ["tree_rounds"]:
            raise AssertionError(f"{mode}: an accepted path differs from a linear verify of its tokens")
        summ["lossless"] = all(np.array_equal(s.tokens, g[:n_gen]) for s, g in zip(res.sequences, greedy))
        summ["window"] = cfg.window
        summ["rounds_outside_window"] = sum(
            int(np.sum(np.asarray(s.timeline.get("max_pos", []), dtype=np.int64) >= window)) for s in res.sequences
        )
        summ["rounds_past_trained_range"] = sum(
            int(np.sum(np.asarray(s.timeline.get("max_pos", []), dtype=np.int64) >= trained)) for s in res.sequences
        )
        tls = [s.timeline or {} for s in res.sequences]
        summ["acceptance_in_trained_range"] = acceptance_between(tls, 0, trained)
        summ["acceptance_past_trained_range"] = acceptance_between(tls, trained, float("inf"))
        summ["drafter_kv_rows_needed"] = summ["drafter_kv_peak"]
        summ["timeline"] = {
            k: [int(x) for x in v] for k, v in (res.sequences[0].timeline or {}).items()
        }
        # Host synchronisations per step a GPU server's loop needs: the host path reads the
        # accept counts on the host every iteration (accept, then draft); the device step only
        # when a sequence comes back (a drafter failure).
        steps = getattr(loop, "steps", 0)
        summ["host_syncs_per_step"] = loop.host_waits / max(1, steps) if device_step else 1.0  # type: ignore[attr-defined]
        summ["prompt_len"] = context
        summ["tokens_per_seq"] = n_gen
        out["modes"][mode] = summ
    out["lossless"] = all(m["lossless"] for m in out["modes"].values())
    return out


_ROWS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("generated tokens / seq", "tokens_per_seq", lambda v: f"{v:,}"),
    ("largest drafter position", "max_drafter_pos", lambda v: f"{v:,}"),
    ("drafter rounds at positions >= W", "rounds_outside_window", lambda v: f"{v:,}"),
    ("largest drafter batch / seq (rows)", "max_drafter_batch", lambda v: f"{v:,}"),
    ("drafter KV rows needed (peak)", "drafter_kv_rows_needed", lambda v: f"{v:,}"),
    ("peak buffered rows / seq", "peak_rows", lambda v: f"{v:,}"),
    ("peak buffered bytes / seq", "peak_bytes", _fmt_bytes),
    ("rebases", "rebases", lambda v: f"{v:,}"),
    ("restaged rows / generated token", "restaged_per_token", lambda v: f"{v:.3f}"),
    ("draft acceptance", "acceptance", lambda v: f"{100 * v:.1f}%"),
    ("verified rounds (Stager metrics)", "verified_rounds", lambda v: f"{v:,}"),
    ("tokens / drafter round", "tokens_per_round", lambda v: f"{v:.2f}"),
    ("time / round (ms)", "ms_per_round", lambda v: f"{v:.3f}"),
    ("  of which Stager (ms)", "stager_ms_per_round", lambda v: f"{v:.3f}"),
    ("  of which drafter (ms)", "drafter_ms_per_round", lambda v: f"{v:.3f}"),
    ("lossless (== target greedy)", "lossless", lambda v: "yes" if v else "NO"),
]


#: How the table's header names each owner of external rows.
_EXTERNAL = {"device": "rows on the device (external-row mode, DeviceRing)",
             "host": "rows in host memory (external-row mode, HostRing)"}


def format_table(result: dict[str, Any]) -> str:
    """The human-readable summary of :func:`simulate`'s result."""
    c = result["config"]
    modes = list(result["modes"])
    head = (
        f"dspark-core simulate: {c['seqs']} sequence(s), {c['context']:,}-token prompt + {c['generate']:,} generated, "
        f"block B={c['block']}, window W={c['window']}, storage {c['storage']} "
        f"(D={c['feature_dim']}, {c['row_bytes']} B/row), Stager: {result.get('stager', '?')}"
        + (f", drafter: {c['drafter']} ({c['drafter_kind']})" if c.get("drafter_kind") == "chain" else "")
        + (f", {_EXTERNAL.get(c.get('ring'), 'external rows')}" if c.get("rows") == "external" else "")
        + (", on the device step (step_many: one call per step)" if c.get("device_step") else "")
    )
    labels = {"windowed": f"windowed (W={c['window']})", "absolute": "absolute (no window)"}
    cols = [labels.get(m, m) for m in modes]
    rows = [(name, [fmt(result["modes"][m][key]) for m in modes]) for name, key, fmt in _ROWS]
    if c.get("check"):
        rows.append(("incremental vs recompute: max |diff|",
                     [f"{result['modes'][m]['recompute_max_err']:.1e} ({result['modes'][m]['recompute_checks']} rounds)"
                      for m in modes]))
    if c.get("tree"):
        rows.append(("tree rounds: paths == linear verify",
                     [f"{result['modes'][m]['tree_paths_linear']:,} of {result['modes'][m]['tree_rounds']:,}"
                      for m in modes]))
    if c.get("fail_every"):
        rows.append(("injected drafter failures", [f"{result['modes'][m]['failures']:,}" for m in modes]))
    if c.get("device_step"):
        rows.append(("host waits per server step", [f"{result['modes'][m]['host_syncs_per_step']:.2f}" for m in modes]))
    if c["trained"] != c["window"]:
        rows.insert(3, (f"drafter rounds at positions >= {c['trained']:,} (trained)",
                        [f"{result['modes'][m]['rounds_past_trained_range']:,}" for m in modes]))
    w0 = max(len(r[0]) for r in rows)
    ws = [max(len(cols[i]), *(len(r[1][i]) for r in rows)) for i in range(len(modes))]
    lines = [head, ""]
    lines.append(" " * w0 + "  " + "  ".join(cols[i].rjust(ws[i]) for i in range(len(modes))))
    lines.append("-" * (w0 + sum(w + 2 for w in ws)))
    for name, vals in rows:
        lines.append(name.ljust(w0) + "  " + "  ".join(vals[i].rjust(ws[i]) for i in range(len(modes))))
    lines.append("")
    lines.extend(textwrap.fill(note, width=max(100, len(lines[2])), subsequent_indent="  ") for note in _notes(result))
    return "\n".join(lines)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _notes(result: dict[str, Any]) -> list[str]:
    """What the table shows, in words: where each mode ran against the trained range, and what it models."""
    c = result["config"]
    T = c["trained"]
    out = []
    if "windowed" in result["modes"]:
        w = result["modes"]["windowed"]
        inside = w["max_drafter_pos"] < T
        out.append(
            f"windowed: the drafter {'stayed inside' if inside else 'LEFT'} its trained range [0, {T:,}) "
            f"(largest position {w['max_drafter_pos']:,}): acceptance {_pct(w['acceptance'])}, "
            f"at most {w['peak_rows']:,} rows buffered per sequence."
        )
    if "absolute" in result["modes"]:
        a = result["modes"]["absolute"]
        inside, past = a["acceptance_in_trained_range"], a["acceptance_past_trained_range"]
        split = (f"{_pct(inside)} in the rounds inside the range, {_pct(past)} past it" if inside is not None
                 and past is not None else _pct(a["acceptance"]))
        out.append(
            f"absolute: the drafter ran at positions up to {a['max_drafter_pos']:,}, past its trained range in "
            f"{a['rounds_past_trained_range']:,} of {a['drafter_rounds']:,} rounds: acceptance {split}; "
            f"{a['peak_rows']:,} rows held."
        )
        if a["tokens_per_seq"] < c["generate"]:
            out[-1] += (
                f" Each absolute round attends over every staged row (the whole prompt), so this baseline "
                f"ran the first {a['tokens_per_seq']:,} of {c['generate']:,} tokens (--absolute-tokens 0: all)."
            )
    out.append(
        f"A toy model of the effect: the toy drafter's position encoding is defined on [0, {T:,}) only, as a trained "
        f"drafter's is on its training length; {MEASURED}."
    )
    if c.get("drafter_kind") == "chain":
        out.append(f"The chain drafter ({c['drafter']}) hits the same wall: vLLM's EAGLE-3 fails past its 2,048 trained "
                   "positions (vllm #48894); each of its rounds pairs every staged row with the id of the token after it.")
    return out


def acceptance_by_position(timeline: dict[str, list[int]], n_groups: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Acceptance of the drafted rounds grouped by their largest drafter position.

    The rounds, sorted by position, are cut into ``n_groups`` groups of (nearly)
    equal count, so every point averages as many rounds. Returns ``(position,
    acceptance)`` per group: the mean position and accepted / drafted tokens.
    """
    pos = np.asarray(timeline.get("max_pos", []), dtype=np.float64)
    drafted = np.asarray(timeline.get("drafted", []), dtype=np.float64)
    accepted = np.asarray(timeline.get("accepted", []), dtype=np.float64)
    keep = drafted > 0
    order = np.argsort(pos[keep], kind="stable")
    groups = [g for g in np.array_split(order, min(n_groups, len(order))) if len(g)] if len(order) else []
    p, d, a = pos[keep], drafted[keep], accepted[keep]
    x = np.array([p[g].mean() for g in groups])
    y = np.array([a[g].sum() / d[g].sum() for g in groups])
    return x, y


def _plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = result["config"]
    T = c["trained"]
    fig, (ax0, ax1, ax2) = plt.subplots(3, 1, figsize=(9, 10))
    for mode, m in result["modes"].items():
        tl = m["timeline"]
        bx, by = acceptance_by_position(tl)
        label = mode if m["tokens_per_seq"] == c["generate"] else f"{mode} (first {m['tokens_per_seq']:,} tokens)"
        ax0.plot(bx, 100 * by, "o-", label=f"{label}: {100 * m['acceptance']:.1f}% overall", lw=1, ms=4)
        x = np.asarray(tl.get("n_past", []), dtype=np.int64) - c["context"]
        ax1.plot(x, tl.get("max_pos", []), label=label, lw=1)
        ax2.plot(x, tl.get("rows", []), label=label, lw=1)
    lo = min((min(m["timeline"].get("max_pos", [T]) or [T]) for m in result["modes"].values()), default=T)
    ax0.axvspan(max(1.0, lo / 2), T, color="tab:green", alpha=0.08, label=f"trained range [0, {T:,})")
    ax0.axvline(T, color="k", ls="--", lw=0.8)
    ax0.set_xscale("log")
    ax0.set_xlabel("largest drafter position of the round (rounds in groups of equal count)")
    ax0.set_ylabel("draft acceptance (%)")
    ax0.set_ylim(bottom=0)
    ax0.legend(fontsize=8)
    ax0.set_title(f"toy model of the effect {MEASURED}", fontsize=7, wrap=True)
    ax1.axhline(c["window"], color="k", ls="--", lw=0.8, label=f"W = {c['window']}")
    if T != c["window"]:
        ax1.axhline(T, color="tab:green", ls=":", lw=0.8, label=f"trained range {T:,}")
    ax1.set_ylabel("largest drafter position")
    ax1.set_yscale("log")
    ax1.legend(fontsize=8)
    ax2.set_ylabel("buffered rows (sequence 0)")
    ax2.set_yscale("log")
    ax2.set_xlabel("generated tokens")
    ax2.legend(fontsize=8)
    fig.suptitle(
        f"dspark-core simulate: {c['context']:,}-token prompt, B={c['block']}, W={c['window']}, "
        f"storage {c['storage']}, toy drafter trained on [0, {T:,})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``dspark-core simulate``; returns the exit status."""
    from ..errors import ConfigError

    if getattr(args, "workload", "long") == "multiturn":
        from .simulate_multiturn import run as run_multiturn

        return run_multiturn(args)
    from .simulate_multiturn import refused_options

    refused = refused_options(args)
    if refused:
        print(f"dspark-core simulate: {refused}", file=sys.stderr)
        return 2

    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("dspark-core simulate: --plot needs matplotlib: pip install 'dspark_core[plot]'", file=sys.stderr)
            return 2
    quiet = bool(getattr(args, "quiet", False)) or not sys.stderr.isatty()

    def progress(mode: str) -> _Progress:
        n = mode_tokens(mode, args.generate, args.absolute_tokens)
        if mode == "absolute" and not quiet:
            # The slow half of the default run: say what it does before the bar starts.
            print(f"absolute: every round attends over all {args.context:,}+ staged rows; generating "
                  + (f"the first {n:,} of {args.generate:,} tokens (--absolute-tokens)" if n < args.generate
                     else f"{n:,} tokens"), file=sys.stderr)
        return _Progress(mode, enabled=not quiet)

    modes = ("windowed", "absolute") if args.only == "both" else (args.only,)
    try:
        result = simulate(
            context=args.context, generate=args.generate, block=args.block, window=args.window,
            storage=args.storage, seqs=args.seqs, seed=args.seed, feature_dim=args.feature_dim,
            deviation=args.deviation, prefill_chunk=args.prefill_chunk, fail_every=args.fail_every,
            check=args.check, stager=args.stager, rows=args.rows, ring=args.ring, device_step=args.device_step,
            tree=args.tree, drafter=args.drafter,
            trained=args.trained,
            absolute_tokens=args.absolute_tokens, modes=modes, progress=progress,
        )
    except (ConfigError, ValueError) as exc:
        print(f"dspark-core simulate: {exc}", file=sys.stderr)
        return 2
    except AssertionError as exc:  # a staging bug caught by the drafter or the recompute check
        print(f"dspark-core simulate: check failed: {exc}", file=sys.stderr)
        return 1
    except RuntimeError as exc:
        print(f"dspark-core simulate: {exc}", file=sys.stderr)
        return 2
    if args.json:
        slim = {**result, "modes": {m: {k: v for k, v in r.items() if k != "timeline"} for m, r in result["modes"].items()}}
        json.dump(slim, sys.stdout, indent=2, default=_json_default)
        sys.stdout.write("\n")
    else:
        print(format_table(result))
    if args.plot:
        try:
            _plot(result, args.plot)
        except (OSError, ValueError) as exc:  # bad path or an extension matplotlib cannot write
            print(f"dspark-core simulate: cannot write the plot {args.plot}: {exc}", file=sys.stderr)
            return 2
        if not args.json:
            print(f"plot written to {args.plot}")
    if not result["lossless"]:
        print("dspark-core simulate: output differs from the target's greedy decoding", file=sys.stderr)
        return 1
    return 0


def _json_default(o: Any) -> Any:
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        v = float(o)
        return v if math.isfinite(v) else None
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")
