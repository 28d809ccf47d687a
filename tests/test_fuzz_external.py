"""The fuzz harness's external-row twin and thread replay can fail.

``run_differential(..., external=True)`` runs every call on an external-row core
too, whose rows live in a mirror table the harness writes and moves as an owner
does; ``replay_threads`` replays the calls on single sequences from two threads
against a serial replay. Each is shown to pass on the real core for a script
that wraps rings on sequences other than 0, forks and shifts them, and to raise
``Desync`` for a deliberately broken core.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from dspark_core import Stager, StagerConfig
from dspark_core.testing import Desync, decode_ops, encode_ops, replay_threads, run_differential
from dspark_core.testing import differential

CFG = StagerConfig(32, 4, 21, max_seqs=3, storage="q8_0", nonfinite="clamp")
# A long decode on sequence 1 (its ring wraps), rounds, a fork of the wrapped parent, a shift, draft_many,
# snapshot / restore (the same script as tests/fuzz_corpus/ops/wrap_fork-*).
SCRIPT = [("long_decode", b"\x01\x00\x05"), ("round", b"\x01\0\x02\x03\0"), ("fork", b"\x01\x02"),
          ("round", b"\x02\0\x01\x02\0"), ("shift", b"\x02\xc0\x30\0"), ("long_decode", b"\0\x01\x07"),
          ("fork", b"\0\x02"), ("draft_many", b"\0\x03\0\x01\x02"), ("commit", b"\0"), ("commit", b"\x01"),
          ("commit", b"\x02"), ("snapshot", b"\x02"), ("restore", b"\x01\0\0\0\0"), ("round", b"\x01\0\0\x02\0")]


def ops():
    config, decoded = decode_ops(encode_ops(CFG, SCRIPT))
    assert config == CFG
    return decoded


def test_the_real_core_passes_external_and_threads():
    report = run_differential(CFG, ops(), external=True)
    assert report.calls["fork"] == 2 and report.calls["shift"] == 1 and report.calls["process"] > 100
    assert replay_threads(CFG, report.made) > 100


class ForkShiftsItsLastMove:
    """An external core whose fork sends its second run onto the child's first slots
    (the mutant of issue 22: the destination not advanced between the parent's runs)."""

    def __init__(self) -> None:
        self._st = Stager(CFG.replace(rows="external"))

    def __getattr__(self, name):
        return getattr(self._st, name)

    def fork(self, src, dst):
        moves = np.array(self._st.fork(src, dst))
        if len(moves) == 2:
            moves[1, 1] = moves[0, 1]
        return moves


class PlansOffByOne:
    """An external core whose plans name the slot after each row's."""

    def __init__(self) -> None:
        self._st = Stager(CFG.replace(rows="external"))

    def __getattr__(self, name):
        return getattr(self._st, name)

    def draft(self, seq, n_past):
        plan = self._st.draft(seq, n_past)
        plan.slots = plan.slots + 1
        return plan


@pytest.mark.parametrize("broken", [ForkShiftsItsLastMove, PlansOffByOne])
def test_a_broken_external_core_is_caught(broken):
    with pytest.raises(Desync, match="external|mirror"):
        run_differential(CFG, ops(), external_core=broken())


class RacesInThreads:
    """A core whose calls from a worker thread go wrong (one extra row is dropped by a
    rollback before each draft): what a missing lock or a shared buffer would look like."""

    def __init__(self, cfg) -> None:
        self._st = Stager(cfg)

    def __getattr__(self, name):
        return getattr(self._st, name)

    def draft(self, seq, n_past):
        if threading.current_thread() is not threading.main_thread():
            st = self._st.state(seq)
            if st["started"] and not st["open_round"] and st["end"] > st["horizon"]:
                self._st.rollback(seq, st["end"] - 1)
        return self._st.draft(seq, n_past)


def test_replay_threads_catches_a_core_that_goes_wrong_in_threads():
    calls = run_differential(CFG, ops()).made
    with pytest.raises(Desync, match="from threads"):
        differential._replay_threads(CFG, calls, 2, False, RacesInThreads)
