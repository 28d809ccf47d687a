#!/usr/bin/env python3
"""CPU time of ``import dspark_core`` against ``import numpy``, in fresh interpreters.

Each run starts a new ``python`` (``sys.executable``) that imports, in order,
numpy and then dspark_core, and reports the CPU time (``time.process_time()``,
user + system of that process) of each import; a second kind of run imports
dspark_core alone (numpy included, as a user's first ``import dspark_core``
pays it). The two kinds alternate, so a change of machine load hits both.
Interpreter start-up is not counted: the clock starts inside the child.

Target (issue #38): ``import dspark_core`` (numpy included) within 2x of
``import numpy`` in the same run. bfloat16 (ml_dtypes) loads when first used,
so it is not part of either figure; the table also shows what
``import ml_dtypes`` would add.

    python bench/bench_import.py --quick     # 5 runs of each
    python bench/bench_import.py             # 21 runs of each

Not a test (never collected by pytest).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import _common as C

ds = C.import_dspark()

# The child: the clock starts after the interpreter is up; sys.path gets src/
# only where the parent had to fall back to it.
_CHILD = """
import json, sys, time
if {src!r}:
    sys.path.insert(0, {src!r})
out = {{}}
for name in {mods!r}:
    t0 = time.process_time()
    __import__(name)
    out[name] = time.process_time() - t0
out["ml_dtypes_loaded"] = "ml_dtypes" in sys.modules
print(json.dumps(out))
"""

TARGET = 2.0


def child(mods: list[str], src: str) -> dict[str, Any]:
    code = _CHILD.format(mods=mods, src=src)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="5 runs of each kind (CI-sized)")
    ap.add_argument("--runs", type=int, default=None, help="runs of each kind (default 21, 5 with --quick)")
    ap.add_argument("--out", default=None, help="also write the markdown here")
    ap.add_argument("--json", default=None, help="write raw medians and the target verdict here")
    a = ap.parse_args(argv)
    runs = a.runs or (5 if a.quick else 21)
    src = str(C.REPO / "src") if str(C.REPO / "src") in sys.path else ""

    t_wall = time.perf_counter()
    both: list[dict[str, Any]] = []
    alone: list[dict[str, Any]] = []
    ml: list[float] = []
    for i in range(runs):
        print(f"run {i + 1}/{runs}", file=sys.stderr, flush=True)
        both.append(child(["numpy", "dspark_core"], src))
        alone.append(child(["dspark_core"], src))
        ml.append(child(["numpy", "ml_dtypes"], src)["ml_dtypes"])
    wall = time.perf_counter() - t_wall

    med = C.median
    np_ms = [1e3 * r["numpy"] for r in both]
    ds_extra_ms = [1e3 * r["dspark_core"] for r in both]
    ds_alone_ms = [1e3 * r["dspark_core"] for r in alone]
    ml_ms = [1e3 * x for x in ml]
    ratios = [al / n for al, n in zip(ds_alone_ms, np_ms) if n > 0]
    ratio = med(ratios)
    np_med, alone_med = med(np_ms), med(ds_alone_ms)
    assert np_med is not None and alone_med is not None and ratio is not None
    ok = ratio <= TARGET
    eager = any(r["ml_dtypes_loaded"] for r in both + alone)

    def row(what: str, xs: list[float]) -> list[str]:
        return [what, f"{med(xs):.1f}", f"{min(xs):.1f}", f"{max(xs):.1f}"]

    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    lines = C.header_lines(
        "Import cost: `import dspark_core` vs `import numpy` (CPU time, fresh interpreters)",
        [f"runs: {runs} of each kind, alternating; load average (1 / 5 / 15 min) at the end: {load}",
         "CPU time = time.process_time() around the import, inside the child (start-up excluded)"],
    )
    lines += C.table(
        ["import", "median CPU ms", "min", "max"],
        [
            row("`import numpy`", np_ms),
            row("`import dspark_core` after numpy (its own cost)", ds_extra_ms),
            row("`import dspark_core` alone (numpy included)", ds_alone_ms),
            row("`import ml_dtypes` after numpy (not paid at import: bfloat16 loads on first use)", ml_ms),
        ],
    )
    lines += [
        "",
        f"ratio `import dspark_core` / `import numpy` (median of per-run ratios): **{ratio:.2f}x**, "
        f"target <= {TARGET:.1f}x: {C.verdict(ok)}"
        + ("" if not eager else "; **ml_dtypes was imported eagerly**"),
        "",
        f"({wall:.1f} s wall)",
    ]
    C.emit(lines, a.out)
    targets = [{"target": f"import dspark_core within {TARGET:.0f}x of import numpy (CPU)",
                "where": f"{runs} fresh interpreters", "text": f"{ratio:.2f}x ({alone_med:.0f} vs {np_med:.0f} ms)",
                "value": ratio, "pass": ok and not eager}]
    C.write_json(a.json, {"script": "bench_import", "wall_s": wall, "runs": runs, "numpy_ms": np_med,
                          "dspark_core_ms": alone_med, "dspark_core_after_numpy_ms": med(ds_extra_ms),
                          "ml_dtypes_ms": med(ml_ms), "ratio": ratio, "ml_dtypes_eager": eager, "targets": targets})
    return 0


if __name__ == "__main__":
    sys.exit(main())
