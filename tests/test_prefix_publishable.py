"""``Stager.publishable(seq)``: the positions whose rows a prefix store's ``publish`` can take now.

The oracles: the reference twin's ``publishable`` (the same range after every call of a random
protocol run: prefill chunks, rounds, verify batches before and after ``accept``, hits), and
publishing itself: every block inside the range publishes, every block reaching outside it is
refused as before (but a block longer than ``K`` whose kept rows are inside it).
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import massive_rows
from dspark_core import PrefixStore, Stager, StagerConfig
from dspark_core.reference import ReferencePrefixStore, ReferenceStager

D, B, W, BT = 32, 4, 64, 8
K = W // 2
IMPLS = {"core": (Stager, PrefixStore), "reference": (ReferenceStager, ReferencePrefixStore)}


def _config(rows: str = "held", max_seqs: int = 3) -> StagerConfig:
    return StagerConfig(D, B, W, max_seqs=max_seqs, storage="q8_0", rows=rows)


def _feed(st, seq: int, lo: int, rows: np.ndarray) -> None:
    pos = np.arange(lo, lo + len(rows))
    st.process(seq, pos, rows if st.config.rows == "held" else None)


@pytest.mark.parametrize("rows", ["held", "external"])
def test_publishable_equals_the_twins_through_a_random_protocol_run(rows):
    cfg = _config(rows)
    core, ref = Stager(cfg), ReferenceStager(cfg)
    stores = PrefixStore(cfg, BT, 1 << 20), ReferencePrefixStore(cfg, BT, 1 << 20)
    rng = np.random.default_rng(7)
    text = massive_rows(rng, 600, D)
    end = [0] * cfg.max_seqs
    seen = set()
    for step in range(300):
        q = int(rng.integers(cfg.max_seqs))
        op = rng.choice(["prefill", "round", "hit"], p=[0.4, 0.5, 0.1])
        if op == "prefill" and end[q] < 500:
            n = int(rng.integers(1, 40))
            for st in (core, ref):
                _feed(st, q, end[q], text[end[q]:end[q] + n])
            end[q] += n
        elif op == "round" and end[q] > 0:
            # A round: draft, commit, the verify batch (B + 1 rows), then accept some of it.
            n_acc = int(rng.integers(0, B + 1))
            for st in (core, ref):
                st.draft(q, end[q])
                st.commit(q)
                _feed(st, q, end[q], text[end[q]:end[q] + B + 1])
            assert core.publishable(q) == ref.publishable(q), (step, "verify batch open")
            seen.add("tentative" if core.publishable(q)[1] < end[q] + B + 1 else "final")
            for st in (core, ref):
                st.accept(q, n_acc)
            end[q] += n_acc + 1
        elif op == "hit" and end[q] >= BT:
            # The sequence starts over from the blocks another one published.
            src = (q + 1) % cfg.max_seqs
            lo, hi = core.publishable(src)
            lo, hi = -(-lo // BT) * BT, hi // BT * BT
            if hi > lo:
                keys = [step * 1000 + s for s in range(lo, hi, BT)]
                for st, store in zip((core, ref), stores):
                    store.publish(st, src, keys, lo, hi)
                h = hi if lo == 0 else 0
                for st, store in zip((core, ref), stores):
                    store.hit(st, q, keys[: -(-h // BT)] if h else [], h)
                end[q] = core.state(q)["end"] if core.state(q)["started"] else 0
                seen.add("hit")
        for s in range(cfg.max_seqs):
            assert core.publishable(s) == ref.publishable(s), (step, op, s)
        assert core.publishable(q)[0] == (core.state(q)["horizon"] if core.state(q)["started"] else 0)
    assert {"tentative", "hit"} <= seen
    assert any(core.publishable(s)[0] > 0 for s in range(cfg.max_seqs))  # a horizon past 0 was met


def _situation(impl: str, block_tokens: int = BT):
    """Sequence 0 past the window with a verify batch not yet accepted (lo > 0, hi below its
    end); sequence 1 never started."""
    stager, store_type = IMPLS[impl]
    cfg = _config()
    st = stager(cfg)
    rows = massive_rows(np.random.default_rng(3), 200, D)
    _feed(st, 0, 0, rows[:150])
    st.draft(0, 150)
    st.commit(0)
    _feed(st, 0, 150, rows[150:150 + B + 1])  # tentative until accept
    return st, lambda: store_type(cfg, block_tokens, 1 << 20)


def _publishes(st, store, s: int, e: int) -> bool:
    try:
        store.publish(st, 0, [s * 7919 + e], s, e)  # one block, a key of its own
    except ValueError as exc:
        assert "no longer held" in str(exc) or "reach past its final rows" in str(exc), exc
        return False
    return True


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_blocks_inside_the_range_publish_and_blocks_outside_are_refused(impl):
    st, new_store = _situation(impl)
    lo, hi = st.publishable(0)
    assert (lo, hi) == (st.state(0)["horizon"], 151)  # the verify batch's first row is final
    assert 0 < lo < hi < st.state(0)["end"]
    assert st.publishable(1) == (0, 0)
    outcomes = []
    for s in range(0, 160, BT):  # every whole block, and the partial one ending at or past hi
        for e in sorted({s + BT, min(s + BT, hi), min(s + BT, hi + 1)}):
            if e <= s:
                continue
            inside = lo <= s and e <= hi
            assert _publishes(st, new_store(), s, e) == inside, (s, e, lo, hi)
            outcomes.append(inside)
    assert sum(outcomes) >= K // BT and not all(outcomes)


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_a_block_longer_than_k_publishes_from_below_lo_when_its_kept_rows_are_inside(impl):
    """The one exception to "inside the range": a block of more than K tokens that ends past
    W - B keeps only its last K rows, so it publishes while those are held."""
    long_block = 2 * K + 8  # ends past W - B; keeps [e - K, e)
    st, new_store = _situation(impl, long_block)
    lo, hi = st.publishable(0)
    e = hi // long_block * long_block
    s = e - long_block
    assert s < lo <= e - K and e > W - B
    assert _publishes(st, new_store(), s, e)


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_publishable_refuses_what_publish_refuses(impl):
    """A sequence publish cannot take rows from (an open round, an unknown id) is refused by
    publishable with publish's error."""
    stager, store_type = IMPLS[impl]
    cfg = _config()
    st, store = stager(cfg), store_type(cfg, BT, 1 << 20)
    _feed(st, 0, 0, massive_rows(np.random.default_rng(1), 20, D))
    st.draft(0, 20)  # a round open: not ready
    for seq in (0, cfg.max_seqs, -1):
        with pytest.raises(Exception) as want:
            store.publish(st, seq, [1], 0, BT)
        with pytest.raises(type(want.value)) as got:
            st.publishable(seq)
        assert str(got.value) == str(want.value)
