"""Drafting per request (``disable`` / ``enable``): the core against its twin.

While drafting is off every draft skips with ``"drafting_off"`` (its own skip
code, in ``draft_many`` too) and the rows keep flowing: the ring stays bounded
and the sequence's end moves on. ``enable`` drafts at once with a full context
(a rebase onto the newest rows when they outgrew the window). The switch is the
request's: begin / end / a prefix start clear it, fork copies it, snapshots
carry it, a cancelled reservation does not undo it, and a sequence handed over to
the device step takes it there (its steps skip). Batched
forms check every id first and change nothing on an error.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import massive_rows

from dspark_core import PrefixStore, Stager, StagerConfig
from dspark_core.reference import ReferencePrefixStore, ReferenceStager
from dspark_core.stager import snapshot_format
from dspark_core.stager.core_tables import SKIP_REASONS, TRIM_CHUNK

B, W, D = 4, 16, 64
KINDS = [(Stager, "core"), (ReferenceStager, "reference")]


def make(kind, rows: str = "held", storage: str = "q8_0", seqs: int = 3):
    return kind(StagerConfig(feature_dim=D, block_size=B, window=W, max_seqs=seqs, storage=storage, rows=rows))


def feed(st, seq: int, start: int, n: int, seed: int = 0) -> None:
    pos = np.arange(start, start + n)
    if st.config.rows == "external":
        st.process(seq, pos)
    else:
        st.process(seq, pos, massive_rows(np.random.default_rng(seed + start), n, D))


def test_drafting_off_is_its_own_skip_reason():
    assert SKIP_REASONS[-1] == "drafting_off"
    from dspark_core.reference import arguments

    assert arguments.SKIP_REASONS == SKIP_REASONS


@pytest.mark.parametrize("storage", ["f32", "q8_0", "q4_0"])
def test_a_paused_request_keeps_its_rows_flowing_and_drafts_at_once_when_enabled(storage):
    runs = []
    for kind, _ in KINDS:
        st = make(kind, storage=storage)
        feed(st, 0, 0, 12)
        p = st.draft(0, 12)
        st.commit(0)
        st.disable(0)
        trace = [st.state(0)]
        for k in range(40):  # decode steps with drafting off: one row each, as a server without drafts
            end = st.state(0)["end"]
            p = st.draft(0, end)
            assert p.skip == "drafting_off" and p.n_rows == 0
            feed(st, 0, end, 1, seed=k)
            trace.append(st.state(0))
        assert st.state(0)["end"] == 52
        assert st.stats(0)["peak_rows"] <= W + TRIM_CHUNK + B + 1
        st.enable(0)
        p = st.draft(0, 52)
        assert p.skip is None and p.rebase and p.clear_cache
        assert p.n_rows == st.config.w_keep and p.start == 52
        rows = p.rows.tobytes()
        st.commit(0)
        runs.append((trace, st.stats(0), rows, st.snapshot(0)))
    assert runs[0][0] == runs[1][0]
    assert {k: runs[0][1][k] for k in SEMANTIC} == {k: runs[1][1][k] for k in SEMANTIC}
    assert runs[0][2] == runs[1][2] and runs[0][3] == runs[1][3]


SEMANTIC = ("rounds", "commits", "failures", "rebases", "staged_rows", "restaged_rows", "skips", "rows", "live_rows")


@pytest.mark.parametrize("kind", [k for k, _ in KINDS], ids=[n for _, n in KINDS])
def test_the_switch_belongs_to_the_request(kind):
    st = make(kind)
    feed(st, 0, 0, 10)
    st.disable(0)
    st.disable(0)  # idempotent
    snap = st.snapshot(0)
    assert snapshot_format.unpack(snap, st.config.snapshot_fingerprint()).drafting_off
    st.restore(1, snap)  # snapshots carry it
    assert st.state(1)["drafting_off"]
    st.fork(0, 2)  # fork copies it
    assert st.state(2)["drafting_off"]
    st.begin(1)  # begin clears it
    assert not st.state(1)["drafting_off"]
    st.end(2)  # end too
    assert not st.state(2)["drafting_off"]
    st.enable(0)
    assert not st.state(0)["drafting_off"]
    st.disable(0)
    bp = st.draft_many([0, 1], [10, 0])
    assert bp.skip_code.tolist() == [1 + SKIP_REASONS.index("drafting_off"), 1 + SKIP_REASONS.index("empty")]
    # a fresh sequence with the switch on: its snapshot restores as such
    st.disable(1)
    st.restore(2, st.snapshot(1))
    assert st.state(2)["drafting_off"] and not st.state(2)["started"]


@pytest.mark.parametrize("kind", [k for k, _ in KINDS], ids=[n for _, n in KINDS])
def test_batches_check_every_id_first(kind):
    st = make(kind)
    feed(st, 0, 0, 10)
    before = [(st.state(q), st.stats(q), st.snapshot(q)) for q in range(3)]
    with pytest.raises(ValueError, match=r"disable_many: seqs\[1\] \(sequence 7\)"):
        st.disable_many([0, 7])  # sequence 0, valid, comes first: nothing of it changes either
    assert [(st.state(q), st.stats(q), st.snapshot(q)) for q in range(3)] == before
    st.disable_many([0, 1, 0])  # a repeated id: the same switch twice
    assert st.state(0)["drafting_off"] and st.state(1)["drafting_off"] and not st.state(2)["drafting_off"]
    st.enable_many([1])
    assert st.state(0)["drafting_off"] and not st.state(1)["drafting_off"]
    with pytest.raises(ValueError):
        st.enable(-1)


def test_the_cores_errors_are_the_twins():
    outs = []
    for kind, _ in KINDS:
        st = make(kind)
        got = []
        for name, arg in (("disable_many", [0, 9]), ("enable", 3), ("disable", "x"), ("enable_many", [[0]])):
            try:
                getattr(st, name)(arg)
                got.append(None)
            except Exception as exc:  # noqa: BLE001 - compared word for word
                got.append((type(exc).__name__, str(exc)))
        outs.append(got)
    assert outs[0] == outs[1]


@pytest.mark.parametrize("kind", [k for k, _ in KINDS], ids=[n for _, n in KINDS])
def test_a_cancelled_reservation_keeps_the_switch(kind):
    st = make(kind, rows="external", storage="f32")
    feed(st, 0, 0, 6)
    st.reserve(0, [6, 7])
    st.disable(0)
    st.cancel(0)
    assert st.state(0)["drafting_off"]
    assert st.draft(0, 6).skip == "drafting_off"


def _step(st, seqs, counts):
    """One device step of ``seqs``: the answers a server reads (status, skip, rows, verify rows)."""
    out = st.step_many(seqs, counts)
    st.check_step(seqs, out.status)
    return [(int(out.skip[k]), int(out.n_rows[k]), int((out.verify_slots[k] >= 0).sum()), int(out.start[k]))
            for k in range(len(seqs))]


def test_the_switch_reaches_a_handed_over_sequence_as_on_the_host():
    """disable / enable of a handed-over sequence: its steps skip with SKIP_DRAFTING_OFF (one
    verify row each, the rows flowing), enable drafts at once (a rebase after the rows
    outgrew the window), to_host brings the switch back; core and twin step alike and equal
    a host-path Stager driven by per-sequence calls."""
    from dspark_core.stager.device_step import SKIP_DRAFTING_OFF, SKIP_NONE

    runs = []
    for kind, _ in KINDS:
        st = make(kind, rows="external", storage="f32")
        for q in (0, 1):
            feed(st, q, 0, 6)
        st.disable(1)  # handed over with drafting off: accepted
        st.to_device([0, 1])
        trace = [_step(st, [0, 1], [0, 0])]
        st.disable_many([0])
        for _ in range(2 * W):  # both paused: one verify row per step, past the window
            trace.append(_step(st, [0, 1], [0, 0]))
        st.enable(1)
        trace.append(_step(st, [0, 1], [0, 0]))
        st.to_host([0, 1])
        runs.append((trace, st.state(0), st.state(1), st.stats(0), st.stats(1)))
    runs[0] = (*runs[0][:3], *({k: s[k] for k in t} for s, t in zip(runs[0][3:], runs[1][3:])))
    assert runs[0] == runs[1]
    trace, s0, s1, st0, st1 = runs[0]
    assert [k[0] for k in trace[0]] == [SKIP_NONE, SKIP_DRAFTING_OFF]
    assert all(e[0] == SKIP_DRAFTING_OFF and e[1] == 0 and e[2] == 1 for step in trace[1:-1] for e in step)
    assert trace[1][0][3] < trace[-2][0][3]  # the paused sequence's end moved on, a row a step
    assert trace[-1][0][0] == SKIP_DRAFTING_OFF and trace[-1][1][0] == SKIP_NONE and trace[-1][1][1] > 0
    assert s0["drafting_off"] and not s1["drafting_off"]
    assert st0["skips_drafting_off"] == 2 * W + 1 and st1["skips_drafting_off"] == 2 * W + 1
    assert st1["rebases"] >= 1
    # The host path: the same calls per sequence make the same states.
    host = make(Stager, rows="external", storage="f32")
    for q in (0, 1):
        feed(host, q, 0, 6)
    host.disable(1)
    for k in range(2 * W + 2):
        if k == 1:
            host.disable(0)
        if k == 2 * W + 1:
            host.enable(1)
        for q in (0, 1):
            if host.state(q)["reservation_open"]:
                host.confirm(q)
            host.accept(q, 0)
            end = host.state(q)["end"]
            p = host.draft(q, end)
            if p.skip is None:
                host.commit(q)
            host.reserve(q, np.arange(end, end + (B + 1 if p.skip is None else 1)))
    for q, s in ((0, s0), (1, s1)):
        assert host.state(q) == s


def test_a_disabled_sequence_steps_on_the_device_until_begin():
    """max_failures drafter failures reported at hand-back disable the sequence; handed over
    again it steps with SKIP_DISABLED (one verify row each) on core and twin alike, and only
    begin re-enables it."""
    from dspark_core.stager.device_step import SKIP_DISABLED

    runs = []
    for kind, _ in KINDS:
        st = make(kind, rows="external", storage="f32")
        feed(st, 0, 0, 6)
        answers = []
        for _ in range(st.config.max_failures):
            st.to_device([0])
            _step(st, [0], [0])
            answers.append(int(st.to_host([0], ["decode"])[0]))
            st.confirm(0)
        st.to_device([0])
        steps = [_step(st, [0], [0])[0] for _ in range(5)]
        st.to_host([0])
        runs.append((answers, steps, st.state(0), st.stats(0)))
    runs[0] = (*runs[0][:3], {k: runs[0][3][k] for k in runs[1][3]})
    assert runs[0] == runs[1]
    answers, steps, state, stats = runs[0]
    assert answers[-1] == runs[0][3]["failures"] and not any(answers[:-1])
    assert all(s[0] == SKIP_DISABLED and s[1] == 0 and s[2] == 1 for s in steps)
    assert state["disabled"] and stats["skips_disabled"] == 5


@pytest.mark.parametrize("kinds", [(Stager, PrefixStore), (ReferenceStager, ReferencePrefixStore)],
                         ids=["core", "reference"])
def test_a_prefix_start_clears_it(kinds):
    kind, store_kind = kinds
    st = make(kind)
    store = store_kind(st.config, 4, 1 << 20)
    feed(st, 0, 0, 12)
    store.publish(st, 0, [11, 12, 13], 0, 12)
    st.disable(1)
    hit = store.hit(st, 1, [11, 12, 13], 12)
    assert hit.rows > 0
    assert not st.state(1)["drafting_off"]
