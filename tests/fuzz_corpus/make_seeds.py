"""Write the seed corpus of the fuzz targets (deterministic; rerun after changing a decoder).

    python tests/fuzz_corpus/make_seeds.py

Directories (one input per file):

* ``ops/``, ``snapshot/``, ``decode/``: the Python targets of ``python -m dspark_core.testing.fuzz``
  (replayed by ``tests/test_fuzz_corpus.py``);
* ``threads/``: the threads target (decodes like ``ops``; the same seeds);
* ``cpp_stager/``, ``cpp_formats/``, ``cpp_c_api/``, ``cpp_prefix/``: the libFuzzer targets in ``csrc/fuzz/``
  (replayed at the start of every fuzz run in ``.ci/fuzz_steps.sh``);
* ``findings/<target>/``: reproducers of bugs the fuzzers found (kept by hand, never
  rewritten here). Those listed in ``findings/KNOWN_OPEN`` are expected to fail until fixed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "src"))

from dspark_core.stager.config import STORAGES, StagerConfig  # noqa: E402
from dspark_core.testing import encode_ops  # noqa: E402


def prng(tag: str, n: int) -> bytes:
    """Deterministic pseudo-random bytes."""
    out = b""
    k = 0
    while len(out) < n:
        out += hashlib.sha256(f"{tag}/{k}".encode()).digest()
        k += 1
    return out[:n]


#: Generated seeds that turned out to reproduce a finding: written to findings/<target>/ instead.
MOVED_TO_FINDINGS = {"ops/random-11", "decode/seed-07", "decode/seed-22"}


def write(sub: str, name: str, data: bytes) -> None:
    if f"{sub}/{name}" in MOVED_TO_FINDINGS:
        sub = os.path.join("findings", sub)
    d = os.path.join(HERE, sub)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def ops_seeds() -> None:
    # Hand-written protocol scripts over every storage, then pseudo-random ones.
    scripts = {
        "rounds": [("process", b"\0\x0c\0\0\0"), ("round", b"\0\0\0\x05\0"), ("round", b"\0\x05\x01\x02\x03")],
        "prefill_rebase": [("long_prefill", b"\0\0\0\0"), ("round", b"\0\0\0\x05\0"), ("snapshot", b"\0"),
                           ("round", b"\0\0\x02\x03\0"), ("restore", b"\0\0\0\0\0")],
        "fail_disable": [("process", b"\0\x08\0\0\0"), ("round", b"\0\x05\0\x05\0"), ("draft", b"\0\0"),
                         ("fail", b"\0\0"), ("draft", b"\0\0"), ("fail", b"\0\x02"), ("begin", b"\0"),
                         ("round", b"\0\0\0\x02\0")],
        "fork_shift": [("long_prefill", b"\0\x01\x01\x02"), ("round", b"\0\0\0\x03\0"), ("fork", b"\0\x01"),
                       ("shift", b"\0\x40\x40\0"), ("round", b"\x01\0\0\x03\0"), ("draft_many", b"\0\x03\0\x01\x02")],
        "rollback_accept": [("process", b"\0\x0c\0\0\0"), ("round", b"\0\x08\x01\x02\0"), ("accept", b"\0\x03"),
                            ("rollback", b"\0\x05"), ("round", b"\0\0\0\x02\0"), ("rollback", b"\0\xfb")],
        "invalid_args": [("process", b"\0\x05\x0d\xa0\0"), ("process", b"\0\x05\x0e\xb0\0"),
                         ("process_encoded", b"\0\x03\0\x80\0"), ("draft", b"\0\x0c"), ("accept", b"\0\x0b"),
                         ("fail", b"\0\x04"), ("commit", b"\x0e"), ("introspect", b"\x0f\x01")],
        "restore_damage": [("process", b"\0\x0a\0\0\0"), ("round", b"\0\0\0\x03\0"), ("snapshot", b"\0"),
                           ("restore", b"\0\0\x03\x01\x07"), ("restore", b"\0\0\x04\x02\0"),
                           ("restore", b"\0\0\x06\x00\x01"), ("restore", b"\0\0\x16\x05\x02"),
                           ("restore", b"\0\0\x0a\0\0")],
        "nonfinite": [("process", b"\0\x04\0\0\x07"), ("process", b"\0\x04\0\x01\x0f"),
                      ("process_encoded", b"\0\x03\0\x60\0"), ("round", b"\0\0\0\x02\0")],
        # drafting off (one sequence, a1 bit 0 clear), a skip of its own while rows flow past the
        # window, a snapshot round trip with the switch, then on again for a batch of two (a2 % 4 == 2)
        "drafting_off": [("process", b"\0\x0c\0\0\0"), ("round", b"\0\0\0\x03\0"), ("drafting", b"\0\0\0\0\0"),
                         ("draft", b"\0\0"), ("long_decode", b"\0\x01\x03"), ("snapshot", b"\0"),
                         ("restore", b"\x01\0\0\0\0"), ("drafting", b"\0\x01\x02\x01\0"),
                         ("round", b"\0\0\0\x02\0"), ("round", b"\x01\0\0\x02\0")],
    }
    i = 0
    for name, recs in scripts.items():
        for k, storage in enumerate(STORAGES):
            if (k + i) % 2 and name not in ("rounds", "restore_damage"):
                continue
            cfg = StagerConfig(32 if k % 2 else 64, 1 + (i + k) % 6, 2 * (1 + (i + k) % 6) + 1 + (3 * i + k) % 17,
                               max_seqs=1 + (i + k) % 3, storage=storage,
                               stage_dtype=("float32", "float16", "bfloat16")[(i + k) % 3],
                               nonfinite=("error", "zero", "clamp_f16")[k % 3] if name == "nonfinite" else "error")
            write("ops", f"{name}-{storage}", encode_ops(cfg, recs))
        i += 1
    for k in range(12):
        write("ops", f"random-{k:02d}", prng(f"ops{k}", 5 + 6 * (8 + 4 * k)))
    # Rings that wrap on sequences 1 and 0, forked and shifted: external mode's two slot runs
    # (the mirror table must follow every move of a wrapped parent), then drafted as one batch
    # copying and zero-copy.
    wrap = [("long_decode", b"\x01\x00\x05"), ("round", b"\x01\0\x02\x03\0"), ("fork", b"\x01\x02"),
            ("round", b"\x02\0\x01\x02\0"), ("shift", b"\x02\xc0\x30\0"), ("long_decode", b"\0\x01\x07"),
            ("fork", b"\0\x02"), ("draft_many", b"\0\x03\0\x01\x02"), ("commit", b"\0"), ("commit", b"\x01"),
            ("commit", b"\x02"), ("snapshot", b"\x02"), ("restore", b"\x01\0\0\0\0"), ("round", b"\x01\0\0\x02\0"),
            # ... and a zero-copy batch of the three (a1 = 0x80: three sequences, copy=False)
            ("draft_many", b"\0\x80\0\x01\x02"), ("commit", b"\x02"), ("commit", b"\0"), ("commit", b"\x01")]
    for k, storage in enumerate(STORAGES):
        cfg = StagerConfig(32 if k % 2 else 64, 4, 9 + 5 * k, max_seqs=3, storage=storage, nonfinite="clamp")
        write("ops", f"wrap_fork-{storage}", encode_ops(cfg, wrap))


def threads_seeds() -> None:
    """The threads target decodes like ops: the same seeds."""
    for name in sorted(os.listdir(os.path.join(HERE, "ops"))):
        with open(os.path.join(HERE, "ops", name), "rb") as f:
            write("threads", name, f.read())


def snapshot_seeds() -> None:
    for k in range(24):
        head = prng(f"snapcfg{k}", 5)
        mode = k % 3 | ((k // 3) % 4) << 2
        fields = bytes([k * 3 % 20, 8 + k % 5, 8, 8 + k % 3, 8, 8 + k % 4, 1 | (k & 0x1e), k & 1, k % 4]) + bytes(7)
        write("snapshot", f"seed-{k:02d}", head + bytes([mode]) + fields + prng(f"snaprows{k}", 40 + 13 * k))


def decode_seeds() -> None:
    for k in range(30):
        storage_code = k % 5
        b0 = storage_code | ((k // 5) % 3) << 3
        body = prng(f"dec{k}", 34 * (1 + k % 4) * 3)
        if k % 3 == 1:  # NaN / Inf patterns
            body = bytes(b | 0x7F if i % 2 else b for i, b in enumerate(body))
        write("decode", f"seed-{k:02d}", bytes([b0, k]) + body)


def cpp_stager_config(storage: int, dim: int, block: int, extra: int, seqs: int, threads: bool) -> bytes:
    """The 5 config bytes of csrc/fuzz/fuzz_stager.cpp (nonfinite "error", staged as f32)."""
    b3 = next(b for b in range(128 if threads else 0, 256) if b % 3 == seqs - 1)  # b3 >= 128: threads too
    return bytes([dim | (storage << 1), block - 1, extra, b3, 0])


#: fuzz_stager ops: long decodes (the ring wraps) on sequences 1 and 0, rounds, forks of the
#: wrapped parents, a shift, draft_many, snapshot / restore (one op per group of bytes).
CPP_WRAP_OPS = bytes([3, 1, 3, 15, 1, 0, 0, 2, 3, 12, 1, 2, 15, 2, 0, 0, 1, 2, 11, 2, 200, 30, 0, 6, 0, 3, 0, 0, 1, 2,
                      13, 2, 14, 0, 0, 0, 0, 0, 3, 0, 7, 12, 0, 1, 15, 1, 5, 1, 3, 2, 11, 0, 100, 60, 1, 13, 0,
                      14, 2, 1, 4, 3, 2])


def cpp_seeds() -> None:
    for k in range(24):
        write("cpp_stager", f"seed-{k:02d}", prng(f"cppst{k}", 5 + 7 * (6 + 3 * k)))
    # Wrapped rings away from sequence 0, forked and shifted: external mode's two slot runs.
    for k, (storage, seqs, extra) in enumerate([(0, 3, 20), (3, 3, 5), (4, 2, 39), (1, 3, 12), (2, 2, 0)]):
        write("cpp_stager", f"wrap-{k}", cpp_stager_config(storage, k % 2, 4, extra, seqs, True) + CPP_WRAP_OPS)
    for k in range(24):
        mode = k % 3
        write("cpp_formats", f"seed-{k:02d}", bytes([mode, k % 5, k % 3, k]) + prng(f"cppfm{k}", 40 + 34 * k))
    # fuzz_c_api: 8 config bytes (storage / dim, block, window, max_seqs, policy / stage / strict,
    # rows mode / drafter kind, struct_size, NULL choice), then ops. Random ones, and scripts over both row
    # modes: a long decode (the ring wraps), rounds, fork, shift, snapshot / restore, drafts in
    # every dtype, draft_many, the row-format calls, NULL stagers, introspection.
    for k in range(16):
        write("cpp_c_api", f"seed-{k:02d}", prng(f"capi{k}", 40 + 30 * k))
    script = bytes([3, 1, 17, 1, 2, 3, 3, 11, 1, 2, 10, 0, 128, 40, 12, 0, 0, 13, 1, 0, 0, 0, 4, 1, 0, 1, 0, 6, 1,
                    5, 0, 2, 0, 1, 0, 1, 15, 0, 1, 2, 3, 16, 0, 14, 0, 1, 4, 0, 0, 2, 2, 17, 0, 1, 9, 2])
    for k, (b0, rows_mode) in enumerate([(0x00, 0), (0x00, 1), (0x31, 0), (0x31, 1), (0x40, 0), (0x21, 1)]):
        write("cpp_c_api", f"script-{k}", bytes([b0, 3, 10 + 7 * k, 2, 0, rows_mode, 0, 0]) + script)
    # Rounds verified as trees (op 239: size, shape, node, damage, seed, token ids): valid trees and paths, the
    # batched process_tree and accept_path, a parent after its child, a root off the end, bad paths. The ids
    # byte (fuzz_c_api.cpp's ids_of): 0 right ids (a chain stager's) or none (a block stager's); 7 a negative
    # id, 15 none at all (a chain stager refuses both); 31 ids for a block stager (refused).
    def trees(ids: list[int]) -> bytes:
        recs = [[5, 1, 3, 0, 7], [6, 2, 5, 0xC0, 8], [3, 0, 2, 1, 9], [7, 5, 6, 3, 1], [4, 9, 1, 4, 2], [9, 0, 0, 2, 3]]
        out = [3, 0]  # a long decode: rows to draft from
        for rec, tok in zip(recs, ids):
            out += [239, 0] + rec + [tok]
        return bytes(out + [17, 0, 1, 2, 0, 239, 0, 6, 7, 4, 0x43, 5, ids[-1]])

    for k, rows_mode in enumerate([0, 1]):
        write("cpp_c_api", f"trees-{k}", bytes([0x00, 3, 12, 2, 0, rows_mode, 0, 0]) + trees([0, 0, 0, 31, 0, 31, 0]))
    # A chain drafter's stager (rows-mode byte 6 / 7: kind chain): the script's rows with their token ids.
    for k, rows_mode in enumerate([0, 1]):
        write("cpp_c_api", f"chain-{k}", bytes([0x00, 3, 17, 2, 0, 6 + rows_mode, 0, 0]) + script)
    # ... its trees through dspark_process_tree(_external)(_many)_tokens, a negative id and none among them.
    for k, rows_mode in enumerate([0, 1]):
        write("cpp_c_api", f"chain-trees-{k}", bytes([0x00, 3, 12, 2, 0, 6 + rows_mode, 0, 0]) +
              trees([0, 7, 0, 15, 0, 0x87, 0]))
    # ... and its batches (op >= 240: kind, shape, mode, seed, ids, then per sequence id, rows, value):
    # reserve_many / confirm_many, reserve / cancel, a reservation with a negative id and one with none,
    # process_many, process_external_many (the ids byte as the trees'; 31: a block stager given ids).
    def batches(ids: int) -> bytes:
        return bytes([3, 0, 3, 1,  # long decodes of sequences 0 and 1
                      240, 0, 5, 2, 0, 1, ids, 0, 2, 0, 1, 1, 0,  # reserve_many: 2 rows of 0, 1 of 1
                      240, 0, 6, 2, 0, 1, 0, 0, 0, 0, 1, 0, 0,  # confirm_many
                      240, 0, 9, 1, 0, 2, ids, 0, 3, 0,  # reserve 3 rows of 0
                      240, 0, 11, 1, 1, 2, 0, 0, 0, 0,  # cancel
                      240, 0, 9, 1, 0, 3, 7, 0, 2, 0,  # reserve, a negative id
                      240, 0, 5, 1, 0, 3, 15, 1, 2, 0,  # reserve_many, no ids
                      240, 0, 0, 2, 0, 4, ids, 0, 2, 0, 1, 2, 0,  # process_many
                      240, 0, 1, 2, 0, 5, ids, 0, 1, 0, 1, 3, 0,  # process_external_many
                      240, 0, 0, 1, 0, 6, 7, 1, 3, 0,  # process_many, a negative id
                      17, 0, 1, 2, 1, 239, 0, 4, 1, 3, 0, 9, ids])  # a round, a tree
    for k, rows_mode in enumerate([0, 1]):
        write("cpp_c_api", f"chain-batches-{k}", bytes([0x00, 3, 17, 2, 0, 6 + rows_mode, 0, 0]) + batches(0))
        write("cpp_c_api", f"block-batches-{k}", bytes([0x00, 3, 17, 2, 0, rows_mode, 0, 0]) + batches(31))
    # The device step (op 237: pick, form, steps, outcomes, hole, then the sequences and per step one
    # count byte per sequence): three sequences over four steps; two with an unwritten verify id (hole 7:
    # to_host refuses, then they come back with it written), a drafter failure and a bad count (a
    # sticky fault); the other form of the hand-over (form 15: refused). External rows only.
    device = bytes([3, 0, 3, 1, 3, 2,  # long decodes: rows to step from
                    237, 0, 2, 0, 3, 0, 0, 0, 1, 2, 1, 2, 3, 0, 4, 1, 2, 2, 2, 1, 0, 3,
                    237, 0, 1, 0x10, 2, 0x11, 7, 0, 1, 1, 1, 4, 1, 2, 7,
                    237, 0, 0, 15, 0, 0, 0, 1,
                    17, 0, 1, 2, 1])  # a round after it
    write("cpp_c_api", "chain-device-0", bytes([0x00, 3, 17, 2, 0, 7, 0, 0]) + device)
    write("cpp_c_api", "block-device-0", bytes([0x00, 3, 17, 2, 0, 1, 0, 0]) + device)


#: fuzz_prefix ops (csrc/fuzz/fuzz_prefix.cpp): conversation 0 to 120 positions, published
#: whole; hits at 100, 57 and 120; two blocks evicted and the hit at 100 again (a replay); an
#: export moved to the second store; conversation 1's rows published, then other rows under its
#: held keys (refused); a hit of conversation 1; a damaged export.
CPP_PREFIX_OPS = bytes([0, 0, 39, 0, 0, 39, 0, 0, 39, 1, 0, 2, 0, 3, 0, 0, 100, 0, 5, 3, 0, 0, 57, 0, 0,
                        3, 0, 0, 120, 0, 11, 4, 0, 1, 1, 3, 0, 0, 100, 0, 3, 5, 0, 1, 2, 1, 0, 0, 3,
                        2, 1, 2, 0, 3, 3, 1, 0, 30, 0, 2, 5, 1, 0, 2, 40, 0, 1, 4, 7])


#: fuzz_prefix ops for a chain drafter's hits (dspark_prefix_hit(_many)_tokens on the C ABI's chain stager,
#: the C++ one the oracle): conversation 0 to 120 positions, published; hits whose `how` byte >> 3 draws the
#: ids (7: a negative one, 15: none, 30: also given to the block hitter, refused; the low bits pick the
#: chain sequence); batched hits (op 7, then 5 / 6: hit_many) of three sequences, of a repeated sequence,
#: with a negative id and with none.
CPP_PREFIX_CHAIN_OPS = bytes([0, 0, 39, 0, 0, 39, 0, 0, 39, 1, 0, 2, 0,
                              3, 0, 56, 100, 0, 2, 3, 0, 120, 100, 0, 2, 3, 0, 240, 57, 0, 0,
                              3, 0, 8, 120, 0, 0, 3, 0, 16, 100, 0, 1,
                              7, 5, 2, 0, 0, 0, 100, 0, 1, 0, 57, 0, 2, 0, 120, 0,
                              7, 5, 1, 0, 0, 0, 100, 0, 0, 0, 50, 0,
                              7, 6, 1, 7, 0, 0, 100, 0, 1, 0, 40, 0,
                              7, 5, 0, 15, 1, 0, 90, 0,
                              0, 1, 39, 1, 1, 2, 0, 3, 1, 8, 40, 0, 3, 7, 5, 2, 1, 1, 1, 40, 0, 2, 0, 100, 0, 0, 1, 20, 0])


def cpp_prefix_seeds() -> None:
    # Byte 0: the mode (0 ops, 1 a damaged export, 2 raw bytes); then storage, B, W, block_tokens,
    # pages, budget slack (see config_of in csrc/fuzz/fuzz_prefix.cpp).
    for k in range(24):
        write("cpp_prefix", f"seed-{k:02d}", bytes([k % 3]) + prng(f"cpppf{k}", 40 + 30 * k))
    for k, (storage, block, extra, tokens, pages) in enumerate(
            [(0, 3, 40, 6, 12), (3, 3, 20, 2, 4), (4, 1, 47, 8, 3), (1, 5, 9, 10, 2), (2, 0, 30, 11, 1)]):
        write("cpp_prefix", f"script-{k}", bytes([0, storage, block, extra, tokens, pages, 7]) + CPP_PREFIX_OPS)
        write("cpp_prefix", f"chain-{k}", bytes([0, storage, block, extra, tokens, pages, 7]) + CPP_PREFIX_CHAIN_OPS)


def findings() -> None:
    """Minimal reproducers of the findings (see findings/KNOWN_OPEN)."""
    cfg = StagerConfig(32, 4, 16)
    # A row at position 2**62 - 1 is accepted, so end == 2**62, which restore rejects:
    # the sequence's own snapshot cannot be restored.
    write("findings/ops", "end-at-max-position", encode_ops(cfg, [("process", b"\0\x01\x0f\0\0")]))
    # fail(seq, ["decode"]): the binding raises TypeError (dict lookup), the reference ValueError.
    write("findings/ops", "fail-stage-unhashable",
          encode_ops(cfg, [("process", b"\0\x08\0\0\0"), ("draft", b"\0\0"), ("fail", b"\0\x09")]))
    # restore accepts horizon (8) above the lowest end an accept can leave (10 - 5 + 1 = 6);
    # accept(0) then leaves end 6 < horizon 8 and the core's snapshot() throws std::length_error.
    head = bytes([2, 18, 16, 13, 8, 13, 17, 0, 0]) + bytes(7)
    write("findings/snapshot", "restore-horizon-above-firm-end",
          encode_ops(cfg, []) + bytes([2]) + head + bytes(64))
    # C++: the same two core findings for the libFuzzer targets.
    write("findings/cpp_stager", "end-at-max-position", bytes([0x7F, 0x3F, 0xA2, 0x66, 0xF8, 0xB4, 0x15, 0x8D, 0xFF]))
    # C ABI: with strict on, dspark_draft(n_past = 2**62) fails with DSPARK_E_STATE (the strict
    # check ran before the range check) where the C++ API raises std::invalid_argument.
    write("findings/cpp_c_api", "strict-before-range-check",
          bytes([0, 3, 10, 0, 0xE0, 0, 0, 0, 1, 0, 3, 0, 0, 5, 0, 0, 4, 0, 11, 0, 0]))
    # ... and dspark_draft_many with a repeated sequence id fails with DSPARK_E_STATE (strict
    # first) where the C++ API rejects the repeated id (std::invalid_argument).
    write("findings/cpp_c_api", "strict-before-duplicate-ids",
          bytes([0, 3, 10, 0, 0xE0, 0, 0, 0, 1, 0, 3, 0, 0, 5, 0, 0, 5, 0, 2, 9, 0, 0, 0]))
    # ... and a strict dspark_draft_many of a busy sequence and an unknown id reports the busy one
    # (DSPARK_E_STATE) where the C++ (and Python) API first reject the unknown id.
    write("findings/cpp_c_api", "strict-before-unknown-id",
          bytes([0, 3, 10, 2, 0xE0, 0, 0, 0, 1, 2, 3, 0, 0, 5, 0, 0, 4, 2, 0, 0, 0, 5, 0, 2, 0, 0, 2, 15]))
    # ... and a strict dspark_draft_many whose second n_past is negative reports the first
    # sequence's mismatch (DSPARK_E_STATE) where the C++ API rejects the negative n_past.
    write("findings/cpp_c_api", "strict-before-range-check-many",
          bytes([0, 3, 10, 1, 0xE0, 0, 0, 0, 1, 0, 3, 0, 0, 5, 0, 0, 5, 0, 2, 9, 0, 0, 1]))
    write("findings/cpp_formats", "restore-horizon-above-firm-end",
          bytes([2, 0, 3, 2, 2, 17, 18, 16, 13, 8, 13, 0]) + bytes(2 * 128))
    # Decoders: NaN quiet bit. bf16 storage -> bfloat16 keeps a signalling NaN (0xff9a) that the
    # reference quiets (0xffda); f32 storage -> float16 quiets (0x7eb7) where numpy does not (0x7cb7).
    def b0(storage: int, out: int) -> int:
        return next(b for b in range(256) if b % 5 == storage and (b >> 3) % 3 == out)

    write("findings/decode", "bf16-snan-to-bfloat16", bytes([b0(2, 2), 0, 0x9A, 0xFF]))
    write("findings/decode", "f32-snan-to-float16", bytes([b0(0, 1), 0, 0x00, 0x00, 0xB7, 0x7F]))


def main() -> None:
    for sub in ("ops", "threads", "snapshot", "decode", "cpp_stager", "cpp_formats", "cpp_c_api", "cpp_prefix"):
        shutil.rmtree(os.path.join(HERE, sub), ignore_errors=True)
    ops_seeds()
    threads_seeds()
    snapshot_seeds()
    decode_seeds()
    cpp_seeds()
    cpp_prefix_seeds()
    findings()
    for sub in ("ops", "threads", "snapshot", "decode", "cpp_stager", "cpp_formats", "cpp_c_api", "cpp_prefix"):
        print(sub, len(os.listdir(os.path.join(HERE, sub))))


if __name__ == "__main__":
    main()
