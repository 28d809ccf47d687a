#!/usr/bin/env python3
"""Prefix store: publish and hit cost against memcpy, and memory per cached token against KV.

Part 1, cost. For each storage and D, a Stager (B = 16, W = 4096: K = 2048)
holds a full window of rows (realistic activations). Interleaved, in a
rotating order, each repeat times:

* memcpy: ``np.copyto`` of the bytes the operation copies, between two
  preallocated buffers (the baseline: what moving those bytes costs at all);
* publish: ``store.publish`` of K rows (K / 16 blocks of 16 positions, keys a
  uint64 array) from the ring into a store that was just cleared (its pages
  are warm: a serving store reuses them);
* hit: ``store.hit`` of a prompt of 2K tokens: the chain of its 2K / 16 keys
  is looked up (the last K / 16 blocks are read) and K rows are copied into
  the sequence's ring;
* one block: ``store.publish`` of a single 16-position block (what a server
  pays per completed block during decoding), in microseconds.

Ratios are the median over repeats of memcpy's time over the operation's in
the same repeat (1.0x = memcpy speed): paired, because a shared machine's
load moves more between repeats than within one.

Part 2, memory. The store keeps every row of a cached block (block_tokens <=
K), one row per cached token: ``row_bytes(storage, D)`` with ``D = n_capture *
hidden_size`` (5 tap layers here, as DSpark drafters use). Next to it, the
target's KV cache per token:

* GQA: ``2 (K and V) * n_layers * n_kv_heads * head_dim * 2 bytes`` (bf16);
* MLA (DeepSeek-V3): ``n_layers * (kv_lora_rank + qk_rope_head_dim) * 2 bytes``
  (the compressed latent and the decoupled RoPE key are cached, nothing else).

The shapes are the fields of each model's config.json as published with its
weights (num_hidden_layers, num_key_value_heads, hidden_size /
num_attention_heads or head_dim, kv_lora_rank, qk_rope_head_dim): Llama-3-8B,
Llama-3.1-70B, Qwen2.5-32B, DeepSeek-V3. A budget for N cached tokens is
about N * row_bytes (blocks are rounded up to whole pages of page_rows rows).

    python bench/bench_prefix.py --quick     # D = 4,096, W = 1024, few repeats (seconds)
    python bench/bench_prefix.py             # f32, q8_0, q4_0 at D = 20,480 and 25,600, W = 4096

Not a test (never collected by pytest).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np

import _common as C

ds = C.import_dspark()
from dspark_core import PrefixStore, Stager, StagerConfig, row_bytes  # noqa: E402

BT = 16  # tokens per prefix block (vLLM's default KV block size)
N_CAPTURE = 5  # tap layers of the drafter (DSpark)

#: Target shapes from each model's config.json: (name, attention, layers, kv heads, head dim,
#: hidden size, kv_lora_rank, qk_rope_head_dim).
MODELS = (
    ("Llama-3-8B", "GQA", 32, 8, 128, 4096, 0, 0),
    ("Qwen2.5-32B", "GQA", 64, 8, 128, 5120, 0, 0),
    ("Llama-3.1-70B", "GQA", 80, 8, 128, 8192, 0, 0),
    ("DeepSeek-V3", "MLA", 61, 0, 0, 7168, 512, 64),
)


def kv_bytes_per_token(attn: str, layers: int, kv_heads: int, head_dim: int, lora: int, rope: int) -> int:
    """The target's KV cache per token in bf16 (see the module docstring for the formulas)."""
    if attn == "MLA":
        return layers * (lora + rope) * 2
    return 2 * layers * kv_heads * head_dim * 2


def activations(n: int, dim: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, dim), dtype=np.float32)
    x[:, [3, dim // 3, dim - 5]] *= np.float32(2e3)
    return x


def measure(storage: str, D: int, W: int, B: int, repeats: int) -> dict[str, Any]:
    cfg = StagerConfig(D, B, W, max_seqs=2, storage=storage)
    K = cfg.w_keep
    n_prompt = 2 * K  # the hit's prompt: its chain has n_prompt / BT keys
    st = Stager(cfg)
    store = PrefixStore(cfg, BT, (n_prompt + 4 * BT) * cfg.row_bytes)
    keys = np.arange(1, n_prompt // BT + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    chunk = activations(512, D, 1)
    st.begin(0)
    for lo in range(0, n_prompt, 512):  # a prompt, published block by block as chunks complete
        st.process(0, np.arange(lo, lo + 512), chunk)
        store.publish(st, 0, keys[lo // BT:(lo + 512) // BT], lo, lo + 512)
    rb = cfg.row_bytes
    nbytes = K * rb
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    blk_src, blk_dst = np.ones(BT * rb, np.uint8), np.empty(BT * rb, np.uint8)
    pub_lo = n_prompt - K
    pub_keys = keys[pub_lo // BT:]
    extra = np.uint64(7)  # other keys for the single-block publish

    def memcpy() -> None:
        np.copyto(dst, src)

    def publish() -> None:
        store.clear()
        store.publish(st, 0, pub_keys, pub_lo, n_prompt)

    def hit() -> None:
        store.hit(st, 1, keys, n_prompt)

    def one_block() -> None:
        store.evict(pub_keys[-1:] + extra)
        store.publish(st, 0, pub_keys[-1:] + extra, n_prompt - BT, n_prompt)

    def memcpy_block() -> None:
        np.copyto(blk_dst, blk_src)

    publish()  # fill the store for the hits (publish leaves it full)
    for _ in range(3):  # warm up every path
        memcpy(), hit(), one_block(), memcpy_block()
    names = ("memcpy", "hit", "one_block", "memcpy_block", "publish")
    fns = {"memcpy": memcpy, "publish": publish, "hit": hit, "one_block": one_block, "memcpy_block": memcpy_block}
    times: dict[str, list[int]] = {n: [] for n in names}
    for r in range(repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            times[n] += C.time_ns(fns[n], 1, warmup=0)
        publish()  # the hits read a full store
    med = {n: C.median(v) for n, v in times.items()}
    # Ratios of each repeat's own memcpy to its operation (timed in the same repeat), then the
    # median: a shared machine's load changes between repeats more than within one.
    paired = {n: C.median([m / t for m, t in zip(times["memcpy"], times[n])]) for n in ("publish", "hit")}
    h = store.lookup(keys, n_prompt)
    assert h.complete and h.rows == K
    return {
        "storage": storage, "D": D, "W": W, "K": K, "row_bytes": rb, "bytes": nbytes, "keys_per_hit": len(keys),
        "memcpy_ns": med["memcpy"], "publish_ns": med["publish"], "hit_ns": med["hit"],
        "one_block_ns": med["one_block"], "memcpy_block_ns": med["memcpy_block"],
        "publish_x": paired["publish"], "hit_x": paired["hit"],
        "publish_gbps": nbytes / med["publish"], "hit_gbps": nbytes / med["hit"], "memcpy_gbps": nbytes / med["memcpy"],
    }


def memory_table() -> tuple[list[str], list[dict[str, Any]]]:
    rows, out = [], []
    for name, attn, layers, kvh, hd, hidden, lora, rope in MODELS:
        kv = kv_bytes_per_token(attn, layers, kvh, hd, lora, rope)
        D = N_CAPTURE * hidden
        cells = [name, attn, f"{kv:,}"]
        rec: dict[str, Any] = {"model": name, "attention": attn, "kv_bytes_per_token": kv, "feature_dim": D}
        for s in ("f32", "bf16", "q8_0", "q4_0"):
            b = row_bytes(s, D)
            rec[s] = b
            cells.append(f"{b:,} ({100 * b / kv:.0f}%)")
        rows.append(cells)
        out.append(rec)
    lines = C.table(["target", "attention", "KV bytes / token (bf16)", "f32 row", "bf16 row", "q8_0 row", "q4_0 row"],
                    rows)
    return lines, out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="D = 4,096, W = 1024, few repeats")
    p.add_argument("--storages", default="f32,q8_0,q4_0")
    p.add_argument("--dims", default=None, help="feature widths (default 20,480 and 25,600; quick: 4,096)")
    p.add_argument("--window", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--out", default=None, help="also write the markdown here")
    p.add_argument("--json", default=None, help="write the raw medians here")
    a = p.parse_args()
    dims = C.parse_list(a.dims) if a.dims else ([4096] if a.quick else [20480, 25600])
    W = a.window or (1024 if a.quick else 4096)
    repeats = a.repeats or (7 if a.quick else 15)
    B = 16
    results = []
    for D in dims:
        for s in a.storages.split(","):
            print(f"  {s} D={D:,} W={W}", file=sys.stderr, flush=True)
            results.append(measure(s, D, W, B, repeats))
    lines = C.header_lines("Prefix store: publish / hit cost and memory per cached token", [
        f"B = {B}, W = {W} (K = {W // 2}), block_tokens = {BT}, {repeats} interleaved repeats, medians",
        "publish: K rows (K / 16 blocks) from a Stager's ring into a cleared store; hit: a prompt of 2K tokens "
        "(its 2K / 16 keys looked up), K rows into a ring; memcpy: np.copyto of the same K rows' bytes",
    ])
    lines += ["### Cost against memcpy of the same bytes", ""]
    lines += C.table(
        ["storage", "D", "K rows (bytes)", "memcpy (us)", "publish (us)", "publish / memcpy", "hit (us)",
         "hit / memcpy", "1 block publish (us)", "1 block memcpy (us)"],
        [[r["storage"], f"{r['D']:,}", f"{r['K']:,} ({C.fmt_bytes(r['bytes'])})", C.fmt_us(r["memcpy_ns"]),
          C.fmt_us(r["publish_ns"]), C.fmt_x(r["publish_x"], 2), C.fmt_us(r["hit_ns"]), C.fmt_x(r["hit_x"], 2),
          C.fmt_us(r["one_block_ns"]), C.fmt_us(r["memcpy_block_ns"])] for r in results])
    lines += ["", "(`x / memcpy`: the median over repeats of memcpy's time over the operation's in the same repeat; "
              "1.00x is memcpy speed. The times are medians.)", "",
              "### Memory per cached token (one row per token) next to the target's KV", "",
              f"Rows of D = {N_CAPTURE} x hidden_size (bytes, and as a share of the KV bytes of the same token):", ""]
    mem_lines, mem = memory_table()
    lines += mem_lines
    lines += ["", "GQA KV = 2 x layers x kv_heads x head_dim x 2 B; MLA KV = layers x (kv_lora_rank + "
              "qk_rope_head_dim) x 2 B; shapes from each model's config.json. Budget for N cached tokens: about "
              "N x row bytes (a block takes whole pages of min(block_tokens, K) rows)."]
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cost": results, "memory": mem}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
