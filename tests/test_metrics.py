"""Per-request acceptance metrics and the Stager's totals (docs/design.md, "Metrics").

The oracles: counts the driver recomputes from the calls it made (which accept
verified which committed round, which skip each plan reported), the reference
twin (``ReferenceStager``, which models the counters on its own), and the
Prometheus project's own parser of the text format (``prometheus_client``).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from dspark_core import Stager, StagerConfig
from dspark_core.metrics import CONTENT_TYPE, METRIC_HELP, prometheus_text
from dspark_core.reference import SEMANTIC_STATS, ReferenceStager
from dspark_core.stager.config import STORAGES
from dspark_core.stager.stage_plan import SKIP_REASONS
from dspark_core.stager.totals import COUNTERS, GAUGES, PEAKS, StagerTotals
from conftest import massive_rows

B, W, D = 3, 13, 32


def _cfg(storage: str = "f16", rows: str = "held", max_seqs: int = 3) -> StagerConfig:
    return StagerConfig(feature_dim=D, block_size=B, window=W, max_seqs=max_seqs, storage=storage, rows=rows)


class _Driver:
    """Runs a server's loop on several Stagers in lock step and keeps its own books:
    the histogram of the accept counts of rounds it committed and then verified, the
    skips per reason the plans reported, and the same over every request (totals)."""

    def __init__(self, stagers, rng):
        self.sts = stagers
        self.rng = rng
        n = stagers[0].config.max_seqs
        self.n_past = [0] * n
        self.hist = [np.zeros(B + 1, np.int64) for _ in range(n)]
        self.skips = [dict.fromkeys(SKIP_REASONS, 0) for _ in range(n)]
        self.total_hist = np.zeros(B + 1, np.int64)
        self.total_skips = dict.fromkeys(SKIP_REASONS, 0)
        self.owed = [False] * n  # a committed round whose verify has not come yet

    def rows(self, p0: int, n: int) -> np.ndarray:
        """Activation-like rows (massive channels; the BOS row only at position 0), clipped to f16's range."""
        x = massive_rows(self.rng, n + (p0 > 0), D, peak=3e4)
        return np.clip(x[1:] if p0 > 0 else x, -6e4, 6e4)

    def each(self, call: str, *args):
        out = [getattr(st, call)(*args) for st in self.sts]
        return out[0]

    def process(self, seq: int, n: int) -> None:
        x = self.rows(self.n_past[seq], n)
        p = np.arange(self.n_past[seq], self.n_past[seq] + n)
        for st in self.sts:
            st.process(seq, p, None if st.config.rows == "external" else x)

    def draft(self, seq: int, n_past: int):
        plan = self.each("draft", seq, n_past)
        self.owed[seq] = False  # any draft ends the last round's verify
        if plan.skip is not None:
            self.skips[seq][plan.skip] += 1
            self.total_skips[plan.skip] += 1
        return plan

    def reset(self, seq: int) -> None:
        """The request on seq is over (begin / end / fork into it / restore): its books go to the totals."""
        self.hist[seq][:] = 0
        self.skips[seq] = dict.fromkeys(SKIP_REASONS, 0)
        self.owed[seq] = False

    def accept(self, seq: int, n: int, rows: int) -> None:
        """accept(n) after ``rows`` rows since the last draft: a committed round's verify
        counts the drafts it keeps."""
        self.each("accept", seq, n)
        if self.owed[seq] and rows > 0:
            kept = min(n, rows - 1)
            self.hist[seq][kept] += 1
            self.total_hist[kept] += 1
            self.owed[seq] = False

    def verified_round(self, seq: int, accepted: int, fail: bool = False) -> None:
        """draft, commit (or fail), the verify batch's B + 1 rows, accept."""
        plan = self.draft(seq, self.n_past[seq])
        opened = plan.skip is None
        if opened:
            self.each("fail" if fail else "commit", seq)
            self.owed[seq] = not fail
        n_rows = B + 1 if opened else 1
        self.process(seq, n_rows)
        a = accepted if opened else 0
        self.accept(seq, a, n_rows)
        self.n_past[seq] += min(a + 1, n_rows)


def _run(drv: _Driver, steps: int, draw) -> None:
    n = drv.sts[0].config.max_seqs
    for seq in range(n):
        drv.process(seq, 4 + seq)
        drv.n_past[seq] = 4 + seq
    for _ in range(steps):
        seq = draw(0, n - 1)
        op = draw(0, 12)
        if op <= 5:
            drv.verified_round(seq, draw(0, B))
        elif op == 6:
            drv.verified_round(seq, draw(0, B), fail=True)
        elif op == 7:  # a plain decode: one row (a committed round's verify of `last` alone), an accept
            drv.process(seq, 1)
            drv.n_past[seq] += 1
            drv.accept(seq, draw(0, B), 1)
        elif op == 8:  # a stale draft: a skip the driver counts from the plan
            drv.draft(seq, max(0, drv.n_past[seq] - draw(1, 3)))
        elif op == 9:
            drv.each("disable" if draw(0, 1) else "enable", seq)
        elif op == 12:  # a committed round whose verify may never come: the next draft ends it
            if drv.draft(seq, drv.n_past[seq]).skip is None:
                drv.each("commit", seq)
                drv.owed[seq] = True
        elif op == 10:  # the request ends; a new one starts on the slot
            drv.each("end" if draw(0, 1) else "begin", seq)
            drv.reset(seq)
            drv.n_past[seq] = 0
            drv.process(seq, 3)
            drv.n_past[seq] = 3
        elif op == 11:  # a fork into another slot: the child's books start afresh
            dst = (seq + 1) % n
            drv.each("fork", seq, dst)
            drv.reset(dst)
            drv.n_past[dst] = drv.n_past[seq]


@settings(max_examples=40, deadline=None)
@given(seed=hs.integers(0, 2**32 - 1), storage=hs.sampled_from(STORAGES), rows=hs.sampled_from(["held", "external"]),
       steps=hs.integers(1, 120))
def test_metrics_equal_the_counts_recomputed_from_the_calls(seed, storage, rows, steps):
    """stats(seq), accepted(seq) and totals() of the core and of the twin equal the books a
    driver keeps of its own calls, after every kind of request change."""
    rng = np.random.default_rng(seed)
    core, ref = Stager(_cfg(storage, rows)), ReferenceStager(_cfg(storage, rows))
    drv = _Driver([core, ref], rng)
    _run(drv, steps, lambda lo, hi: int(rng.integers(lo, hi + 1)))
    for seq in range(3):
        for st in (core, ref):
            np.testing.assert_array_equal(st.accepted(seq), drv.hist[seq])
            s = st.stats(seq)
            assert s["verified_rounds"] == drv.hist[seq].sum()
            assert s["accepted_tokens"] == int(np.dot(np.arange(B + 1), drv.hist[seq]))
            assert {r: s["skips_" + r] for r in SKIP_REASONS} == drv.skips[seq]
            assert s["skips"] == sum(drv.skips[seq].values())
        assert {k: core.stats(seq)[k] for k in SEMANTIC_STATS} == ref.stats(seq)
    for st in (core, ref):
        t = st.totals()
        np.testing.assert_array_equal(t.accepted, drv.total_hist)
        assert t.stats["verified_rounds"] == drv.total_hist.sum()
        assert {r: t.stats["skips_" + r] for r in SKIP_REASONS} == drv.total_skips
        assert t.started == sum(st.state(q)["started"] for q in range(3))
    assert {k: core.totals().stats[k] for k in SEMANTIC_STATS} == ref.totals().stats


def test_totals_keep_ended_requests_and_combine_levels_by_their_rule():
    """Counters add up over every request since the Stager was made, gauges over the
    requests now, peaks keep the largest; restore and a prefix-free begin retire too."""
    for st in (Stager(_cfg()), ReferenceStager(_cfg())):
        drv = _Driver([st], np.random.default_rng(1))
        drv.process(0, 20)
        drv.n_past[0] = 20
        for a in (3, 1, 0):
            drv.verified_round(0, a)
        drv.process(1, 5)
        before = st.totals()
        s0 = st.stats(0)
        assert before.stats["rows"] == s0["rows"] + st.stats(1)["rows"]
        assert before.stats["peak_rows"] == max(s0["peak_rows"], st.stats(1)["peak_rows"])
        snap = st.snapshot(1)
        st.restore(0, snap)  # the request on 0 is replaced: its counters stay in the totals
        after = st.totals()
        for k in COUNTERS:
            assert after.stats[k] == before.stats[k], k
        np.testing.assert_array_equal(after.accepted, [1, 1, 0, 1])
        assert after.stats["peak_rows"] == before.stats["peak_rows"]
        assert after.stats["rows"] == 2 * st.stats(1)["rows"]  # the gauges: the two requests now
        st.end(0)
        st.end(1)
        final = st.totals()
        assert final.stats["rows"] == final.stats["live_rows"] == final.started == 0
        assert final.stats["rounds"] == before.stats["rounds"] and final.stats["peak_rows"] == before.stats["peak_rows"]
        assert st.stats(0)["rounds"] == 0 and not st.accepted(0).any()


def test_a_reservation_counts_in_the_totals_once_confirmed():
    """reserve may trim dead rows and raise the peak; cancel puts the sequence back as it was.
    The totals count a sequence as before its open reservation, so neither a reservation nor
    its cancel moves them back: what it counted appears at confirm."""
    from dspark_core.stager.config import TRIM_CHUNK

    for st in (Stager(_cfg(rows="external")), ReferenceStager(_cfg(rows="external"))):
        st.process(0, np.arange(W))
        st.reserve(0, np.arange(W, W + TRIM_CHUNK + W))  # past the horizon by a whole chunk: a trim
        assert st.stats(0)["trims"] == 1
        settled = st.totals()
        assert settled.stats["trims"] == 0 and settled.stats["rows"] == W and settled.stats["peak_rows"] == W
        st.cancel(0)
        assert st.totals() == settled and st.stats(0)["trims"] == 0
        st.reserve(0, np.arange(W, W + TRIM_CHUNK + W))
        st.confirm(0)
        after = st.totals()
        assert after.stats["trims"] == 1 and after.stats["trimmed_rows"] == st.stats(0)["trimmed_rows"] > 0
        assert after.stats["rows"] == st.stats(0)["rows"]


def test_the_core_names_its_levels_and_the_rest_are_counters():
    assert set(GAUGES) == {"live_rows", "rows", "bytes", "reserved_bytes"}
    assert set(PEAKS) == {"peak_rows", "peak_bytes"}
    assert {"verified_rounds", "accepted_tokens", "skips"} <= set(COUNTERS)
    assert {"skips_" + r for r in SKIP_REASONS} <= set(COUNTERS)
    assert not set(COUNTERS) & (set(GAUGES) | set(PEAKS))


def test_accepted_many_is_each_sequences_histogram_read_at_once():
    rng = np.random.default_rng(3)
    core, ref = Stager(_cfg()), ReferenceStager(_cfg())
    drv = _Driver([core, ref], rng)
    _run(drv, 60, lambda lo, hi: int(rng.integers(lo, hi + 1)))
    for st in (core, ref):
        got = st.accepted_many([2, 0, 2])
        assert got.shape == (3, B + 1) and got.dtype == np.int64
        np.testing.assert_array_equal(got, np.stack([st.accepted(2), st.accepted(0), st.accepted(2)]))
        assert st.accepted_many([]).shape == (0, B + 1)
        with pytest.raises(ValueError, match=r"accepted_many: seqs\[1\] \(sequence 7\)"):
            st.accepted_many([0, 7])
    np.testing.assert_array_equal(core.accepted_many([0, 1, 2]), ref.accepted_many([0, 1, 2]))


def test_metrics_of_a_handed_over_sequence_are_live_from_the_step_state():
    """stats / accepted / accepted_many / totals read a handed-over sequence's step state: its
    counters advance with every step (they never stall until to_host, nor go back after it),
    and they equal the reference twin's after every step."""
    core, ref = Stager(_cfg(rows="external")), ReferenceStager(_cfg(rows="external"))
    with pytest.raises(ValueError, match="unknown sequence 9"):
        core.accepted(9)
    for st in (core, ref):
        st.process(0, np.arange(6))
        st.to_device([0])
    seen = []
    for a in (-1, 0, 2, 1, 0):
        for st in (core, ref):
            st.step_many([0], [a])
        t, r = core.totals(), ref.totals()
        common = t.stats.keys() & r.stats.keys()
        assert {k: t.stats[k] for k in common} == {k: r.stats[k] for k in common}
        np.testing.assert_array_equal(t.accepted, r.accepted)
        np.testing.assert_array_equal(core.accepted(0), ref.accepted(0))
        np.testing.assert_array_equal(core.accepted_many([0, 1]), ref.accepted_many([0, 1]))
        sc, sr = core.stats(0), ref.stats(0)
        assert {k: sc[k] for k in sc.keys() & sr.keys()} == {k: sr[k] for k in sc.keys() & sr.keys()}
        seen.append(t)
    rounds = [t.stats["rounds"] for t in seen]
    assert rounds == sorted(rounds) and rounds[-1] > rounds[0]  # live: the steps show
    assert seen[-1].stats["verified_rounds"] == 3
    before = core.totals()
    for st in (core, ref):
        st.to_host([0])
    after = core.totals()
    assert all(after.stats[k] >= before.stats[k] for k in ("rounds", "commits", "verified_rounds", "staged_rows"))
    np.testing.assert_array_equal(core.accepted(0), ref.accepted(0))


def test_metrics_of_a_damaged_state_stay_at_the_last_whole_one():
    st = Stager(_cfg(rows="external"))
    st.process(0, np.arange(6))
    st.to_device([0])
    for a in (0, 1, 1):
        st.step_many([0], [a])
    read = st.totals()
    st.step_state[:, 0] = -7  # a copy back gone wrong
    assert st.totals() == read  # neither garbage nor back to the hand-over's
    st.end(0)
    assert st.totals().stats["rounds"] == read.stats["rounds"]


def _families(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    return {f.name: f for f in text_string_to_metric_families(text)}


def test_prometheus_text_parses_and_equals_the_totals():
    """The Prometheus project's parser reads the exposition; every value is the totals'."""
    rng = np.random.default_rng(5)
    st = Stager(_cfg("q8_0"))
    drv = _Driver([st], rng)
    _run(drv, 200, lambda lo, hi: int(rng.integers(lo, hi + 1)))
    t = st.totals()
    text = prometheus_text(st, labels={"model": 'llama "3"\\8b\n'})
    assert CONTENT_TYPE.startswith("text/plain; version=0.0.4")
    fams = _families(text)
    model = 'llama "3"\\8b\n'
    for k in COUNTERS:
        if k in ("skips", "verified_rounds", "accepted_tokens") or k.startswith("skips_"):
            continue
        fam = fams[f"dspark_{k}"]  # the parser names a counter family without _total
        assert fam.type == "counter" and fam.documentation == METRIC_HELP[k]
        assert [(s.name, s.labels, s.value) for s in fam.samples] == [(f"dspark_{k}_total", {"model": model}, t.stats[k])]
    skips = {s.labels["reason"]: s.value for s in fams["dspark_skips"].samples}
    assert skips == {r: t.stats["skips_" + r] for r in SKIP_REASONS}
    assert sum(skips.values()) == t.stats["skips"]
    hist = fams["dspark_accepted_drafts"]
    assert hist.type == "histogram"
    buckets = [(s.labels["le"], s.value) for s in hist.samples if s.name.endswith("_bucket")]
    cumulative = np.cumsum(t.accepted).tolist()
    assert buckets == [(str(k), c) for k, c in enumerate(cumulative)] + [("+Inf", t.accepted.sum())]
    assert t.accepted.sum() > 0
    by_name = {s.name: s.value for s in hist.samples if not s.name.endswith("_bucket")}
    assert by_name == {"dspark_accepted_drafts_sum": t.stats["accepted_tokens"],
                       "dspark_accepted_drafts_count": t.stats["verified_rounds"]}
    for k in GAUGES + PEAKS:
        assert fams[f"dspark_{k}"].type == "gauge"
        assert fams[f"dspark_{k}"].samples[0].value == t.stats[k]
    assert fams["dspark_sequences_started"].samples[0].value == t.started
    # Every family once, its samples together (the parser merges nothing: names are unique).
    names = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(names) == len(set(names))


def test_prometheus_per_sequence_series_and_the_twin_render_alike():
    rng = np.random.default_rng(11)
    core, ref = Stager(_cfg(rows="external")), ReferenceStager(_cfg(rows="external"))
    drv = _Driver([core, ref], rng)
    _run(drv, 80, lambda lo, hi: int(rng.integers(lo, hi + 1)))
    for st in (core, ref):
        st.enable_many([0, 1, 2])
        st.end(2)
    text = prometheus_text(core, namespace="spec", per_sequence=True)
    # The same text but the byte gauges, which the twin does not keep (and are 0 here: external rows).
    byte_families = ("spec_bytes", "spec_peak_bytes", "spec_reserved_bytes")
    kept = [line for line in text.splitlines(keepends=True)
            if not any(line.split(" ")[2 if line.startswith("#") else 0].split("{")[0] == f for f in byte_families)]
    assert len(kept) == len(text.splitlines()) - 9
    assert "".join(kept) == prometheus_text(ref, namespace="spec", per_sequence=True)
    fams = _families(text)
    seqs = {s.labels["seq"] for s in fams["spec_sequence_rounds"].samples}
    assert seqs == {"0", "1"}  # sequence 2 holds no rows
    for q in (0, 1):
        acc = core.accepted(q)
        count = [s.value for s in fams["spec_sequence_accepted_drafts"].samples
                 if s.labels["seq"] == str(q) and s.name.endswith("_count")]
        assert count == [acc.sum()]
    # A handed-over sequence is written live (its step state's counters); a sequence named
    # twice appears once.
    core.to_device([1])
    text = prometheus_text(core, per_sequence=True, seqs=[0, 1, 0, 2])
    fams = _families(text)
    assert [s.labels["seq"] for s in fams["dspark_sequence_rounds"].samples] == ["0", "1"]
    assert text.count('dspark_sequence_rounds_total{seq="0"}') == 1


@pytest.mark.parametrize("kwargs,match", [
    ({"namespace": "9bad"}, "namespace"),
    ({"namespace": ""}, "namespace"),
    ({"labels": {"__x": "1"}}, "label name"),
    ({"labels": {"a-b": "1"}}, "label name"),
    ({"labels": {"le": "1"}}, "exporter's own"),
    ({"labels": {"seq": "1"}}, "exporter's own"),
])
def test_prometheus_text_refuses_bad_names(kwargs, match):
    with pytest.raises(ValueError, match=match):
        prometheus_text(Stager(_cfg()), **kwargs)


def test_totals_is_a_value():
    """A frozen snapshot: later calls do not change it; equal by its contents."""
    st = Stager(_cfg())
    t = st.totals()
    assert isinstance(t, StagerTotals)
    assert t.accepted.dtype == np.int64 and t.accepted.shape == (B + 1,)
    st.process(0, np.arange(5), np.clip(massive_rows(np.random.default_rng(0), 5, D, peak=3e4), -6e4, 6e4))
    assert t.started == 0 and t.stats["rows"] == 0 and st.totals().started == 1
    same = StagerTotals(dict(t.stats), t.accepted.copy(), t.started)
    assert same == t
    assert StagerTotals(dict(t.stats), t.accepted + 1, t.started) != t
    with pytest.raises(TypeError):
        hash(t)
    with pytest.raises(AttributeError):
        t.started = 3  # type: ignore[misc]


def test_per_request_series_carry_the_servers_request_id_and_handed_over_ones_are_live():
    st = Stager(_cfg(rows="external"))
    for q in (0, 1):
        st.process(q, np.arange(6))
    st.to_device([1])
    for a in (0, 1):
        st.step_many([1], [a])
    fams = _families(prometheus_text(st, per_sequence=True, request_ids={0: "req-a", 1: "req-b"}))
    rounds = {(s.labels["seq"], s.labels["request"]): s.value
              for s in fams["dspark_sequence_rounds"].samples}
    assert rounds == {("0", "req-a"): 0, ("1", "req-b"): st.stats(1)["rounds"]}
    assert st.stats(1)["rounds"] == 2  # live from the step state, not frozen at the hand-over
    st.end(1)  # the slot's next request: new series, not a reset of the old ones
    st.process(1, np.arange(3))
    fams = _families(prometheus_text(st, per_sequence=True, request_ids={1: "req-c"}))
    assert {s.labels["request"] for s in fams["dspark_sequence_rounds"].samples} == {"req-c"}
    with pytest.raises(TypeError, match="request_ids must be a mapping"):
        prometheus_text(st, per_sequence=True, request_ids=[("0", "x")])
    with pytest.raises(TypeError):
        prometheus_text(st, per_sequence=True, request_ids={1.5: "x"})
    with pytest.raises(ValueError, match="exporter's own"):
        prometheus_text(st, labels={"request": "x"})
