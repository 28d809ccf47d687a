#!/usr/bin/env python3
"""Run every dspark_core benchmark and write one markdown report (bench/RESULTS.md).

Runs, each as a subprocess of this interpreter (same environment, so
``PYTHONPATH=src`` for an in-place build carries over):

* bench/bench_convert.py  row-format conversion throughput (if present)
* bench/bench_rounds.py   per-round staging cost vs reference / naive / memcpy, by depth
* bench/bench_memory.py   peak buffered rows and bytes vs prompt length
* bench/bench_external.py external-row mode vs held: bytes host <-> device and host CPU per round
* bench/bench_snapshot.py snapshot_into / restore throughput vs memcpy (format v2)
* bench/bench_prefix.py   prefix store: publish / hit cost vs memcpy, memory per cached token vs KV
* bench/bench_prefix_batch.py   publish_many / hit_many vs loops, write_many vs process_many + write_slots
* bench/bench_step.py     one server step for N sequences: per-sequence vs batched Python calls vs the C floor
* bench/bench_threads.py  2 threads on distinct sequences vs 1 (held rounds, D = 25,600)
* bench/bench_device_step.py   the device step's CPU twin vs the host path's batch calls (syncs, launches)
* bench/bench_import.py   CPU time of `import dspark_core` vs `import numpy` (fresh interpreters)

then writes the report (machine, date, command, a summary of the docs/design.md
section 6 targets with PASS / MISS, and each script's tables) to --out and
prints it. A script that fails (non-zero exit, crash) is reported in place of
its table and the others still run; the exit status is then 1.

    python bench/run_all.py --quick     # CI-sized, about a minute
    python bench/run_all.py             # full run (<= ~10 minutes on a 2-core machine)

With --readme README.md a summary of at most 15 lines (one line per target,
ranges over storages, depths and directions) also replaces the text between the
lines ``<!-- bench-results:begin -->`` and ``<!-- bench-results:end -->`` there.

Not a test (never collected by pytest).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import _common as C

HERE = Path(__file__).resolve().parent
BEGIN, END = "<!-- bench-results:begin -->", "<!-- bench-results:end -->"
SCRIPTS = ("convert", "rounds", "memory", "snapshot", "external", "prefix", "prefix_batch", "step", "threads",
           "device_step", "import")


def run_script(name: str, args: list[str], timeout: float | None) -> tuple[int, str, str, float]:
    """Run one script; returns (exit status, stdout, the tail of its stderr, seconds).

    Its stderr (progress lines) is echoed live and the last lines are kept for the report.
    """
    path = HERE / f"bench_{name}.py"
    cmd = [sys.executable, str(path), *args]
    print(f"== {path.name} {' '.join(args)}", file=sys.stderr, flush=True)
    tail: collections.deque[str] = collections.deque(maxlen=20)
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(HERE.parent))

    chunks: list[str] = []

    def pump_err() -> None:
        assert p.stderr is not None
        for line in p.stderr:
            sys.stderr.write(line)
            sys.stderr.flush()
            tail.append(line.rstrip("\n"))

    def pump_out() -> None:
        assert p.stdout is not None
        chunks.append(p.stdout.read())

    threads = [threading.Thread(target=f, daemon=True) for f in (pump_err, pump_out)]
    for th in threads:
        th.start()
    try:
        rc = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        rc = 124
    for th in threads:
        th.join(timeout=10)
    if rc == 124:
        tail.append(f"(timed out after {timeout:.0f} s)")
    return rc, "".join(chunks), "\n".join(tail), time.perf_counter() - t0


def demote(text: str) -> str:
    """Make every script's headings sub-headings of the report ('# x' -> '## x', '## x' -> '### x' ...)."""
    out = []
    for line in text.splitlines():
        if line.startswith("#"):
            line = "#" + line
        out.append(line)
    return "\n".join(out)


def summary_rows(data: dict[str, Any]) -> list[list[str]]:
    rows: list[list[str]] = []
    conv = data.get("convert")
    if conv:
        for t in conv["targets"]:
            v = t["value"]
            rows.append([t["target"], t["where"], "-" if v is None else f"{v:.2f}x",
                         "not measured" if t["pass"] is None else C.verdict(t["pass"])])
    rounds = data.get("rounds")
    if rounds:
        for t in rounds["targets"]:
            v = t["value"]
            name = t["target"]
            if v is None:
                vs = "-"
            elif name.startswith("flat"):
                vs = f"{v:.3f}"
            else:
                vs = f"{100 * v:.0f}%"
            rows.append([name, f"D = {t['D']:,}, {t['storage']}", vs, C.verdict(t["pass"])])
    mem = data.get("memory")
    if mem:
        by_storage: dict[str, list[dict[str, Any]]] = {}
        for t in mem["targets"]:
            by_storage.setdefault(t["storage"], []).append(t)
        for s, ts in by_storage.items():
            worst = max(t["value"] for t in ts)
            prompts = ", ".join(C.fmt_size(t["prompt"]) for t in ts)
            rows.append([ts[0]["target"], f"{s}, prompts {prompts}", f"max {worst:,} rows",
                         C.verdict(all(t["pass"] for t in ts))])
    snap = data.get("snapshot")
    if snap:
        for t in snap["targets"]:
            rows.append([t["target"], f"D = {t['D']:,}, {t['storage']}", C.fmt_x(t["value"], 2), C.verdict(t["pass"])])
    for name in ("prefix_batch", "step", "threads", "device_step", "import"):  # targets that carry their own text
        for t in (data.get(name) or {}).get("targets", []):
            rows.append([t["target"], t["where"], t["text"], C.verdict(t["pass"])])
    ext = data.get("external")
    if ext:
        for t in ext["targets"]:
            v = t["value"]
            rows.append([t["target"], f"W = {ext['window']}, B = {ext['block']}",
                         "-" if v is None else (f"{v:.2f}" if isinstance(v, float) else f"{v}"), C.verdict(t["pass"])])
    prefix = data.get("prefix")
    if prefix:  # informative: no design target, the ratio to memcpy of the same bytes
        big = max(r["D"] for r in prefix["cost"])
        for r in prefix["cost"]:
            if r["D"] == big:
                rows.append(["prefix store publish / hit of K rows vs memcpy", f"D = {big:,}, {r['storage']}",
                             f"{r['publish_x']:.2f}x / {r['hit_x']:.2f}x", "-"])
    return rows


def _range(lo: float, hi: float | None, fmt: str) -> str:
    return fmt.format(lo) if hi is None or fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}-{fmt.format(hi)}"


def readme_summary(data: dict[str, Any], out: Path, quick: bool = False) -> str:
    """The README's share of a run: one line per target, ranges over storages, depths and
    directions (at most 15 lines); every table stays in ``out``."""
    rows: list[list[str]] = []
    rounds = data.get("rounds")
    if rounds:
        depths = ", ".join(C.fmt_size(d) for d in rounds["configs"][0]["depths"])
        for prefix, what, fmt in (("flat", f"per-round cost flat across depths {depths} (max/min of medians <= {{t:.2f}})",
                                   "{:.3f}"),
                                  ("round bandwidth", "steady round >= {t:.0%} of a memcpy round moving the same bytes",
                                   "{:.0%}")):
            ts = [t for t in rounds["targets"] if t["target"].startswith(prefix) and t["value"] is not None]
            if ts:
                hi = max(t["high"] if t.get("high") is not None else t["value"] for t in ts)
                rows.append([what.format(t=ts[0]["threshold"]), _range(min(t["value"] for t in ts), hi, fmt),
                             C.verdict(all(t["pass"] for t in ts))])
    conv = data.get("convert")
    if conv:
        for t, what in zip(conv["targets"], ("conversion >= {t:.0%} of a memcpy at the same moment, "
                                             "every storage and direction",
                                             "conversion as fast as ggml-cpu's SIMD converters (paired, >= {t:.2f}x)")):
            v = t["value"]
            measured = "not measured" if v is None else _range(v, t.get("high"), "{:.2f}x")
            verdict = C.verdict(t["pass"]) + ("" if t["pass"] in (True, None) else f" ({t['where']})")
            rows.append([what.format(t=t.get("threshold", 0.0)), measured, verdict])
    mem = data.get("memory")
    if mem and mem["targets"]:
        ts = mem["targets"]
        prompts = f"{C.fmt_size(min(t['prompt'] for t in ts))}-{C.fmt_size(max(t['prompt'] for t in ts))}"
        bound = ts[0].get("bound")
        rows.append([f"peak rows <= W + TRIM_CHUNK + B + 1{f' = {bound:,}' if bound else ''}, prompts {prompts}",
                     f"max {max(t['value'] for t in ts):,}", C.verdict(all(t["pass"] for t in ts))])
    command = "python bench/run_all.py" + (" --quick" if quick else "")
    lines = [f"Latest `{command}` ({os.cpu_count()} cores, {C.simd_path().split()[0]} path; "
             f"every table: [{out.as_posix()}]({out.as_posix()})):", ""]
    lines += C.table(["target (docs/design.md section 6)", "measured", "verdict"], rows, "lll")
    if rounds:
        big = max(c["D"] for c in rounds["configs"])
        deep = [(c["core_steady_ns"][-1], c["storage"]) for c in rounds["configs"] if c["D"] == big]
        deep = [(ns, st) for ns, st in deep if ns]
        if deep:
            (lo, lo_s), (hi, hi_s) = min(deep), max(deep)
            depth = C.fmt_size(rounds["configs"][0]["depths"][-1])
            lines += ["", f"A steady round at depth {depth}, D = {big:,}: {lo / 1e3:.0f} us ({lo_s}) to "
                          f"{hi / 1e3:.0f} us ({hi_s}) on that machine."]
    return "\n".join(lines)


def replace_readme(readme: Path, report: str) -> None:
    text = readme.read_text()
    if BEGIN not in text or END not in text or text.index(BEGIN) > text.index(END):
        raise SystemExit(f"{readme}: add the lines {BEGIN} and {END} where the results go")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{BEGIN}\n{report.rstrip()}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="pass --quick to every script (CI-sized, about a minute)")
    ap.add_argument("--only", default=",".join(SCRIPTS),
                    help=f"comma-separated subset of {','.join(SCRIPTS)} (default all)")
    ap.add_argument("--out", default=str(HERE / "RESULTS.md"), help="report file (default bench/RESULTS.md)")
    ap.add_argument("--readme", default=None,
                    help=f"also put the report between {BEGIN} and {END} in this file (e.g. README.md)")
    ap.add_argument("--timeout", type=float, default=None, help="per-script timeout in seconds (default none)")
    ap.add_argument("--rounds-args", default="",
                    help='extra arguments for bench_rounds.py, one string: --rounds-args="--dims 25600"')
    ap.add_argument("--memory-args", default="",
                    help="extra arguments for bench_memory.py, one string (use the = form, as above)")
    ap.add_argument("--external-args", default="",
                    help="extra arguments for bench_external.py, one string (use the = form, as above)")
    ap.add_argument("--convert-args", default="",
                    help="extra arguments for bench_convert.py, one string (use the = form, as above)")
    ap.add_argument("--snapshot-args", default="",
                    help="extra arguments for bench_snapshot.py, one string (use the = form, as above)")
    ap.add_argument("--prefix-args", default="",
                    help="extra arguments for bench_prefix.py, one string (use the = form, as above)")
    ap.add_argument("--prefix_batch-args", dest="prefix_batch_args", default="",
                    help="extra arguments for bench_prefix_batch.py, one string (use the = form, as above)")
    ap.add_argument("--step-args", default="",
                    help="extra arguments for bench_step.py, one string (use the = form, as above)")
    ap.add_argument("--threads-args", default="",
                    help="extra arguments for bench_threads.py, one string (use the = form, as above)")
    ap.add_argument("--device_step-args", dest="device_step_args", default="",
                    help="extra arguments for bench_device_step.py, one string (use the = form, as above)")
    ap.add_argument("--import-args", default="",
                    help="extra arguments for bench_import.py, one string (use the = form, as above)")
    a = ap.parse_args(argv)
    only = [s.strip() for s in a.only.split(",") if s.strip()]
    bad = [s for s in only if s not in SCRIPTS]
    if bad:
        ap.error(f"unknown script(s) {bad}; use {SCRIPTS}")

    C.import_dspark()  # for the header (version, SIMD path)
    t0 = time.perf_counter()
    sections: list[str] = []
    data: dict[str, Any] = {}
    status: list[list[str]] = []
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for name in only:
            if not (HERE / f"bench_{name}.py").exists():
                status.append([f"bench_{name}.py", "absent", "-"])
                continue
            args = ["--quick"] if a.quick else []
            args += getattr(a, f"{name}_args").split()
            jpath = os.path.join(tmp, f"{name}.json")
            args += ["--json", jpath]
            rc, out, err_tail, secs = run_script(name, args, a.timeout)
            status.append([f"bench_{name}.py", "ok" if rc == 0 else f"**FAILED (exit {rc})**", f"{secs:.0f}"])
            if rc != 0:
                failed = True
            body = demote(out.strip()) if out.strip() else "(no output)"
            if rc != 0:
                body += (f"\n\n**bench_{name}.py exited with status {rc}**; its output above is incomplete. "
                         f"Last lines of its stderr:\n\n```\n{err_tail}\n```")
            sections.append(body)
            if rc == 0 and os.path.exists(jpath):
                data[name] = json.loads(Path(jpath).read_text())
    wall = time.perf_counter() - t0

    lines = C.header_lines("dspark_core benchmarks", [f"total wall time {wall:.0f} s"])
    lines[0] = "# dspark_core benchmarks"
    lines += ["Scripts:", ""] + C.table(["script", "status", "seconds"], status, "llr") + [""]
    rows = summary_rows(data)
    if rows:
        lines += ["## Targets (docs/design.md section 6)", ""]
        lines += C.table(["target", "where", "value", "verdict"], rows, "llrl") + [""]
        if a.quick:
            lines += ["(--quick: few rounds on a CI-sized run; the verdicts are indicative only.)", ""]
    for s in sections:
        lines += [s, ""]
    report = "\n".join(lines).rstrip() + "\n"
    Path(a.out).write_text(report)
    if a.readme:
        replace_readme(Path(a.readme), readme_summary(data, Path(os.path.relpath(a.out, HERE.parent)), a.quick))
    sys.stdout.write(report)
    print(f"\nwrote {a.out}" + (f" and {a.readme}" if a.readme else ""), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
