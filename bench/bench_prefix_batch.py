#!/usr/bin/env python3
"""A server step's prefix and row calls batched: one call against a loop of per-sequence calls.

Part 1. N sequences (external rows, a HostRing and HostPrefixTable; held
rows, the Stager's own ring) each complete one block of 16 positions per
step, as a decoding batch does. Interleaved, in a rotating order, each
repeat times one step's:

* ``publish_many`` of the N blocks against a loop of N ``publish``;
* ``hit_many`` of N requests (a 64-token cached prefix each) against a loop
  of N ``hit``.

Both ways run on twin Stagers and stores, fed the same rows, so each publish
is new to its store (the stores are cleared between repeats) and each hit
finds the same rows. Targets (#35): the batch >= 5x faster than the loop at
N = 64.

Part 2. The owner's ``write_many`` (one ``check_process_many``, one
``process_many``, one encode into the HostRing's table) against what a
server would call itself: ``process_many`` + ``write_slots``. Target: <= 1.1x.

Ratios are medians over repeats of the two ways' times in the same repeat
(paired: a shared machine's load moves more between repeats than within one).

    python bench/bench_prefix_batch.py --quick   # N = 64, few repeats (seconds)
    python bench/bench_prefix_batch.py           # N = 16, 64, 256

Not a test (never collected by pytest).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable

import numpy as np

import _common as C

ds = C.import_dspark()
from dspark_core import HostPrefixTable, HostRing, PrefixStore, Stager, StagerConfig  # noqa: E402

BT = 16  # tokens per block (vLLM's default)
D, B, W = 256, 4, 128
STORAGE = "q8_0"
PREFIX = 64  # cached tokens per hit


def activations(n: int, dim: int, seed: int) -> np.ndarray:
    """Rows with a few massive channels (as real hidden states), finite in every storage."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, dim), dtype=np.float32)
    x[:, :3] *= 200.0
    return x


class Side:
    """One way's Stager and store (external rows: with the owners that apply the copies)."""

    def __init__(self, n: int, rows: str) -> None:
        self.cfg = StagerConfig(D, B, W, max_seqs=2 * n, storage=STORAGE, rows=rows)
        self.st = Stager(self.cfg)
        self.store = PrefixStore(self.cfg, BT, 64 << 20)
        self.external = rows == "external"
        if self.external:
            self.ring = HostRing(self.st)
            self.table = HostPrefixTable(self.store, self.ring)

    def feed(self, seqs: list[int], lo: int, rows: np.ndarray) -> None:
        k = len(rows) // len(seqs)
        cu = np.arange(len(seqs) + 1) * k
        pos = np.tile(np.arange(lo, lo + k), len(seqs))
        if self.external:
            self.ring.write_many(seqs, cu, pos, rows)
        else:
            self.st.process_many(seqs, cu, pos, rows)

    def publish(self, seq: int, keys: list[int], a: int, b: int) -> None:
        if self.external:
            self.table.publish(self.ring, seq, keys, a, b)
        else:
            self.store.publish(self.st, seq, keys, a, b)

    def publish_many(self, seqs: list[int], keys: list[list[int]], a: list[int], b: list[int]) -> None:
        if self.external:
            self.table.publish_many(self.ring, seqs, keys, a, b)
        else:
            self.store.publish_many(self.st, seqs, keys, a, b)

    def hit(self, seq: int, keys: list[int], h: int) -> None:
        if self.external:
            self.table.hit(self.ring, seq, keys, h)
        else:
            self.store.hit(self.st, seq, keys, h)

    def hit_many(self, seqs: list[int], keys: list[list[int]], h: list[int]) -> None:
        if self.external:
            self.table.hit_many(self.ring, seqs, keys, h)
        else:
            self.store.hit_many(self.st, seqs, keys, h)


def keys_of(seq: int, lo: int, hi: int) -> list[int]:
    return [seq * 1_000_003 + s for s in range(lo, hi, BT)]


def paired(fns: dict[str, Callable[[], None]], setup: Callable[[], None], repeats: int) -> dict[str, list[int]]:
    """Each repeat: ``setup()``, then every way once, in a rotating order; their times."""
    names = list(fns)
    times: dict[str, list[int]] = {n: [] for n in names}
    for r in range(repeats):
        setup()
        for n in names[r % len(names):] + names[:r % len(names)]:
            times[n] += C.time_ns(fns[n], 1, warmup=0)
    return times


def measure_prefix(n: int, rows: str, repeats: int) -> dict[str, Any]:
    """publish_many / hit_many against loops, N sequences, one step."""
    loop, batch = Side(n, rows), Side(n, rows)
    seqs = list(range(n))
    others = list(range(n, 2 * n))
    x = activations(n * PREFIX, D, n)
    for side in (loop, batch):
        side.feed(seqs, 0, x)
    keys = [keys_of(s, PREFIX - BT, PREFIX) for s in seqs]
    a, b = [PREFIX - BT] * n, [PREFIX] * n
    hit_keys = [keys_of(s, 0, PREFIX) for s in seqs]
    h = [PREFIX] * n

    def clear() -> None:
        for side in (loop, batch):
            side.store.clear()

    def publish_loop() -> None:
        for s, k in zip(seqs, keys):
            loop.publish(s, k, a[0], b[0])

    def publish_batch() -> None:
        batch.publish_many(seqs, keys, a, b)

    pub = paired({"loop": publish_loop, "batch": publish_batch}, clear, repeats)

    def fill() -> None:  # every prefix block held, for the hits
        for side in (loop, batch):
            side.store.clear()
            side.publish_many(seqs, [keys_of(s, 0, PREFIX) for s in seqs], [0] * n, [PREFIX] * n)

    def hit_loop() -> None:
        for s, k in zip(others, hit_keys):
            loop.hit(s, k, PREFIX)

    def hit_batch() -> None:
        batch.hit_many(others, hit_keys, h)

    hit = paired({"loop": hit_loop, "batch": hit_batch}, fill, repeats)
    ratio = {name: C.median([lo / ba for lo, ba in zip(t["loop"], t["batch"])]) for name, t in
             (("publish", pub), ("hit", hit))}
    return {"n": n, "rows": rows, "publish_loop_ns": C.median(pub["loop"]), "publish_many_ns": C.median(pub["batch"]),
            "publish_x": ratio["publish"], "hit_loop_ns": C.median(hit["loop"]), "hit_many_ns": C.median(hit["batch"]),
            "hit_x": ratio["hit"]}


def measure_write(n: int, repeats: int) -> dict[str, Any]:
    """write_many against process_many + write_slots: B + 1 verify rows per sequence."""
    one, two = Side(n, "external"), Side(n, "external")
    seqs = list(range(n))
    k = B + 1
    rows = activations(n * k, D, 7)
    cu = np.arange(n + 1) * k
    state = {"at": 0}

    def positions() -> np.ndarray:
        return np.tile(np.arange(state["at"], state["at"] + k), n)

    def write_many() -> None:
        one.ring.write_many(seqs, cu, positions(), rows)

    def process_and_write() -> None:
        slots = two.st.process_many(seqs, cu, positions())
        two.ring.write_slots(slots, rows)

    names = ["write_many", "process_many + write_slots"]
    fns = {"write_many": write_many, "process_many + write_slots": process_and_write}
    times: dict[str, list[int]] = {nm: [] for nm in names}
    for r in range(repeats):
        order = names if r % 2 == 0 else names[::-1]
        for nm in order:
            times[nm] += C.time_ns(fns[nm], 1, warmup=0)
        state["at"] += k  # both ways wrote the same positions this repeat
    ratio = C.median([a / b for a, b in zip(times["write_many"], times["process_many + write_slots"])])
    return {"n": n, "write_many_ns": C.median(times["write_many"]),
            "process_write_ns": C.median(times["process_many + write_slots"]), "ratio": ratio}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="N = 64 only, few repeats")
    p.add_argument("--seqs", default=None, help="batch sizes (default 16,64,256; quick: 64)")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--json", default=None, help="write the raw medians and targets here")
    a = p.parse_args()
    sizes = C.parse_list(a.seqs) if a.seqs else ([64] if a.quick else [16, 64, 256])
    repeats = a.repeats or (9 if a.quick else 31)
    prefix, writes = [], []
    for n in sizes:
        for rows in ("external", "held"):
            print(f"  prefix N={n} {rows}", file=sys.stderr, flush=True)
            prefix.append(measure_prefix(n, rows, repeats))
        print(f"  write_many N={n}", file=sys.stderr, flush=True)
        writes.append(measure_write(n, 4 * repeats))
    targets = []
    for r in prefix:
        if r["n"] == 64:
            for what in ("publish", "hit"):
                v = r[f"{what}_x"]
                targets.append({"target": f"{what}_many >= 5x a loop of {what} at N = 64", "where": r["rows"],
                                "value": v, "text": C.fmt_x(v), "pass": v >= 5.0})
    for w in writes:
        if w["n"] == 64:
            targets.append({"target": "write_many <= 1.1x process_many + write_slots at N = 64", "where": "HostRing",
                            "value": w["ratio"], "text": f"{w['ratio']:.2f}x", "pass": w["ratio"] <= 1.1})
    lines = C.header_lines("Batched prefix calls and write_many against per-sequence calls", [
        f"D = {D}, B = {B}, W = {W}, {STORAGE} rows, blocks of {BT} tokens, hits of {PREFIX} tokens; "
        f"{repeats} interleaved repeats (write_many: {4 * repeats}), medians; ratios paired per repeat",
    ])
    lines += C.table(["N", "rows", "loop of publish (us)", "publish_many (us)", "speed-up", "loop of hit (us)",
                      "hit_many (us)", "speed-up"],
                     [[r["n"], r["rows"], C.fmt_us(r["publish_loop_ns"]), C.fmt_us(r["publish_many_ns"]),
                       C.fmt_x(r["publish_x"]), C.fmt_us(r["hit_loop_ns"]), C.fmt_us(r["hit_many_ns"]),
                       C.fmt_x(r["hit_x"])] for r in prefix])
    lines += [""]
    lines += C.table(["N", "write_many (us)", "process_many + write_slots (us)", "ratio"],
                     [[w["n"], C.fmt_us(w["write_many_ns"]), C.fmt_us(w["process_write_ns"]), f"{w['ratio']:.2f}x"]
                      for w in writes])
    lines += ["", "### Targets", ""]
    lines += C.table(["target", "where", "measured", "verdict"],
                     [[t["target"], t["where"], t["text"], C.verdict(t["pass"])] for t in targets], "lllr")
    C.emit(lines, None)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"prefix": prefix, "write": writes, "targets": targets}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
