"""The report of a run: markdown tables (every figure with its bootstrap interval) and the plot.

Offline figures (teacher-forced on the held-out documents, :mod:`offline`):

* acceptance rate: the leading drafts of a round equal to the target's greedy labels,
  over the drafts (what a verify would accept where the text follows the target);
* top-1 agreement: every draft equal to its label, over the drafts.

Live figures (:mod:`live_loop`): drafts accepted over drafts proposed, and accepted
drafts per verify, by the depth of each round's start.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import numpy as np

import report as rp

__all__ = ["write_report"]

#: The depth buckets the tables show (the plot shows all).
SHOWN = (0, 1, 3, 7, 11, 15)
#: What the issue asks of the block drafter at 15T-16T (points of acceptance rate).
GAP_BELOW = -0.03
FLAT_WITHIN = 0.03


def _bucket_name(b: int) -> str:
    return f"{b}T-{b + 1}T" if b else "0-T"


def _offline_sums(recs: list[dict[str, Any]], field: str, T: int, n_b: int) -> rp.Sums:
    return rp.Sums.of(((np.asarray(r["depth"]), np.asarray(r[field], float),
                        np.full(len(r["depth"]), r["B"], float)) for r in recs), T, n_b)


def _live_sums(recs: list[dict[str, Any]], what: str, T: int, n_b: int) -> rp.Sums:
    """Per document (a document's runs pooled): accepted over drafted, or accepted per verify."""
    by_doc: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
    for r in recs:
        drafted = np.asarray(r["drafted"], float)
        den = drafted if what == "rate" else (drafted > 0).astype(float)
        by_doc.setdefault(r["doc"], []).append((np.asarray(r["start"]), np.asarray(r["accepted"], float), den))
    per_doc = [(np.concatenate([x[0] for x in v]), np.concatenate([x[1] for x in v]), np.concatenate([x[2] for x in v]))
               for v in by_doc.values()]
    return rp.Sums.of(per_doc, T, n_b)


def _pool(result: dict[str, Any], kind: str, section: str) -> dict[str, list[dict[str, Any]]]:
    """Records of every seed of a drafter kind, per mode; a document's records of all seeds
    count as one document (the bootstrap resamples documents)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for did, per_mode in result[section].items():
        if did.split(" ")[0] != kind:
            continue
        for mode, recs in per_mode.items():
            out.setdefault(mode, []).extend(recs)
    return out


def _merge_docs(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by: dict[str, dict[str, Any]] = {}
    for r in recs:
        if r["doc"] not in by:
            by[r["doc"]] = {"doc": r["doc"], "depth": [], "agree": [], "prefix": [], "B": r["B"]}
        for k in ("depth", "agree", "prefix"):
            by[r["doc"]][k] += list(r[k])
    return list(by.values())


def write_report(result: dict[str, Any], out: Path, T: int) -> str:
    """Write ``REPORT.md`` and ``acceptance.png`` into ``out``; return the markdown."""
    import _common

    B = result["B"]
    n_b = max(1, max((max(r["depth"]) for per in result["offline"].values() for recs in per.values()
                      for r in recs if r["depth"]), default=0) // T + 1)
    n_b = min(n_b, 16)
    L: list[str] = []
    m0, m1 = result["machine_start"], result["machine_end"]
    t = result["timings"]
    L += [
        "## Real drafters on Gemma 3 270M: acceptance against depth, by staging mode",
        "",
        f"- command: `{_common.command_line()}`",
        f"- machine: {m0['cpu']}, {m0['cores']} logical cores; {m0['platform']}, Python {m0['python']}",
        f"- load average at start {m0['load']}, at end {m1['load']}; torch on 1 thread, llama.cpp on "
        f"{result.get('threads', 2)}",
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- target: Gemma 3 270M (Q4_K_M GGUF), tap layers {result['layers']} (rows {len(result['layers']) * 640:,} "
        f"wide); {result['positions']['train']:,} training positions, {result['positions']['eval']:,} held-out",
        f"- T = {T} (trained range, crop length), B = {B}; seeds {result['plan']['seeds']}",
        f"- time: capture {t['capture_s']:.0f} s, train {t['train_s']:.0f} s, offline {t['offline_s']:.0f} s, "
        f"live {t['live_s']:.0f} s; {result['wall_s']:.0f} s in all (cached stages take no time)",
        "",
    ]
    c = result["checks"]
    L += [
        f"Checks: live runs lossless against the target's greedy decode: **{c['live_lossless']} of {c['live_runs']}**; "
        f"staged rows equal to the target's rows bit for bit: {c['live_rows_checked']:,} live, "
        f"{c['offline_rows_checked']:,} offline; every saved config.json read back by DrafterInfo.from_hf_config "
        f"as trained: {'yes' if c['configs_read_back'] else '**NO**'}.",
        "",
        "### Drafters",
        "",
    ]
    rows = []
    for did, d in result["drafters"].items():
        cb = d["config_read_back"]
        rows.append([did, d["pos_kind"], d["steps"], f"{d['train_s']:.0f} s", f"{d['draft_vocab']:,} "
                     f"({100 * d['label_coverage']:.0f}%)", f"{d['final_loss']:.2f}", f"{100 * d['final_train_top1']:.1f}%",
                     f"{cb['architecture']}, {cb['kind']}, B={cb['block_size']}, n_ctx_train={cb['n_ctx_train']}, "
                     f"layers {cb['target_layers']}, D={cb['feature_dim']}"])
    L += _common.table(["drafter", "positions", "steps", "train time", "draft vocab (label coverage)",
                        "final loss", "train top-1", "DrafterInfo.from_hf_config"], rows, "llrrrrrl")
    L.append("")

    curves = []
    for kind, label in (("block", "block drafter (DFlash-style)"), ("chain", "chain drafter (EAGLE-3-style)")):
        pooled = {m: _merge_docs(r) for m, r in _pool(result, kind, "offline").items()}
        if not pooled:
            continue
        L += [f"### {label}: offline acceptance rate by depth (seeds pooled; 95% bootstrap over documents)", ""]
        sums = {m: _offline_sums(r, "prefix", T, n_b) for m, r in pooled.items()}
        rows = [[_bucket_name(b)] + [rp.fmt_ci(rp.ratio(sums[m], b)) for m in sums] for b in SHOWN if b < n_b]
        L += _common.table(["depth"] + list(sums), rows)
        L.append("")
        agree = {m: _offline_sums(r, "agree", T, n_b) for m, r in pooled.items()}
        last = min(15, n_b - 1)
        L.append("Top-1 agreement (every draft against its label) at " + _bucket_name(last) + ": " + "; ".join(
            f"{m} {rp.fmt_ci(rp.ratio(agree[m], last))}" for m in agree) + ".")
        L.append("")
        L += _differences(result, kind, T, n_b, last)
        if kind == "block":
            for m, s in sums.items():
                pts = [rp.ratio(s, b) for b in range(n_b)]
                curves.append((f"block {m}", *(np.asarray(x) for x in zip(*pts))))
    L += _rebase_check(result, T, n_b)
    live_marks = _live(result, T, n_b, L)
    L += _timing(result)
    png = out / "acceptance.png"
    rp.plot(str(png), T, curves, live_marks, "Gemma 3 270M, block drafter trained on T = 256 positions: "
            "acceptance rate against depth", T)
    L += ["", f"Plot: `{png.name}` (offline lines with their intervals, live buckets as circles).", ""]
    text = "\n".join(L)
    (out / "REPORT.md").write_text(text + "\n")
    return text


def _differences(result: dict[str, Any], kind: str, T: int, n_b: int, last: int) -> list[str]:
    import _common

    L = [f"Differences at {_bucket_name(last)}, per seed (points of acceptance rate, paired bootstrap over documents):", ""]
    rows = []
    for did, per_mode in result["offline"].items():
        if did.split(" ")[0] != kind:
            continue
        s = {m: _offline_sums(r, "prefix", T, n_b) for m, r in per_mode.items()}
        w = s.get("W=T")
        if w is None:
            continue
        gap = rp.difference(s["absolute"], last, w, last)
        flat = rp.difference(w, last, w, 0)
        row = [did, rp.fmt_ci(gap, sign=True), _common.verdict(gap[0] < GAP_BELOW and gap[2] < 0),
               rp.fmt_ci(flat, sign=True), _common.verdict(abs(flat[0]) <= FLAT_WITHIN)]
        for m in ("W=T/8", "W=T/16", "mask W=T"):
            row.append(rp.fmt_ci(rp.difference(s[m], last, w, last), sign=True) if m in s else "-")
        rows.append(row)
    L += _common.table(["drafter", "absolute - W=T", "< -3 pt, CI < 0", f"W=T: {_bucket_name(last)} - 0-T",
                        "within 3 pt", "W=T/8 - W=T", "W=T/16 - W=T", "mask W=T - W=T"], rows, "lrlrlrrr")
    L.append("")
    return L


def _rebase_check(result: dict[str, Any], T: int, n_b: int) -> list[str]:
    import _common

    L = ["### When the rebase matters: the window as a mask at absolute positions, against rebased positions", ""]
    rows = []
    for did, per_mode in result["offline"].items():
        if not did.startswith("block") or "mask W=T" not in per_mode:
            continue
        s = {m: _offline_sums(r, "prefix", T, n_b) for m, r in per_mode.items()}
        for b in sorted({0, min(7, n_b - 1), min(15, n_b - 1)}):
            rows.append([did, _bucket_name(b), rp.fmt_ci(rp.ratio(s["absolute"], b)), rp.fmt_ci(rp.ratio(s["W=T"], b)),
                         rp.fmt_ci(rp.ratio(s["mask W=T"], b)),
                         rp.fmt_ci(rp.difference(s["mask W=T"], b, s["W=T"], b), sign=True)])
    L += _common.table(["drafter", "depth", "absolute", "W=T (rebased)", "mask W=T (absolute positions)",
                        "mask - rebased"], rows, "llrrrr")
    L += ["", "`block` uses RoPE only (attention depends on position differences); `block+abs` adds a code of the "
          "absolute position to its inputs, so positions past T are new to it even inside a window.", ""]
    return L


def _live(result: dict[str, Any], T: int, n_b: int, L: list[str]) -> list[tuple[str, np.ndarray, np.ndarray]]:
    import _common

    marks: list[tuple[str, np.ndarray, np.ndarray]] = []
    if not result["live"]:
        L += ["### Live loop", "", "Not run (--no-live).", ""]
        return marks
    buckets = [b for b in result["plan"]["live_buckets"] if b < 16]
    L += ["### Live loop: the real target verifying, the Stager staging, the trained drafter drafting", "",
          f"Each run: a held-out document's prefix of `bT + {T // 8}` tokens, then {result['plan']['generate']} "
          "tokens of greedy speculative decoding, checked against the target's own greedy decode. "
          "Acceptance rate [95% CI over documents] / accepted drafts per verify [CI]; seeds pooled.", ""]
    for kind in ("block", "chain"):
        pooled = _pool(result, kind, "live")
        if not pooled:
            continue
        rows = []
        for b in buckets:
            row = [f"{kind} {_bucket_name(b)}"]
            for recs in pooled.values():
                rate = rp.ratio(_live_sums(recs, "rate", T, 16), b)
                per = rp.ratio(_live_sums(recs, "verify", T, 16), b)
                row.append(f"{rp.fmt_ci(rate)} / {rp.fmt_ci(per, pct=False)}")
            rows.append(row)
        L += _common.table(["drafter, depth"] + list(pooled), rows)
        L.append("")
        if kind == "block":
            for m, recs in pooled.items():
                s = _live_sums(recs, "rate", T, 16)
                pts = np.asarray([rp.ratio(s, b)[0] for b in buckets])
                marks.append((f"block {m}", (np.asarray(buckets) + 0.5) * T, pts))
        last = buckets[-1]
        rows = []
        for did, per_mode in result["live"].items():
            if did.split(" ")[0] != kind:
                continue
            s = {m: _live_sums(r, "rate", T, 16) for m, r in per_mode.items()}
            rows.append([did] + [rp.fmt_ci(rp.ratio(s[m], last)) for m in s] + [
                rp.fmt_ci(rp.difference(s["absolute"], last, s["W=T"], last), sign=True)])
        L += [f"Per seed at {_bucket_name(last)} (live acceptance rate):", ""]
        L += _common.table(["drafter"] + list(next(iter(result["live"].values()))) + ["absolute - W=T"], rows)
        L.append("")
    return marks


def _timing(result: dict[str, Any]) -> list[str]:
    import _common

    L = ["### The drafter's own time per round (ms, median over documents; 1 torch thread)", ""]
    rows = []
    for did, per_mode in result["offline"].items():
        row = [did]
        for m in ("absolute", "W=T", "W=T/8", "W=T/16"):
            recs = per_mode.get(m)
            row.append(f"{1e3 * np.median([r['drafter_s'] / max(1, r['rounds']) for r in recs]):.2f}" if recs else "-")
        live = result["live"].get(did, {})
        for m in ("absolute", "W=T"):
            recs = live.get(m, [])
            rounds = [max(1, sum(1 for x in r["drafted"] if x)) for r in recs]
            row.append(f"{1e3 * np.median([r['drafter_s'] / n for r, n in zip(recs, rounds)]):.2f}" if recs else "-")
        rows.append(row)
    L += _common.table(["drafter", "offline absolute", "offline W=T", "offline W=T/8", "offline W=T/16",
                        "live absolute", "live W=T"], rows)
    L.append("")
    return L
