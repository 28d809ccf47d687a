"""Protocol invariants: one-shot checks and a checking proxy for any Stager-like object."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable, NoReturn, Sequence

import numpy as np

from ..stager import snapshot_format
from ..stager._args import as_encoded, as_positions, as_rows
from ..stager.config import NONFINITE_POLICIES, STORAGES, StagerConfig
from ..reference import formats as rf
from ..stager.stage_plan import SKIP_REASONS


class InvariantViolation(AssertionError):
    """A Stager (or a server loop around it) broke one of the protocol's guarantees."""



# ---------------------------------------------------------------------------
# Invariants
# ---------------------------------------------------------------------------


def _violation(msg: str) -> NoReturn:
    raise InvariantViolation(msg)


def check_slots(slots: Any, seq: int, n: int, config: StagerConfig, what: str) -> None:
    """Check ring slots handed out for ``seq`` (a plan's, ``process``'s, ``restore``'s).

    int64 ``(n,)``; each ``-1`` (``process``: below the horizon) or inside the
    sequence's slots ``[seq * ring_rows, (seq + 1) * ring_rows)``; the valid ones
    distinct and at most two runs of consecutive slots, the second starting at
    the sequence's first slot (the ring wraps at most once).

    Raises:
        InvariantViolation: naming ``what`` and the broken rule.
    """
    sl = np.asarray(slots)
    if sl.dtype != np.int64 or sl.shape != (n,):
        _violation(f"{what}: slots are {sl.dtype}{sl.shape}, expected int64({n},)")
    R = config.ring_rows
    lo = seq * R
    valid = sl[sl >= 0]
    if np.any(sl < -1) or np.any((valid < lo) | (valid >= lo + R)):
        _violation(f"{what}: slots {sl.tolist()[:8]} leave sequence {seq}'s slots [{lo}, {lo + R})")
    breaks = np.flatnonzero(np.diff(valid) != 1)
    if len(breaks) > 1 or (len(breaks) == 1 and valid[breaks[0] + 1] != lo):
        _violation(f"{what}: slots {valid.tolist()[:8]}... are not at most two runs, the second from slot {lo}")


def check_plan(plan: Any, config: StagerConfig, *, verify_rows: bool = True) -> None:
    """Check one :class:`StagePlan` against the protocol's static guarantees.

    Drafter positions inside ``[0, W)`` and contiguous (context rows then the
    block, no gap), ``crop_from`` at the block, ``clear_cache`` plans start at
    drafter position 0, a rebase keeps at most ``w_keep`` rows, array shapes
    and dtypes, ``slots`` (:func:`check_slots`), and, in held mode, (``verify_rows``)
    ``rows`` equal ``encoded_rows`` decoded. An external-row plan carries no rows.

    Raises:
        InvariantViolation: naming the broken rule.
    """
    c = config
    tag = f"seq {plan.seq} plan at {plan.start}"
    external = bool(getattr(plan, "external", False))
    if external != c.external_rows:
        _violation(f"{tag}: an {'external' if external else 'held'}-row plan from a Stager configured rows={c.rows!r}")
    if plan.skip is not None:
        if plan.skip not in SKIP_REASONS:
            _violation(f"{tag}: unknown skip reason {plan.skip!r}")
        if len(plan.positions) or len(plan.block_positions) or len(plan.slots) or (
                not external and len(plan.encoded_rows)):
            _violation(f"{tag}: a skipped plan stages something")
        return
    pos = np.asarray(plan.positions)
    blk = np.asarray(plan.block_positions)
    n = len(pos)
    if pos.dtype != np.int32 or blk.dtype != np.int32:
        _violation(f"{tag}: positions must be int32, got {pos.dtype} / {blk.dtype}")
    if n and not np.array_equal(pos, np.arange(pos[0], pos[0] + n)):
        _violation(f"{tag}: context positions are not contiguous: {pos.tolist()}")
    if len(blk) != c.block_size or not np.array_equal(blk, np.arange(plan.crop_from, plan.crop_from + c.block_size)):
        _violation(f"{tag}: block positions {blk.tolist()} are not [crop_from, crop_from + B) = "
                   f"[{plan.crop_from}, {plan.crop_from + c.block_size})")
    if n and pos[-1] + 1 != plan.crop_from:
        _violation(f"{tag}: context rows end at {pos[-1] + 1}, but the block starts at {plan.crop_from}")
    if (n and pos[0] < 0) or plan.crop_from < 0:
        _violation(f"{tag}: negative drafter position (positions from {pos[0] if n else None}, crop_from {plan.crop_from})")
    if plan.crop_from + c.block_size > c.window:
        _violation(f"{tag}: block [{plan.crop_from}, {plan.crop_from + c.block_size}) does not fit the window {c.window}")
    if plan.crop_from != plan.start - plan.pos_base or plan.pos_base < 0:
        _violation(f"{tag}: crop_from {plan.crop_from} != start {plan.start} - pos_base {plan.pos_base}")
    if plan.rebase and not plan.clear_cache:
        _violation(f"{tag}: a rebase must clear the drafter cache")
    if plan.clear_cache and plan.crop_from != n:
        _violation(f"{tag}: clear_cache, but the {n} context rows do not start at drafter position 0 "
                   f"(block at {plan.crop_from})")
    if plan.rebase and n > c.w_keep:
        _violation(f"{tag}: a rebase restaged {n} rows, more than w_keep = {c.w_keep}")
    check_slots(plan.slots, int(plan.seq), n, c, tag)
    if n and np.any(np.asarray(plan.slots) < 0):
        _violation(f"{tag}: a staged row has no slot")
    if external:
        return
    enc = np.asarray(plan.encoded_rows)
    if enc.dtype != np.uint8 or enc.shape != (n, c.row_bytes):
        _violation(f"{tag}: encoded_rows is {enc.dtype}{enc.shape}, expected uint8({n}, {c.row_bytes})")
    rows = plan.rows
    if rows.dtype != c.numpy_stage_dtype or rows.shape != (n, c.feature_dim):
        _violation(f"{tag}: rows is {rows.dtype}{rows.shape}, expected {c.numpy_stage_dtype}({n}, {c.feature_dim})")
    if verify_rows and n:
        expect = rf.decode(enc, c.storage, c.feature_dim, c.numpy_stage_dtype)
        if expect.tobytes() != np.ascontiguousarray(rows).tobytes():
            _violation(f"{tag}: rows are not encoded_rows decoded to {c.stage_dtype}")
    _check_runs(plan, enc, rows, tag)


def _check_runs(plan: Any, enc: np.ndarray, rows: np.ndarray, tag: str) -> None:
    """A held plan's runs (views of the ring for ``draft(copy=False)``) are its rows
    cut where its slots stop being consecutive, and read-only when they are views."""
    slots = np.asarray(plan.slots)
    want = [len(r) for r in np.split(slots, np.flatnonzero(np.diff(slots) != 1) + 1)] if len(slots) else []
    for name, runs, whole, whole_name in (("encoded_runs", plan.encoded_runs, enc, "encoded_rows"),
                                          ("row_runs", plan.row_runs, rows, "rows")):
        if [len(r) for r in runs] != want:
            _violation(f"{tag}: {name} hold {[len(r) for r in runs]} rows, the slot runs {want}")
        joined = np.concatenate(runs) if runs else whole[:0]
        if joined.dtype != whole.dtype or joined.tobytes() != np.ascontiguousarray(whole).tobytes():
            _violation(f"{tag}: {name} joined are not the plan's {whole_name}")
        if plan.zero_copy and any(r.flags.writeable for r in runs):
            _violation(f"{tag}: a zero-copy plan's {name} are writable views of the ring")


def check_invariants(
    stager: Any, config: StagerConfig, plan: Any = None, *, closed: Iterable[int] = ()
) -> None:
    """Check every sequence's state of ``stager`` (and ``plan``, if given).

    Per started sequence: ``horizon <= end`` and ``pos_base <= n_cache <= end``
    (positions contiguous: ``n_retained + n_pending == end - horizon``), the
    drafter cache inside the window (``n_cache - pos_base <= W - B`` unless a
    clean restage is owed), at most ``B + 1`` tentative rows, the buffer bound
    (``peak_rows <= W + TRIM_CHUNK + B + 1``, rows held >= ``end - horizon``),
    no open round on the sequences in ``closed`` (those just committed or
    failed), the skips per reason summing to ``skips``, and every verified
    round a committed one (``verified_rounds <= commits``, at most ``B``
    accepted drafts each). ``plan`` (a StagePlan or BatchPlan) is checked with :func:`check_plan`.

    Raises:
        InvariantViolation: naming the sequence and the broken rule.
    """
    c = config
    closed = {int(s) for s in closed}
    for s in range(c.max_seqs):
        st = stager.state(s)
        stats = stager.stats(s)
        tag = f"seq {s}"
        if s in closed and st["open_round"]:
            _violation(f"{tag}: a round is still open after commit/fail")
        if st["tentative_rows"] < 0 or st["tentative_rows"] > c.block_size + 1:
            _violation(f"{tag}: {st['tentative_rows']} tentative rows (at most B + 1 = {c.block_size + 1})")
        reasons = [k for k in stats if k.startswith("skips_")]
        if reasons and sum(stats[k] for k in reasons) != stats["skips"]:
            _violation(f"{tag}: the skips per reason sum to {sum(stats[k] for k in reasons)}, not skips "
                       f"= {stats['skips']}")
        if "verified_rounds" in stats and not (
                0 <= stats["verified_rounds"] <= stats["commits"]
                and 0 <= stats["accepted_tokens"] <= c.block_size * stats["verified_rounds"]):
            _violation(f"{tag}: {stats['verified_rounds']} verified rounds with {stats['accepted_tokens']} accepted "
                       f"drafts for {stats['commits']} commits (each verified round was committed, B = {c.block_size})")
        peak = stats.get("peak_rows", stats.get("rows", 0))
        if peak > c.ring_rows or stats.get("rows", 0) > c.ring_rows:
            _violation(f"{tag}: {peak} rows buffered, over the bound W + TRIM_CHUNK + B + 1 = {c.ring_rows}")
        if not st["started"]:
            if st["open_round"] or st["n_retained"] or st["n_pending"]:
                _violation(f"{tag}: a sequence that never received rows has state {st}")
            continue
        end, h, nc, pb = st["end"], st["horizon"], st["n_cache"], st["pos_base"]
        if not 0 <= h <= end:
            _violation(f"{tag}: horizon {h} is not inside [0, end = {end}]")
        if not 0 <= pb <= nc <= end:
            _violation(f"{tag}: expected 0 <= pos_base {pb} <= n_cache {nc} <= end {end}")
        if st["n_retained"] + st["n_pending"] != end - h or st["n_retained"] < 0 or st["n_pending"] < 0:
            _violation(f"{tag}: retained {st['n_retained']} + pending {st['n_pending']} != end - horizon = {end - h}")
        if not st["restage_owed"] and nc - pb > c.window - c.block_size:
            _violation(f"{tag}: drafter cache [0, {nc - pb}) leaves no room for a block in the window {c.window}")
        if st["tentative_rows"] > end - nc:
            _violation(f"{tag}: {st['tentative_rows']} tentative rows but only {end - nc} rows after the cache end")
        if "rows" in stats and stats["rows"] < end - h:
            _violation(f"{tag}: holds {stats['rows']} rows, fewer than the {end - h} stageable ones")
        if st.get("tree_nodes", 0) and st["tree_nodes"] != st["tentative_rows"]:
            _violation(f"{tag}: a tree of {st['tree_nodes']} nodes but {st['tentative_rows']} tentative rows")
        if not st["open_round"] and not st.get("tree_nodes", 0) and hasattr(stager, "snapshot"):
            # The sequence's own snapshot must be restorable (and describe this state; a tree
            # verify batch in flight has none: accept_path comes first).
            try:
                snap = snapshot_format.unpack(bytes(stager.snapshot(s)), c.snapshot_fingerprint(), STORAGES,
                                              external=c.external_rows, tokens=_chain(c))
            except ValueError as exc:
                _violation(f"{tag}: its own snapshot would not restore: {exc}")
            if (snap.end, snap.horizon, snap.n_cache, snap.pos_base) != (end, h, nc, pb):
                _violation(f"{tag}: snapshot fields differ from state()")
    if plan is not None:
        plans = getattr(plan, "plans", None)
        for p in plans if plans is not None else [plan]:
            check_plan(p, config)


# ---------------------------------------------------------------------------
# A checking proxy for server loops
# ---------------------------------------------------------------------------


_POLICY_FOR_TRUTH = {name: "keep" if name == "error" else name for name in NONFINITE_POLICIES}


@dataclass
class _Model:
    """What the server's drafter holds for one sequence, and the target's rows."""

    truth: dict[int, bytes] = field(default_factory=dict)  # abs position -> encoded row the server gave
    cache: dict[int, tuple[int, bytes]] | None = None  # drafter pos -> (abs pos, row); None: unknown
    open_plan: Any = None
    open_rows: np.ndarray | None = None  # the open plan's rows (uint8), read while its round was open


#: Filler of the external-row mirror's unwritten slots: staging one shows up as a wrong row.
UNWRITTEN = 0xA5
#: Snapshots whose rows an external-row checker remembers for ``restore`` without ``rows``.
SAVED_SNAPSHOTS = 64


def _chain(config: Any) -> bool:
    """A chain drafter's configuration: its snapshots carry token ids."""
    return getattr(config, "kind", "block") == "chain"


def _ids(tokens: Any) -> dict[str, Any]:
    """A chain drafter's token ids as the Stager's keyword (none: a block drafter's call, unchanged)."""
    return {} if tokens is None else {"tokens": tokens}


class InvariantChecker:
    """Wrap any Stager-like object and check every call and plan.

    Use it in place of the stager inside your server loop (or a test of it)::

        st = InvariantChecker(Stager(config))        # or ReferenceStager, or your own
        st.begin(0); st.process(0, pos, rows); plan = st.draft(0, n_past); st.commit(0)

    With an external-row Stager (``rows="external"``) the checker is the owner
    of the rows: it keeps a numpy mirror of the row table (:attr:`mirror`,
    ``max_seqs * ring_rows`` rows of ``row_bytes``), so ``process(seq, pos,
    rows)`` still takes the rows (it encodes them, asks the Stager for slots
    and writes them there, returning the slots), ``process_encoded`` writes
    encoded rows, ``fork`` / ``shift`` apply their moves to the mirror,
    ``snapshot`` keeps the live rows and ``restore`` puts them back at the
    slots it returns. Every plan's rows are read from the mirror at
    ``plan.slots`` (:meth:`plan_rows`) and checked exactly as in held mode, and
    after every call each sequence's live rows (``live_slots``) must be the
    rows the server gave.

    Besides :func:`check_plan` and :func:`check_invariants` after every call,
    it keeps a model of the drafter's KV cache as a server following the
    protocol would (clear on ``clear_cache``, decode the rows and the block,
    crop at ``crop_from``; unknown after ``fail`` / ``rollback`` into it /
    ``shift`` / ``fork`` / ``restore``) and of the rows the target produced,
    and checks that

    * a plan that does not clear the cache continues it exactly: the cache
      holds drafter positions ``[0, first staged position)``, every cached
      row is the current row of ``pos_base + drafter position``;
    * every staged row is byte for byte the row the server gave for that
      absolute position (with ``check_rows``);
    * a rejected call changes no state, and no round stays open after
      ``commit`` / ``fail``.

    Other attributes pass through to the wrapped object. ``calls`` counts the
    checked calls.

    Raises:
        InvariantViolation: on the first broken guarantee.
    """

    def __init__(self, stager: Any, config: StagerConfig | None = None, *, check_rows: bool = True) -> None:
        self._st = stager
        self._cfg = config if config is not None else stager.config
        self._check_rows = check_rows
        self._models = [_Model() for _ in range(self._cfg.max_seqs)]
        self.calls = 0
        self._external = bool(self._cfg.external_rows)
        #: External-row mode: the row table the checker owns (uint8, ``max_seqs * ring_rows`` rows).
        self.mirror: np.ndarray | None = None
        if self._external:
            self.mirror = np.full((self._cfg.max_seqs * self._cfg.ring_rows, self._cfg.row_bytes), UNWRITTEN, np.uint8)
        self._saved: OrderedDict[bytes, np.ndarray | None] = OrderedDict()  # snapshot -> its rows (None: ambiguous)
        self._last_serial = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._st, name)

    def __repr__(self) -> str:
        return f"InvariantChecker({self._st!r})"

    # -- plumbing -------------------------------------------------------------
    def _valid(self, seq: Any) -> int | None:
        try:
            i = int(seq)
        except (TypeError, ValueError):
            return None
        return i if 0 <= i < self._cfg.max_seqs and isinstance(seq, (int, np.integer)) else None

    def _states(self) -> list[dict[str, Any]]:
        return [self._st.state(s) for s in range(self._cfg.max_seqs)]

    def _call(self, name: str, *args: Any, closed: Iterable[int] = (), **kw: Any) -> Any:
        self.calls += 1
        before = self._states()
        try:
            result = getattr(self._st, name)(*args, **kw)
        except Exception:
            if self._states() != before:
                _violation(f"{name}{args!r:.200}: the call was rejected but the state changed")
            raise
        check_invariants(self._st, self._cfg, closed=closed)
        return result

    def _check_live(self) -> None:
        """External rows: every sequence's live rows in the mirror are the rows the server gave."""
        if not self._external or not self._check_rows:
            return
        assert self.mirror is not None
        for s in range(self._cfg.max_seqs):
            st = self._st.state(s)
            if not st["started"]:
                continue
            live = np.asarray(self._st.live_slots(s))
            check_slots(live, s, st["end"] - st["horizon"], self._cfg, f"seq {s} live_slots")
            truth = self._models[s].truth
            for k, slot in enumerate(live.tolist()):
                want = truth.get(st["horizon"] + k)
                if want is not None and self.mirror[slot].tobytes() != want:
                    _violation(f"seq {s}: the row of position {st['horizon'] + k} at slot {slot} is not the row "
                               "the server gave (a slot or a move went wrong)")

    def _apply_moves(self, moves: Any, what: str) -> None:
        """Check ``fork`` / ``shift`` moves against the contract; apply them to the mirror (external rows)."""
        mv = np.asarray(moves)
        if mv.dtype != np.int64 or mv.ndim != 2 or mv.shape[1] != 3:
            _violation(f"{what}: moves are {mv.dtype}{mv.shape}, expected int64 (n, 3)")
        table = self._cfg.max_seqs * self._cfg.ring_rows
        for src, dst, n in mv.tolist():
            if n <= 0 or src < 0 or dst < 0 or src + n > table or dst + n > table:
                _violation(f"{what}: move [{src}, {dst}, {n}] leaves the table of {table} rows")
            if not (src + n <= dst or dst + n <= src):
                _violation(f"{what}: move [{src}, {dst}, {n}] overlaps itself")
        serial = getattr(moves, "serial", None)
        if len(mv) and isinstance(serial, (int, np.integer)):
            if serial <= self._last_serial:
                _violation(f"{what}: moves serial {serial} does not follow the last one applied ({self._last_serial})")
            self._last_serial = int(serial)
        if self._external:
            assert self.mirror is not None
            for src, dst, n in mv.tolist():  # in order: a later move may read what an earlier one wrote
                self.mirror[dst:dst + n] = self.mirror[src:src + n].copy()

    def plan_rows(self, plan: Any) -> np.ndarray:
        """The plan's staged rows in storage format, uint8 ``(n, row_bytes)``: ``plan.encoded_rows``,
        or (external rows) the mirror's rows at ``plan.slots``. Read them while the round is open."""
        if not self._external:
            return np.asarray(plan.encoded_rows)
        assert self.mirror is not None
        return self.mirror[np.asarray(plan.slots, dtype=np.int64)]

    def _enc(self, rows: Any) -> np.ndarray:
        x = np.ascontiguousarray(rows)
        # The reference's encoding: policies act within the bounds of the
        # storage *and* the stage dtype, as the Stager's do.
        enc = rf.encode(x, self._cfg.storage, _POLICY_FOR_TRUTH[self._cfg.nonfinite], self._cfg.stage_dtype)
        return np.ascontiguousarray(enc).view(np.uint8).reshape(len(x), self._cfg.row_bytes)

    def _sync_truth(self, s: int) -> None:
        """Forget target rows the stager no longer has and no cached row refers to."""
        m = self._models[s]
        st = self._st.state(s)
        if not st["started"]:
            m.truth.clear()
            return
        lo = st["horizon"]
        if m.cache:
            lo = min(lo, min(a for a, _ in m.cache.values()))
        for p in [p for p in m.truth if p < lo or p >= st["end"]]:
            del m.truth[p]

    def _check_against_model(self, s: int, plan: Any) -> None:
        if plan.skip is not None:
            return
        m = self._models[s]
        tag = f"seq {s} plan at {plan.start}"
        n = plan.n_rows
        first = int(plan.crop_from) - n
        if not plan.clear_cache:
            if m.cache is None:
                _violation(f"{tag}: the drafter cache cannot be trusted (after fail / rollback / shift / fork / "
                           "restore / begin), but the plan does not clear it")
            if sorted(m.cache) != list(range(len(m.cache))) or len(m.cache) != first:
                _violation(f"{tag}: the drafter cache holds positions [0, {len(m.cache)}), "
                           f"but the plan stages from {first}")
            for dpos, (abs_pos, row) in m.cache.items():
                if abs_pos != dpos + plan.pos_base:
                    _violation(f"{tag}: drafter position {dpos} holds target row {abs_pos}, "
                               f"but pos_base {plan.pos_base} maps it to {dpos + plan.pos_base}")
                if self._check_rows and m.truth.get(abs_pos, row) != row:
                    _violation(f"{tag}: drafter position {dpos} holds a stale row for target position {abs_pos}")
        if self._check_rows:
            enc = self.plan_rows(plan)
            for k in range(n):
                abs_pos = plan.pos_base + first + k
                want = m.truth.get(abs_pos)
                if want is None:
                    _violation(f"{tag}: staged target position {abs_pos}, which the server never gave "
                               "(or which was dropped)")
                if enc[k].tobytes() != want:
                    _violation(f"{tag}: staged row for target position {abs_pos} differs from the row the server gave")
        if plan.start != max(m.truth, default=plan.start - 1) + 1 and self._check_rows:
            _violation(f"{tag}: planned at {plan.start}, but the target's rows end at {max(m.truth, default=-1) + 1}")

    # -- the protocol ---------------------------------------------------------
    def begin(self, seq: int) -> None:
        self._call("begin", seq)
        s = self._valid(seq)
        if s is not None:
            self._models[s] = _Model()

    def process(self, seq: int, positions: Any, rows: Any = None, tokens: Any = None) -> np.ndarray | None:
        """``process``; with external rows the checker keeps ``rows`` (it encodes them, asks the
        Stager for slots, writes them there) and returns the slots. ``tokens`` (a chain drafter's
        Stager) go to the Stager as they are: the checker models rows, not ids."""
        if self._external:
            return self._process_external(seq, positions, rows, encoded=False, **_ids(tokens))
        self._call("process", seq, positions, rows, **_ids(tokens))
        s = self._valid(seq)
        pos = np.asarray(positions).reshape(-1)
        if s is not None and len(pos):
            enc = self._enc(rows)
            for k, p in enumerate(pos.tolist()):
                self._models[s].truth[int(p)] = enc[k].tobytes()
            self._sync_truth(s)
        return None

    def process_encoded(self, seq: int, positions: Any, data: Any, tokens: Any = None) -> np.ndarray | None:
        """``process_encoded``; with external rows the checker writes ``data`` at the slots
        ``process(seq, positions)`` returns, and returns them (``tokens``: as :meth:`process`'s)."""
        if self._external:
            return self._process_external(seq, positions, data, encoded=True, **_ids(tokens))
        self._call("process_encoded", seq, positions, data, **_ids(tokens))
        s = self._valid(seq)
        pos = np.asarray(positions).reshape(-1)
        if s is not None and len(pos):
            enc = np.ascontiguousarray(data, dtype=np.uint8).reshape(len(pos), self._cfg.row_bytes)
            for k, p in enumerate(pos.tolist()):
                self._models[s].truth[int(p)] = enc[k].tobytes()
            self._sync_truth(s)
        return None

    def _process_external(self, seq: int, positions: Any, rows: Any, *, encoded: bool, **ids: Any) -> np.ndarray:
        c = self._cfg
        if rows is None:
            raise TypeError("InvariantChecker owns the external rows: pass them to process(seq, positions, rows) "
                            "(it calls the Stager's process(seq, positions) and writes them at the slots)")
        # The owner's duty: check the rows before asking for slots (an accepted call is final).
        pos = as_positions(positions)
        if encoded:
            enc = as_encoded(rows, len(pos), c.row_bytes).reshape(len(pos), c.row_bytes)
        else:
            x = as_rows(rows, c.feature_dim)
            if len(x) != len(pos):
                raise ValueError(f"{len(pos)} positions for {len(x)} rows")
            # under nonfinite="error" an unencodable row raises here, before the Stager sees the call
            enc = np.ascontiguousarray(rf.encode(x, c.storage, c.nonfinite, c.stage_dtype)).view(np.uint8)
            enc = enc.reshape(len(pos), c.row_bytes)
        slots = self._call("process", seq, positions, **ids)
        s = int(seq)
        check_slots(slots, s, len(pos), c, f"seq {s} process")
        st = self._st.state(s)
        below = pos < st["horizon"]
        if not np.array_equal(np.asarray(slots) < 0, below):
            _violation(f"seq {s} process: slot -1 must mark exactly the rows below the horizon {st['horizon']}")
        assert self.mirror is not None
        keep = np.asarray(slots) >= 0
        self.mirror[np.asarray(slots)[keep]] = enc[keep]
        m = self._models[s]
        for k, p in enumerate(pos.tolist()):
            m.truth[int(p)] = enc[k].tobytes()
        self._sync_truth(s)
        self._check_live()
        return np.asarray(slots)

    # -- tree verification (docs/design.md 2.11) ---------------------------------
    def process_tree(self, seq: int, n_past: int, parents: Any, rows: Any = None,
                     tokens: Any = None) -> np.ndarray | None:
        """``process_tree``; with external rows the checker keeps ``rows`` (it checks and encodes
        them, asks the Stager for the nodes' slots, writes them there) and returns the slots.
        Node ``i``'s row is modelled at position ``n_past + i`` (its ring slot) until accept_path."""
        c = self._cfg
        if not self._external:
            self._call("process_tree", seq, n_past, parents, rows, **_ids(tokens))
            enc = self._enc(rows)
            slots = None
        else:
            if rows is None:
                raise TypeError("InvariantChecker owns the external rows: pass them to process_tree(seq, n_past, "
                                "parents, rows) (it calls the Stager's process_tree and writes them at the slots)")
            x = as_rows(rows, c.feature_dim)
            # under nonfinite="error" an unencodable row raises here, before the Stager sees the call
            enc = np.ascontiguousarray(rf.encode(x, c.storage, c.nonfinite, c.stage_dtype)).view(np.uint8)
            enc = enc.reshape(len(x), c.row_bytes)
            slots = np.asarray(self._call("process_tree", seq, n_past, parents, **_ids(tokens)))
            check_slots(slots, int(seq), len(enc), c, f"seq {seq} process_tree")
            assert self.mirror is not None
            self.mirror[slots] = enc
        m = self._models[int(seq)]
        for k in range(len(enc)):
            m.truth[int(n_past) + k] = enc[k].tobytes()
        self._sync_truth(int(seq))
        self._check_live()
        return slots

    def accept_path(self, seq: int, nodes: Any) -> Any:
        """``accept_path``: the moves checked and (external rows) applied; the path's rows modelled
        at consecutive positions from the root, as a linear verify of its tokens would leave them."""
        s = self._valid(seq)
        before = self._st.state(s) if s is not None else None
        moves = self._call("accept_path", seq, nodes)
        self._apply_moves(moves, f"accept_path({seq}, ...)")
        if s is not None and before is not None:
            root = before["end"] - before["tree_nodes"]
            m = self._models[s]
            kept = [m.truth.get(root + int(v)) for v in np.asarray(nodes).reshape(-1).tolist()]
            for p in [p for p in m.truth if p >= root]:
                del m.truth[p]
            for k, row in enumerate(kept):
                if row is not None:
                    m.truth[root + k] = row
            self._after_accept(s, before)
        self._check_live()
        return moves

    def _after_plan(self, s: int, plan: Any) -> None:
        check_plan(plan, self._cfg)
        self._check_against_model(s, plan)
        st = self._st.state(s)
        if plan.skip is None:
            if not st["open_round"]:
                _violation(f"seq {s}: draft returned a plan but opened no round")
            self._models[s].open_plan = plan
            self._models[s].open_rows = self.plan_rows(plan).copy()
        elif st["open_round"]:
            _violation(f"seq {s}: a skipped plan ({plan.skip}) left a round open")

    def draft(self, seq: int, n_past: int, copy: bool = True) -> Any:
        # `copy` passed on only when asked for: a checked stager may be a user's own
        # wrapper whose draft takes (seq, n_past) alone.
        plan = self._call("draft", seq, n_past, *(() if copy is True else (copy,)))
        self._after_plan(int(seq), plan)
        return plan

    def draft_many(self, seqs: Sequence[int], n_pasts: Sequence[int], copy: bool = True) -> Any:
        batch = self._call("draft_many", seqs, n_pasts, *(() if copy is True else (copy,)))
        if [p.seq for p in batch.plans] != [int(s) for s in seqs]:
            _violation(f"draft_many: plans for {[p.seq for p in batch.plans]}, asked for {list(seqs)}")
        for p in batch.plans:
            self._after_plan(p.seq, p)
        active = [p for p in batch.plans if p.skip is None]
        want = np.concatenate([p.positions for p in active]) if active else np.zeros(0, np.int32)
        if not np.array_equal(batch.positions, want):
            _violation("draft_many: batch positions are not the plans' positions concatenated")
        want = np.concatenate([p.slots for p in active]) if active else np.zeros(0, np.int64)
        if not np.array_equal(batch.slots, want):
            _violation("draft_many: batch slots are not the plans' slots concatenated")
        return batch

    def commit(self, seq: int) -> None:
        self._call("commit", seq, closed=[int(seq)])
        self._after_commit(int(seq))

    def _after_commit(self, s: int) -> None:
        """The drafter's cache after a committed round: the plan's rows and block, cropped."""
        m = self._models[s]
        plan, m.open_plan = m.open_plan, None
        enc, m.open_rows = m.open_rows, None
        if plan is None or enc is None:
            return  # opened behind the checker's back: nothing to model
        cache = {} if plan.clear_cache or m.cache is None else m.cache
        first = int(plan.crop_from) - plan.n_rows
        for k in range(plan.n_rows):
            cache[first + k] = (plan.pos_base + first + k, enc[k].tobytes())
        m.cache = {d: v for d, v in cache.items() if d < plan.crop_from}  # the crop
        self._sync_truth(s)

    def fail(self, seq: int, stage: str = "decode") -> int:
        disabled_after: int = self._call("fail", seq, stage, closed=[int(seq)])
        self._after_fail(int(seq))
        return disabled_after

    def _after_fail(self, s: int) -> None:
        m = self._models[s]
        m.open_plan = m.open_rows = None
        m.cache = None

    def accept(self, seq: int, n_accepted: int) -> None:
        s = self._valid(seq)
        if s is None:
            self._call("accept", seq, n_accepted)
            return
        before = self._st.state(s)
        self._call("accept", seq, n_accepted)
        self._after_accept(s, before)

    def _after_accept(self, s: int, before: dict[str, Any]) -> None:
        after = self._st.state(s)
        if after["end"] > before["end"] or after["end"] < before["end"] - before["tentative_rows"]:
            _violation(f"seq {s}: accept moved the end from {before['end']} to {after['end']} "
                       f"({before['tentative_rows']} tentative rows)")
        self._sync_truth(s)

    # -- batches (each as its per-sequence calls; a rejected batch changes nothing) --------
    def _batch_ids(self, seqs: Any) -> list[int]:
        """A batch's ids for the model ([] when they are not integers: the Stager rejects those)."""
        arr = np.asarray(seqs).reshape(-1)
        return [int(x) for x in arr.tolist()] if arr.dtype.kind in "iu" else []

    def process_many(self, seqs: Any, cu_seqlens: Any, positions: Any, rows: Any = None,
                     tokens: Any = None) -> np.ndarray | None:
        """``process_many``; with external rows the checker keeps ``rows`` as :meth:`process` does
        (it checks and encodes them, asks the Stager for the slots, writes them there) and
        returns the slots."""
        c = self._cfg
        if self._external:
            if rows is None:
                raise TypeError("InvariantChecker owns the external rows: pass them to process_many(seqs, cu_seqlens, "
                                "positions, rows) (it calls the Stager's process_many without rows and writes them)")
            pos = as_positions(positions)
            x = as_rows(rows, c.feature_dim)
            if len(x) != len(pos):
                raise ValueError(f"process_many: {len(pos)} positions for {len(x)} rows")
            enc = np.ascontiguousarray(rf.encode(x, c.storage, c.nonfinite, c.stage_dtype)).view(np.uint8)
            enc = enc.reshape(len(pos), c.row_bytes)
            slots = np.asarray(self._call("process_many", seqs, cu_seqlens, positions, **_ids(tokens)))
            assert self.mirror is not None
            keep = slots >= 0
            self.mirror[slots[keep]] = enc[keep]
        else:
            self._call("process_many", seqs, cu_seqlens, positions, rows, **_ids(tokens))
            pos = as_positions(positions)
            enc = self._enc(rows) if len(pos) else np.zeros((0, c.row_bytes), np.uint8)
            slots = None
        cu = np.asarray(cu_seqlens, np.int64).reshape(-1)
        for i, s in enumerate(self._batch_ids(seqs)):
            a, b = int(cu[i]), int(cu[i + 1])
            if self._external:
                assert slots is not None
                check_slots(slots[a:b], s, b - a, c, f"seq {s} process_many")
                below = pos[a:b] < self._st.state(s)["horizon"]
                if not np.array_equal(slots[a:b] < 0, below):
                    _violation(f"seq {s} process_many: slot -1 must mark exactly the rows below the horizon")
            m = self._models[s]
            for k in range(a, b):
                m.truth[int(pos[k])] = enc[k].tobytes()
            self._sync_truth(s)
        self._check_live()
        return slots

    def commit_many(self, seqs: Any) -> None:
        ids = self._batch_ids(seqs)
        self._call("commit_many", seqs, closed=ids)
        for s in ids:
            self._after_commit(s)

    def fail_many(self, seqs: Any, stages: Any = "decode") -> np.ndarray:
        ids = self._batch_ids(seqs)
        disabled: np.ndarray = self._call("fail_many", seqs, stages, closed=ids)
        for s in ids:
            self._after_fail(s)
        return disabled

    def accept_many(self, seqs: Any, n_accepted: Any) -> None:
        before = self._states()
        self._call("accept_many", seqs, n_accepted)
        for s in self._batch_ids(seqs):
            self._after_accept(s, before[s])

    def end(self, seq: int) -> None:
        self._call("end", seq)
        self._after_end([int(seq)])

    def end_many(self, seqs: Any) -> None:
        self._call("end_many", seqs)
        self._after_end(self._batch_ids(seqs))

    # The drafting switch changes no row and no drafter cache: a skip of its own follows.
    def disable(self, seq: int) -> None:
        self._call("disable", seq)

    def enable(self, seq: int) -> None:
        self._call("enable", seq)

    def disable_many(self, seqs: Any) -> None:
        self._call("disable_many", seqs)

    def enable_many(self, seqs: Any) -> None:
        self._call("enable_many", seqs)

    def _after_end(self, ids: list[int]) -> None:
        for s in ids:
            self._models[s] = _Model()
            st = self._st.state(s)
            if st["started"] or st["open_round"] or st["reservation_open"] or self._st.stats(s)["rounds"]:
                _violation(f"seq {s}: after end() the sequence is not a new Stager's: {st}")

    def rollback(self, seq: int, n_past: int) -> None:
        self._call("rollback", seq, n_past)
        s = self._valid(seq)
        if s is not None:
            m = self._models[s]
            if m.cache and any(a >= int(n_past) for a, _ in m.cache.values()):
                m.cache = None  # the drafter holds rows of positions the target dropped
            self._sync_truth(s)

    def shift(self, seq: int, n_keep: int, n_discard: int) -> Any:
        moves = self._call("shift", seq, n_keep, n_discard)
        self._apply_moves(moves, f"shift({seq}, {n_keep}, {n_discard})")
        s = self._valid(seq)
        if s is not None and n_discard:
            m = self._models[s]
            hi = n_keep + n_discard
            m.truth = {(p if p < n_keep else p - n_discard): r for p, r in m.truth.items() if not n_keep <= p < hi}
            m.cache = None
            self._sync_truth(s)
        self._check_live()
        return moves

    def fork(self, src: int, dst: int) -> Any:
        moves = self._call("fork", src, dst)
        self._apply_moves(moves, f"fork({src}, {dst})")
        a, b = self._models[int(src)], _Model()
        b.truth = dict(a.truth)
        self._models[int(dst)] = b
        self._sync_truth(int(dst))
        self._check_live()
        return moves

    def snapshot(self, seq: int) -> bytes:
        """``snapshot``; with external rows the checker also keeps the live rows, for :meth:`restore`."""
        data = self._call("snapshot", seq)
        s = int(seq)
        c = self._cfg
        try:
            snap = snapshot_format.unpack(bytes(data), c.snapshot_fingerprint(), STORAGES, external=c.external_rows,
                                          tokens=_chain(c))
        except ValueError as exc:
            _violation(f"seq {s}: its own snapshot does not restore: {exc}")
        st = self._st.state(s)
        for k in ("end", "horizon", "n_cache", "pos_base", "started", "disabled"):
            if getattr(snap, k) != st[k]:
                _violation(f"seq {s}: snapshot {k} = {getattr(snap, k)}, state says {st[k]}")
        self._save_rows(s, bytes(data))
        return data

    def snapshot_into(self, seq: int, buffer: Any) -> int:
        n = self._call("snapshot_into", seq, buffer)
        s = int(seq)
        written = bytes(memoryview(buffer).cast("B")[:n])
        if n != self._st.snapshot_size(s) or written != bytes(self._st.snapshot(s)):
            _violation(f"seq {s}: snapshot_into wrote other bytes than snapshot() returns")
        self._save_rows(s, written)
        return n

    def _save_rows(self, s: int, data: bytes) -> None:
        """External rows: remember the rows of ``live_slots(s)`` under the snapshot's bytes (which
        hold no rows, so two snapshots with the same bookkeeping and other rows are ambiguous)."""
        if not self._external:
            return
        assert self.mirror is not None
        rows = self.mirror[np.asarray(self._st.live_slots(s), dtype=np.int64)]
        if data in self._saved:
            old = self._saved[data]
            self._saved[data] = rows if old is not None and np.array_equal(old, rows) else None
            self._saved.move_to_end(data)
        else:
            self._saved[data] = rows
            while len(self._saved) > SAVED_SNAPSHOTS:
                self._saved.popitem(last=False)

    def restore(self, seq: int, data: Any, rows: Any = None) -> np.ndarray | None:
        """``restore``. External rows: also puts the snapshot's rows (``rows``: uint8 ``(n, row_bytes)``,
        the rows of ``live_slots`` when it was taken; default: those this checker kept when it took
        the snapshot) back at the slots the Stager returns, and returns the slots."""
        if self._external:
            return self._restore_external(seq, data, rows)
        self._call("restore", seq, data)
        s = int(seq)
        c = self._cfg
        snap = snapshot_format.unpack(bytes(memoryview(data)), c.snapshot_fingerprint(), STORAGES,  # accepted
                                      tokens=_chain(c))
        m = _Model()
        rb = c.row_bytes
        for k in range(snap.end - snap.horizon):
            m.truth[snap.horizon + k] = snap.rows[k * rb:(k + 1) * rb]
        self._after_restore(s, m)
        return None

    def _restore_external(self, seq: int, data: Any, rows: Any) -> np.ndarray:
        c = self._cfg
        raw = bytes(memoryview(data).cast("B"))
        try:
            snap = snapshot_format.unpack(raw, c.snapshot_fingerprint(), STORAGES, external=True, tokens=_chain(c))
        except ValueError:
            snap = None  # the Stager must reject it (checked below)
        enc = np.zeros((0, c.row_bytes), np.uint8)
        if snap is not None:
            n = snap.end - snap.horizon
            if rows is None:
                rows = self._saved.get(raw)
                if rows is None:
                    raise TypeError("restore(seq, data, rows): an external-row snapshot holds no rows; pass the rows "
                                    "of live_slots(seq) at snapshot time (this checker kept none for these bytes)")
            enc = as_encoded(rows, n, c.row_bytes).reshape(n, c.row_bytes)
        slots = self._call("restore", seq, data)
        s = int(seq)
        if snap is None:
            _violation(f"seq {s}: restore accepted a snapshot an external-row Stager cannot take")
        check_slots(slots, s, len(enc), c, f"seq {s} restore")
        if np.any(np.asarray(slots) < 0):
            _violation(f"seq {s}: restore returned slot -1 for a live row")
        assert self.mirror is not None
        self.mirror[np.asarray(slots)] = enc
        m = _Model()
        for k in range(len(enc)):
            m.truth[snap.horizon + k] = enc[k].tobytes()
        self._after_restore(s, m)
        self._check_live()
        return np.asarray(slots)

    def _after_restore(self, s: int, m: _Model) -> None:
        self._models[s] = m
        st = self._st.state(s)
        if st["started"] and not st["restage_owed"]:
            _violation(f"seq {s}: a restored sequence must restage cleanly")
        self._sync_truth(s)

    def state(self, seq: int) -> dict[str, Any]:
        return self._st.state(seq)

    def stats(self, seq: int) -> dict[str, int]:
        return self._st.stats(seq)
