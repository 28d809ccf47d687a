"""``copy_slot_rows``: an owner's table copies of one change in one core call.

The oracle is the copies one at a time in numpy, in order (a later move reads
what an earlier one wrote: fork / shift moves within one table overlap). A
move outside either table is refused before any row is copied.
"""

from __future__ import annotations

import numpy as np
import pytest

from dspark_core._ext._stager import copy_slot_rows


def numpy_copies(src: np.ndarray, dst: np.ndarray, moves: np.ndarray) -> None:
    for s, d, m in moves.tolist():
        dst[d : d + m] = src[s : s + m].copy()


def random_moves(rng, src_rows: int, dst_rows: int, n: int) -> np.ndarray:
    out = []
    for _ in range(n):
        m = int(rng.integers(1, min(src_rows, dst_rows) // 2 + 1))
        out.append([int(rng.integers(0, src_rows - m + 1)), int(rng.integers(0, dst_rows - m + 1)), m])
    return np.array(out, np.int64).reshape(-1, 3)


@pytest.mark.parametrize("same_table", [False, True], ids=["two tables", "one table (overlapping moves)"])
def test_copies_equal_numpy_copies_in_order(same_table):
    rng = np.random.default_rng(11)
    for trial in range(50):
        row_bytes = int(rng.choice([34, 136, 272]))
        src = rng.integers(0, 256, (int(rng.integers(8, 40)), row_bytes), dtype=np.uint8)
        dst = src if same_table else rng.integers(0, 256, (int(rng.integers(8, 40)), row_bytes), dtype=np.uint8)
        moves = random_moves(rng, len(src), len(dst), int(rng.integers(0, 12)))
        want_src, want_dst = src.copy(), dst.copy()
        numpy_copies(want_src, want_src if same_table else want_dst, moves)
        copy_slot_rows(src, dst, moves)
        assert np.array_equal(src, want_src), trial
        if not same_table:
            assert np.array_equal(dst, want_dst), trial


@pytest.mark.parametrize("bad", [[0, 0, 0], [-1, 0, 1], [0, -1, 1], [9, 0, 2], [0, 7, 2], [0, 0, 2**62],
                                 [2**62, 0, 2**62]],
                         ids=["empty", "src < 0", "dst < 0", "past src", "past dst", "huge", "overflowing"])
def test_a_move_outside_a_table_copies_nothing(bad):
    src = np.arange(10 * 4, dtype=np.uint8).reshape(10, 4)
    dst = np.zeros((8, 4), np.uint8)
    moves = np.array([[0, 0, 3], bad], np.int64)  # a good move first: it must not be applied either
    with pytest.raises(ValueError, match=r"move 1 \["):
        copy_slot_rows(src, dst, moves)
    assert not dst.any()


def test_tables_and_moves_of_the_wrong_kind_are_type_errors():
    t = np.zeros((4, 8), np.uint8)
    with pytest.raises(TypeError, match="src"):
        copy_slot_rows(np.zeros((4, 8), np.float32), t, [[0, 0, 1]])
    with pytest.raises(TypeError, match="dst"):
        copy_slot_rows(t, t[:, ::2], [[0, 0, 1]])
    with pytest.raises(ValueError, match="rows of 8 and 4 bytes"):
        copy_slot_rows(t, np.zeros((4, 4), np.uint8), [[0, 0, 1]])
    with pytest.raises(ValueError, match=r"\(n, 3\)"):
        copy_slot_rows(t, t, [0, 0, 1])
    ro = np.zeros((4, 8), np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        copy_slot_rows(t, ro, [[0, 0, 1]])
