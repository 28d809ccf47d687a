"""The window loop and a q4_0 round trip through the Python API.

Prints the same lines as window_loop_c.c (the C ABI) and window_loop_cpp.cpp (the C++
SDK through find_package); .ci/sdk_check.sh compares the three outputs. The
plans are also checked against the hand-worked table of
tests/test_window_loop.py and the q4_0 bytes against gguf-py's quantizer, so
the Python side is not its own oracle.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

import dspark_core
from dspark_core import Stager, StagerConfig, dequantize_rows, quantize_rows
from dspark_core.formats import find_nonfinite

BLOCK, WINDOW, PROMPT, ROUNDS = 7, 20, 5, 8
ACCEPTS = [7, 3, 0, 7, 5, 1, 4]
# (start, rebase, clear_cache, first_row, pos_base) per round, worked by hand
# (tests/test_window_loop.py: K = 10, first rebase at 17).
EXPECTED = [
    (5, False, True, 0, 0),
    (13, False, False, 5, 0),
    (17, True, True, 7, 7),
    (18, False, False, 17, 7),
    (26, True, True, 16, 16),
    (32, True, True, 22, 22),
    (34, False, False, 32, 22),
    (39, True, True, 29, 29),
]


def demo_rows(first_pos: int, n: int, dim: int, version: int) -> np.ndarray:
    """examples/sdk/demo_rows.h's rows (every value exact in float32)."""
    pos = np.arange(first_pos, first_pos + n, dtype=np.int64)[:, None]
    col = np.arange(dim, dtype=np.int64)[None, :]
    k = (pos * 7919 + col * 104729 + version * 15485863) % 2001 - 1000
    v = k / 256.0 + np.where(col % 29 == 5, 4096.0 + pos, 0.0)
    v = np.where(pos == 0, v * 64.0, v)
    return v.astype(np.float32)


def fnv1a(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def window_loop(name: str, storage: str, dim: int) -> None:
    st = Stager(StagerConfig(feature_dim=dim, block_size=BLOCK, window=WINDOW, storage=storage))
    st.begin(0)
    st.process(0, np.arange(PROMPT), demo_rows(0, PROMPT, dim, 0))
    n_past = PROMPT
    for rnd in range(ROUNDS):
        plan = st.draft(0, n_past)
        first_row = int(plan.positions[0]) + plan.pos_base
        assert (plan.start, plan.rebase, plan.clear_cache, first_row, plan.pos_base) == EXPECTED[rnd], rnd
        rows = np.ascontiguousarray(plan.rows, dtype=np.float32)
        print(
            f"loop {name} round={rnd} start={plan.start} rebase={int(plan.rebase)} "
            f"clear_cache={int(plan.clear_cache)} pos_base={plan.pos_base} first_row={first_row} "
            f"n_rows={len(plan.positions)} crop_from={plan.crop_from} rows_fnv={fnv1a(rows.tobytes()):016x}"
        )
        st.commit(0)
        if rnd == ROUNDS - 1:
            break
        st.process(0, np.arange(n_past, n_past + BLOCK + 1), demo_rows(n_past, BLOCK + 1, dim, rnd + 1))
        st.accept(0, ACCEPTS[rnd])
        n_past += ACCEPTS[rnd] + 1
    s = st.stats(0)
    print(
        f"loop {name} stats rounds={s['rounds']} commits={s['commits']} rebases={s['rebases']} "
        f"staged_rows={s['staged_rows']} restaged_rows={s['restaged_rows']}"
    )
    # Accepted drafts per verified round (the commit of the last round has no verify yet).
    print(f"loop {name} accepted " + " ".join(str(int(n)) for n in st.accepted(0)) +
          f" verified_rounds={s['verified_rounds']}")


def q4_0_round_trip() -> None:
    n, dim = 6, 64
    rows = demo_rows(0, n, dim, 99)
    encoded = quantize_rows(rows, "q4_0")
    assert encoded.tobytes() == gguf_quantize(rows, GGMLQuantizationType.Q4_0).tobytes()
    decoded = dequantize_rows(encoded, "q4_0", dim)
    print(
        f"q4_0 rows={n} dim={dim} row_bytes={encoded.shape[1]} encoded_fnv={fnv1a(encoded.tobytes()):016x} "
        f"decoded_fnv={fnv1a(decoded.astype(np.float32).tobytes()):016x} first_bad={find_nonfinite(rows)}"
    )
    rows[2, 17] = np.nan
    print(f"q4_0 nan first_bad={find_nonfinite(rows)}")


if __name__ == "__main__":
    assert dspark_core.__version__
    window_loop("f32", "f32", 32)
    window_loop("q4_0", "q4_0", 64)
    q4_0_round_trip()
