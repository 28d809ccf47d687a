#!/usr/bin/env python3
"""A tree verify step against a linear one: process_tree_many + accept_path_many vs process_many + accept_many.

For N sequences (D = 4,096, B = 16, W = 4,096, bf16 storage, float32 input
rows shaped like real activations), each step verifies ``B + 1`` rows per
sequence and keeps ``k + 1`` of them (k accepted drafts, drawn once per step
and shared by both ways):

* ``linear``: ``process_many`` of the B + 1 verify rows, ``accept_many(k)``;
* ``tree``: ``process_tree_many`` of a random tree of B + 1 nodes (each node's
  parent drawn among the earlier nodes), ``accept_path_many`` of a root-to-node
  path of k + 1 nodes (the one ending at the deepest node of depth <= k).

Both ways run on their own Stager, in a rotating order, after the same
untimed ``draft_many`` + ``commit_many``. The table gives the median step
(process + accept) of each way and the ratio tree / linear: the tree's extra
cost is its checks and the path's compaction (at most k row copies, held
mode; external rows: the copies handed back, not applied here).

    python bench/bench_tree.py              # N = 1, 16, 64; held and external rows
    python bench/bench_tree.py --quick      # N = 16 only, fewer steps
    python bench/bench_tree.py --json out.json

Target: with held rows, the tree step within 1.25x of the linear step at
N = 64 (the conversion of the B + 1 verify rows dominates both). With
external rows a step is bookkeeping only (no row is converted), so the
tree's own work shows whole: the table gives it per sequence (the tree's
checks, the path's moves and their array), with no target.
Not a test (never collected by pytest).
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import numpy as np

import _common as C

ds = C.import_dspark()
from dspark_core import Stager, StagerConfig  # noqa: E402

D, B, W = 4096, 16, 4096
STORAGE = "bf16"
PROMPT = 2 * W
TARGET = 1.25


def activations(rng: np.random.Generator, n: int) -> np.ndarray:
    """Rows with a few massive channels (as real hidden states), finite in bf16."""
    x = rng.standard_normal((n, D), dtype=np.float32)
    x[:, :3] *= 300.0
    return x


def tree_and_path(rng: np.random.Generator, k: int) -> tuple[list[int], list[int]]:
    """A random tree of B + 1 nodes and a root-to-node path of at most k + 1 nodes."""
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, B + 1)]
    depth = [0] * (B + 1)
    for i in range(1, B + 1):
        depth[i] = depth[parents[i]] + 1
    node = max((i for i in range(B + 1) if depth[i] <= k), key=lambda i: (depth[i], i))
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return parents, path[::-1]


class Way:
    """One way's Stager, its sequences' ends, and its verify step."""

    def __init__(self, n: int, rows: str, tree: bool, rng: np.random.Generator) -> None:
        self.st = Stager(StagerConfig(D, B, W, max_seqs=n, storage=STORAGE, rows=rows))
        self.external, self.tree, self.n = rows == "external", tree, n
        self.seqs = np.arange(n, dtype=np.int64)
        x = activations(rng, PROMPT)
        for s in range(n):
            self.st.begin(s)
            pos = np.arange(PROMPT)
            self.st.process(s, pos) if self.external else self.st.process(s, pos, x)
        self.ends = np.full(n, PROMPT, np.int64)

    def draft(self) -> None:
        self.st.draft_many(self.seqs, self.ends)
        self.st.commit_many(self.seqs)

    def step(self, rows: np.ndarray, trees: list[list[int]], paths: list[list[int]]) -> Callable[[], None]:
        """The timed verify step (rows: (n * (B + 1), D))."""
        st, seqs, n = self.st, self.seqs, self.n
        cu = np.arange(n + 1, dtype=np.int64) * (B + 1)
        held = None if self.external else rows
        if self.tree:
            parents = np.concatenate([np.asarray(t, np.int64) for t in trees])
            pcu = np.cumsum([0] + [len(p) for p in paths]).astype(np.int64)
            nodes = np.concatenate([np.asarray(p, np.int64) for p in paths])

            def run() -> None:
                st.process_tree_many(seqs, cu, self.ends, parents, held)
                st.accept_path_many(seqs, pcu, nodes)
        else:
            pos = (self.ends[:, None] + np.arange(B + 1)[None, :]).reshape(-1)
            acc = np.array([len(p) - 1 for p in paths], np.int64)

            def run() -> None:
                st.process_many(seqs, cu, pos, held)
                st.accept_many(seqs, acc)
        return run

    def advance(self, paths: list[list[int]]) -> None:
        self.ends += np.array([len(p) for p in paths], np.int64)


def measure(n: int, rows: str, steps: int) -> dict[str, Any]:
    rng = np.random.default_rng(n)
    ways = {"linear": Way(n, rows, False, rng), "tree": Way(n, rows, True, rng)}
    times: dict[str, list[int]] = {w: [] for w in ways}
    for r in range(steps):
        k = int(rng.integers(0, B + 1))
        trees, paths = zip(*(tree_and_path(rng, k) for _ in range(n)))
        x = activations(rng, n * (B + 1))
        order = list(ways)[r % 2:] + list(ways)[:r % 2]
        for name in order:
            w = ways[name]
            w.draft()
            times[name] += C.time_ns(w.step(x, list(trees), list(paths)), 1, warmup=0)
            w.advance(list(paths))
    for w in ways.values():  # both ways kept the same rows: the same state
        assert all(w.st.state(s) == ways["linear"].st.state(s) for s in range(n))
    lin, tree = C.median(times["linear"]), C.median(times["tree"])
    return {"n": n, "rows": rows, "linear_us": lin / 1e3, "tree_us": tree / 1e3, "ratio": tree / lin}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="N = 16 only, 30 steps")
    p.add_argument("--steps", type=int, default=None, help="steps per (N, mode) (default 120; --quick 30)")
    p.add_argument("--json", metavar="FILE", default=None, help="also write the records as JSON")
    p.add_argument("--out", metavar="FILE.md", default=None, help="also write the report as markdown")
    args = p.parse_args()
    steps = args.steps or (30 if args.quick else 120)
    ns = [16] if args.quick else [1, 16, 64]
    records = [measure(n, rows, steps) for rows in ("held", "external") for n in ns]
    lines = C.header_lines(
        "Tree verify step vs linear verify step",
        [f"D = {D:,}, B = {B}, W = {W:,}, {STORAGE} storage, float32 input rows; B + 1 verify rows per sequence",
         f"median of {steps} steps per cell, both ways interleaved in one run (machine shared and noisy: "
         "read the ratio)"],
    )
    rows_out = []
    for r in records:
        ok = r["ratio"] <= TARGET if r["n"] == 64 and r["rows"] == "held" else None
        extra = (r["tree_us"] - r["linear_us"]) / r["n"]
        rows_out.append([r["rows"], r["n"], f"{r['linear_us']:,.1f}", f"{r['tree_us']:,.1f}", C.fmt_x(r["ratio"], 2),
                         f"{extra:,.2f}", C.verdict(ok)])
    lines += C.table(["rows", "N", "linear step (us)", "tree step (us)", "tree / linear", "tree extra / seq (us)",
                      f"held: <= {TARGET}x at N = 64"], rows_out, "lrrrrrl")
    C.emit(lines, args.out)
    C.write_json(args.json, records)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
