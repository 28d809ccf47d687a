"""The Stager behind one vLLM proposer: captured rows in, the drafter's windowed inputs out.

One :class:`RequestStaging` lives in each vLLM worker that drafts. Every engine
step vLLM hands its proposer the rows the target just computed (the tap
layers' hidden states, concatenated, one row per scheduled token) and the
requests they belong to; :meth:`RequestStaging.stage` feeds them to an
external-row :class:`~dspark_core.Stager` (one sequence per request) and builds
what the drafter runs on instead: each request's plan rows at drafter
positions inside ``[0, W)``, a shifted block table so the drafter's KV for
drafter position ``p`` lives in the request's own slot ``slot_base + p``, and
the sequence lengths that keep attention inside the window.

The rows never leave their device: the external-row table is a torch tensor
on vLLM's device, written and gathered with index operations. Only the
bookkeeping (positions, counts, token ids of a chain drafter) crosses to the
host, once per step for the whole batch.

This module needs torch but not vLLM, so its logic is tested without an engine.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Container, Mapping
from typing import Any

import numpy as np

from .._ext._stager import Stager
from ..stager.config import StagerConfig

__all__ = ["RequestStaging", "TargetRows", "DrafterInputs", "NULL_BLOCK", "FALLBACK_REASONS"]

logger = logging.getLogger(__name__)

#: vLLM's null block: reserved by the block pool, never given to a request, so
#: a request that does not draft this step writes its one placeholder row there.
NULL_BLOCK = 0
#: Why a request-step goes without drafts: the drafter raised for it, the Stager refused it (from
#: then on), the Stager opened no round for it (``BatchPlan.skips``), the step's staging failed.
FALLBACK_REASONS = ("drafter", "refused", "skipped", "staging")


@dataclasses.dataclass
class _Steady:
    """A step's requests (batch order), their sequences and ``n_past`` after it, and which opened a round."""

    req_ids: list[str]
    seqs: np.ndarray
    n_pasts: np.ndarray
    opened: np.ndarray | None = None   # None: every one of them


@dataclasses.dataclass
class TargetRows:
    """What the target computed this step, as vLLM's proposer receives it.

    Attributes:
        req_ids: the batch's requests, in batch order (``N``).
        query_start_loc: int64 ``(N + 1,)``: request ``i``'s rows are
            ``[query_start_loc[i], query_start_loc[i + 1])``.
        positions: int64 ``(T,)``: the absolute position of each row.
        n_valid: int64 ``(N,)``: the leading rows of each request the target
            kept (a verify batch's accepted tokens + 1; a prefill's all).
        rows: ``(T, D)`` torch tensor on the device: the captured rows.
        token_ids: int64 ``(T,)``: the token the target read at each row.
        next_token_ids: int64 ``(N,)``: each request's sampled token (``last``; ``N`` only).
        block_table: ``(N, M)`` int32 torch tensor: the batch's requests' KV blocks (``N`` rows only).
        live: every request the runner still holds (ended ones are not): a set, or the runner's dict.
        prompts: the prompt token ids of the batch's requests (for prefix-cache keys), by request.
    """

    req_ids: list[str]
    query_start_loc: np.ndarray
    positions: np.ndarray
    n_valid: np.ndarray
    rows: Any
    token_ids: np.ndarray
    next_token_ids: np.ndarray
    block_table: Any
    live: Container[str]
    prompts: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class DrafterInputs:
    """The drafter's first-pass inputs for one step (request order as :class:`TargetRows`).

    Attributes:
        token_ids: int64 torch ``(R,)``: ids laid out so that vLLM's
            shift-by-one puts each context row's successor beside it.
        positions: int64 torch ``(R,)``: drafter positions, all ``< W``.
        rows: torch ``(R, D)``: the context rows (the plan's, bit for bit).
        query_start_loc: int32 torch / int64 numpy ``(N + 1,)``: each request's rows.
        seq_lens: int32 torch / numpy ``(N,)``: the drafter context after the rows.
        block_table: int32 torch ``(N, M)``: block tables shifted to each window.
        slot_mapping: int64 torch ``(R,)``: where each row's KV goes.
        drafting: bool numpy ``(N,)``: the request's round opened (else its
            one placeholder row goes to the null block and its drafts are dropped).
        pos_base: int64 numpy ``(N,)``: absolute position of drafter position 0.
        rebase: bool numpy ``(N,)``: the request's drafter context was rebuilt.
    """

    token_ids: Any
    positions: Any
    rows: Any
    query_start_loc: Any
    query_start_loc_cpu: np.ndarray
    seq_lens: Any
    seq_lens_cpu: np.ndarray
    block_table: Any
    slot_mapping: Any
    drafting: np.ndarray
    pos_base: np.ndarray
    rebase: np.ndarray
    max_query_len: int
    max_seq_len: int


class RequestStaging:
    """An external-row Stager for one vLLM worker, with its row table on vLLM's device.

    Args:
        kind: ``"block"`` (DFlash) or ``"chain"`` (EAGLE-3: ids kept beside rows).
        feature_dim: the captured row width (tap layers x target hidden size).
        block_size: the Stager's ``B``: the drafter positions one round uses
            after the context (DFlash: ``num_speculative_tokens + 1`` query
            tokens; EAGLE-3: ``num_speculative_tokens``).
        window: ``W``, the drafter's trained range.
        max_seqs: the most requests running at once (vLLM's ``max_num_seqs``).
        kv_block_size: vLLM's KV cache block size.
        dtype / device: the torch dtype and device of vLLM's hidden states.
    """

    def __init__(self, *, kind: str, feature_dim: int, block_size: int, window: int, max_seqs: int,
                 kv_block_size: int, dtype: Any, device: Any) -> None:
        import torch

        self.kind = kind
        self.block_size = block_size
        self.window = window
        self.kv_block_size = kv_block_size
        self.stager = Stager(StagerConfig(feature_dim=feature_dim, block_size=block_size, window=window,
                                          max_seqs=max_seqs, storage="f32", rows="external", kind=kind))
        ring_rows = self.stager.ring_rows
        # One extra row at the end, kept zero: the placeholder row of a request that does not draft.
        self._scratch_slot = max_seqs * ring_rows
        self.table = torch.zeros((max_seqs * ring_rows + 1, feature_dim), dtype=dtype, device=device)
        self.device = device
        self._seq_of: dict[str, int] = {}
        self._free = list(range(max_seqs - 1, -1, -1))
        self._next_pos: dict[str, int] = {}      # n_past after the last step's rows
        self._open: set[str] = set()             # requests whose round awaits this step's verify rows
        self.disabled: set[str] = set()          # requests the Stager refused: plain decoding from now on
        self._logged: set[str] = set()
        self.fallbacks = 0                       # requests x steps that decoded without drafts
        self.fallbacks_by_reason = dict.fromkeys(FALLBACK_REASONS, 0)
        self.step_fallbacks = dict.fromkeys(FALLBACK_REASONS, 0)   # the latest step's, by reason
        self.no_drafts: set[str] = set()         # the latest step's requests that get no drafts
        self.counter: Any = None                 # a metrics.FallbackCounter: the fallbacks in vLLM's metrics
        self.last: DrafterInputs | None = None   # the latest step's drafter inputs (for checks and tests)
        self._all_active = False                 # every request of the latest plan opened its round
        self.current_req_ids: list[str] = []     # the requests of the drafter call running now
        self.prefix: Any = None                  # a PrefixRows when vLLM's prefix caching is on
        # The steady decode step (docs/vllm.md, "Cost"): the same requests as the last step, each
        # drafting and committed, its rows following on. Such a step skips the per-request
        # bookkeeping: _steady holds the last step's requests, sequences and n_past, and _lazy
        # the step's changes to _next_pos and _open, which _materialize writes when a step is not steady.
        self.fast_paths = True                   # False: every step takes the general paths (tests compare them)
        self.tables_on_host: bool | None = None  # shift block tables on the host (BatchPlan.paged); None: where they are on the CPU
        self._steady: _Steady | None = None
        self._lazy: _Steady | None = None
        self._seqs = np.zeros(0, dtype=np.int64)     # the latest step's planned sequences (the plan's seqs)
        self._n_pasts = np.zeros(0, dtype=np.int64)  # and their n_past
        self._fast = False                       # the latest step took the steady path
        self._past_prompts = False               # the latest general step's requests are all past their prompts

    # -- lifecycle -------------------------------------------------------------------------------

    def seq_of(self, req_id: str) -> int | None:
        """The Stager sequence serving ``req_id`` (None when it has none)."""
        return self._seq_of.get(req_id)

    def _end(self, req_id: str) -> None:
        seq = self._seq_of.pop(req_id)
        self.stager.end(seq)
        if self.prefix is not None:
            self.prefix.forget(req_id)
        self._free.append(seq)
        self._next_pos.pop(req_id, None)
        self._open.discard(req_id)

    def _begin(self, req_id: str, first: int = 0, prompt: Any = None) -> int:
        """A sequence for ``req_id``; one whose rows start at ``first > 0`` (vLLM's prefix-cache hit)
        starts from the prefix store's rows when it has them all, else cold."""
        if not self._free:
            raise RuntimeError("more running requests than max_num_seqs")
        seq = self._free.pop()
        if not (first > 0 and self.prefix is not None and prompt is not None
                and self.prefix.hit(req_id, seq, prompt, first)):
            self.stager.begin(seq)
        self._seq_of[req_id] = seq
        self._next_pos[req_id] = first
        return seq

    def _sync(self, rows: TargetRows) -> None:
        """End finished requests, begin new ones, and restart those whose rows do not follow on."""
        live = rows.live
        for req_id in [r for r in self._seq_of if r not in live]:
            self._end(req_id)
        if self.disabled:
            self.disabled = {r for r in self.disabled if r in live}
        qsl, pos = rows.query_start_loc.tolist(), rows.positions
        # Each request's first position as Python ints, read in one pass (a request without rows
        # reads a neighbour's, not used).
        firsts = pos.take(rows.query_start_loc[:-1], mode="clip").tolist() if len(pos) else qsl[:-1]
        next_pos = self._next_pos
        for req_id, first, a, b in zip(rows.req_ids, firsts, qsl, qsl[1:]):
            if a == b:
                first = next_pos.get(req_id, 0)
            elif first == next_pos.get(req_id, -1):
                continue  # the rows follow on: nothing to do
            if req_id not in self._seq_of:
                self._begin(req_id, first, rows.prompts.get(req_id))   # first > 0: a prefix-cache hit
            elif first < self._next_pos[req_id]:
                # Preempted and recomputed, or rolled back: keep the rows before it.
                self.stager.rollback(self._seq_of[req_id], first)
                self._open.discard(req_id)
                self._next_pos[req_id] = first
            elif first > self._next_pos[req_id]:
                # A gap (rows the plugin never saw): start the sequence again from here.
                self._end(req_id)
                self._begin(req_id, first)

    def _refuse(self, req_id: str, err: BaseException) -> None:
        """Plain decoding for ``req_id`` from now on; logged once per request."""
        self.disabled.add(req_id)
        if req_id in self._seq_of:
            self._end(req_id)
        if req_id not in self._logged:
            self._logged.add(req_id)
            logger.warning("dspark_core: request %s decodes without drafts from now on: %s: %s",
                           req_id, type(err).__name__, err)

    # -- one step --------------------------------------------------------------------------------

    def _process(self, rows: TargetRows, idx: list[int],
                 steady: _Steady | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Append the step's rows of requests ``idx`` and keep the verified ones.

        A request whose round opened last step gets its whole verify batch and
        ``accept`` (the protocol's order); any other gets only the rows the
        target kept (a prefill, or placeholder drafts verified after a skip).
        Returns the requests' sequences and their ``n_past`` after the step.
        With ``steady`` (the last step's requests, every one of them in the
        batch and open) the sequences are its, and ``_next_pos`` / ``_open``
        are left to the caller (``_lazy``).
        """
        import torch

        qsl = rows.query_start_loc
        req_ids = rows.req_ids
        everyone = len(idx) == len(req_ids)
        reqs = req_ids if everyone else [req_ids[i] for i in idx]
        opened: np.ndarray | None = None       # which requests verify a round; None: all of them
        if steady is not None:
            seqs = steady.seqs
        else:
            seq_of, is_open = self._seq_of, self._open
            seqs = np.fromiter((seq_of[r] for r in reqs), dtype=np.int64, count=len(reqs))
            opened = np.fromiter((r in is_open for r in reqs), dtype=bool, count=len(reqs))
        if everyone:  # no request refused: the batch's own arrays, no fancy index
            starts, ends, n_valid = qsl[:-1], qsl[1:], rows.n_valid[: len(reqs)]
        else:
            where = np.asarray(idx, dtype=np.int64)
            starts, ends, n_valid = qsl[where], qsl[where + 1], rows.n_valid[where]
        if opened is not None and opened.all():
            opened = None
        if everyone and opened is None and not qsl[0]:
            # Every request verifies a round: it takes all its rows, the batch's in order.
            cu = qsl
            take = None
            positions, token_ids = rows.positions[: int(qsl[-1])], rows.token_ids[: int(qsl[-1])]
        else:
            lens = (ends - starts if opened is None else np.where(opened, ends - starts, n_valid)).astype(np.int64)
            cu = np.zeros(len(idx) + 1, dtype=np.int64)
            np.cumsum(lens, out=cu[1:])
            # Each request's rows [start, start + len), laid end to end: one arange, shifted per request.
            take = np.arange(cu[-1], dtype=np.int64) + np.repeat(starts - cu[:-1], lens)
            positions, token_ids = rows.positions[take], rows.token_ids[take]
        tokens = token_ids.astype(np.int32) if self.kind == "chain" else None
        slots = self.stager.process_many(seqs, cu, positions, tokens=tokens)
        assert slots is not None
        keep = slots >= 0
        n_keep = int(np.count_nonzero(keep))
        if n_keep:
            if n_keep == len(slots):
                dst_np, src_np = slots, take
            else:
                dst_np = slots[keep]
                src_np = np.flatnonzero(keep) if take is None else take[keep]
            dst = torch.from_numpy(dst_np).to(self.device)
            # All the batch's rows in order: the captured tensor itself, no gather.
            if src_np is not None:
                src = rows.rows.index_select(0, torch.from_numpy(src_np).to(self.device))
            else:
                src = rows.rows if rows.rows.shape[0] == len(slots) else rows.rows[: len(slots)]
            if src.dtype != self.table.dtype:
                src = src.to(self.table.dtype)
            self.table.index_copy_(0, dst, src)
        # minimum / maximum, not np.clip: clip on integers goes through a slow Python path (getlimits).
        if opened is None:
            self.stager.accept_many(seqs, np.maximum(np.minimum(n_valid - 1, self.block_size), 0))
        elif opened.any():
            n_acc = np.maximum(np.minimum(n_valid[opened] - 1, self.block_size), 0)
            self.stager.accept_many(seqs[opened], n_acc)
        # A steady step's rows start at the last n_past (_follows_on checked it): no gather.
        n_pasts = steady.n_pasts + n_valid if steady is not None else (rows.positions[starts] + n_valid).astype(np.int64)
        if steady is None:
            self._open.difference_update(reqs)
            self._next_pos.update(zip(reqs, n_pasts.tolist()))
        return seqs, n_pasts

    def stage(self, rows: TargetRows) -> DrafterInputs:
        """Feed the step's rows to the Stager and plan every request's drafter inputs.

        A request the Stager refuses (its rows, or its plan) decodes without
        drafts from then on; the others are not affected.
        """
        if self.no_drafts:
            self.no_drafts = set()
        steady, self._steady = self._steady, None
        if steady is not None and self.fast_paths and self._follows_on(rows, steady):
            inputs = self._stage_steady(rows, steady)
            if inputs is not None:
                return inputs
        self._materialize()
        return self._stage_general(rows)

    @staticmethod
    def _follows_on(rows: TargetRows, steady: _Steady) -> bool:
        """The step is the steady one: the last step's requests in its order, each with rows from its n_past."""
        qsl = rows.query_start_loc
        if rows.req_ids != steady.req_ids or qsl[0] or int(qsl[-1]) > len(rows.positions):
            return False
        firsts = qsl[:-1]
        # (a == b).all(), not np.array_equal: the same answer on equal shapes, without its Python-level checks.
        return bool((qsl[1:] > firsts).all() and (rows.positions[firsts] == steady.n_pasts).all())

    def _stage_steady(self, rows: TargetRows, steady: _Steady) -> DrafterInputs | None:
        """The steady step: no request to begin, end, roll back, refuse or publish; one batch call each.

        None when the rows' batch call raised (it changed nothing): the general path retries the step.
        """
        n = len(steady.req_ids)
        idx = list(range(n))
        try:
            seqs, n_pasts = self._process(rows, idx, steady)
        except Exception:  # noqa: BLE001 - the general path retries request by request
            return None
        try:
            plan = self.stager.draft_many(seqs, n_pasts)
        except Exception:
            # As the general path leaves it: the rows are in, no round is open.
            self._lazy = _Steady(steady.req_ids, seqs, n_pasts, np.zeros(n, dtype=bool))
            self._materialize()
            raise
        active = plan.active
        self._all_active = bool(active.all())
        self._lazy = _Steady(steady.req_ids, seqs, n_pasts, None if self._all_active else active)
        self._plan, self._plan_index, self._seqs, self._n_pasts, self._fast = plan, idx, seqs, n_pasts, True
        self.last = self._inputs(rows, n, idx, plan, active)
        return self.last

    def _materialize(self) -> None:
        """Write the steady steps' changes to ``_next_pos`` and ``_open`` (before any step that reads them)."""
        lazy, self._lazy = self._lazy, None
        if lazy is None:
            return
        self._next_pos.update(zip(lazy.req_ids, lazy.n_pasts.tolist()))
        if lazy.opened is None:
            self._open.update(lazy.req_ids)
        else:
            self._open.difference_update(lazy.req_ids)
            self._open.update(r for r, a in zip(lazy.req_ids, lazy.opened.tolist()) if a)

    def _stage_general(self, rows: TargetRows) -> DrafterInputs:
        """Any step: requests begun, ended, restarted, refused; prefix rows published."""
        self._fast = False
        self._sync(rows)
        n = len(rows.req_ids)
        disabled = self.disabled
        idx = [i for i, r in enumerate(rows.req_ids) if r not in disabled] if disabled else list(range(n))
        batch: tuple[np.ndarray, np.ndarray] | None = None
        try:
            batch = self._process(rows, idx)
        except Exception:  # noqa: BLE001 - one request's bad rows must not stop the batch
            # The batch call changed nothing: retry each request alone, refuse the ones that fail.
            good = []
            for i in idx:
                try:
                    self._process(rows, [i])
                    good.append(i)
                except Exception as err:  # noqa: BLE001
                    self._refuse(rows.req_ids[i], err)
            idx = good
        reqs = rows.req_ids if len(idx) == n else [rows.req_ids[i] for i in idx]
        if batch is not None:  # the batch call went through: its sequences and n_past are the plan's
            seqs, n_pasts = batch
        else:
            next_pos, seq_of = self._next_pos, self._seq_of
            n_pasts = np.fromiter((next_pos[r] for r in reqs), dtype=np.int64, count=len(reqs))
            seqs = np.fromiter((seq_of[r] for r in reqs), dtype=np.int64, count=len(reqs))
        # A later step is steady only once every request's rows are past its prompt (nothing to publish).
        self._past_prompts = True
        if self.prefix is not None:
            qsl = rows.query_start_loc
            for i, req, n_past in zip(idx, reqs, n_pasts.tolist()):
                prompt = rows.prompts.get(req)
                if prompt is None:
                    continue
                a = int(qsl[i])
                # Rows past the prompt hold no prompt block: nothing to publish (publish would say so).
                if int(rows.positions[a]) < len(prompt):
                    self.prefix.publish(req, prompt, int(rows.positions[a]), rows.rows[a:a + int(rows.n_valid[i])])
                if n_past < len(prompt):
                    self._past_prompts = False
        plan = self.stager.draft_many(seqs, n_pasts)
        active = np.asarray(plan.active, dtype=bool)
        self._all_active = bool(active.all())
        if self._all_active:
            self._open.update(reqs)
        else:
            self._open.update(r for r, a in zip(reqs, active.tolist()) if a)
        self._plan, self._plan_index, self._seqs, self._n_pasts = plan, idx, seqs, n_pasts
        self.last = self._inputs(rows, n, idx, plan, active)
        return self.last

    def _inputs(self, rows: TargetRows, n: int, idx: list[int], plan: Any, active_k: np.ndarray) -> DrafterInputs:
        """The drafter's inputs from the plan: host arrays in numpy, then few device ops for the batch."""
        import torch

        nk = len(idx)
        if nk == n and self._all_active and self.fast_paths:
            return self._inputs_dense(rows, n, plan, active_k)
        offs = np.asarray(plan.row_offsets, dtype=np.int64)
        n_rows_k = offs[1:] - offs[:-1]
        if nk == n:
            drafting = active_k.copy()
            n_rows = n_rows_k
            pb, rb, cf = (np.asarray(plan.pos_base, np.int64), np.asarray(plan.rebase, bool),
                          np.asarray(plan.crop_from, np.int64))
        else:
            where = np.asarray(idx, dtype=np.int64)
            drafting = np.zeros(n, dtype=bool)
            drafting[where] = active_k
            n_rows = np.zeros(n, dtype=np.int64)
            n_rows[where] = n_rows_k
            pb, rb, cf = np.zeros(n, np.int64), np.zeros(n, bool), np.ones(n, np.int64)
            pb[where], rb[where], cf[where] = plan.pos_base, plan.rebase, plan.crop_from
        pos_base = np.where(drafting, pb, 0)
        rebase = drafting & rb
        # A request that does not draft gets one placeholder row (the table's zero scratch row).
        counts = np.where(drafting, n_rows, 1)
        seq_lens = np.where(drafting, cf, 1).astype(np.int32)
        qsl = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(counts, out=qsl[1:])
        total = int(qsl[-1])
        n_plan = int(offs[-1]) if len(offs) else 0
        next_ids = rows.next_token_ids[:n].astype(np.int64, copy=False)
        gather = np.full(total, self._scratch_slot, dtype=np.int64)
        positions = np.zeros(total, dtype=np.int64)
        # vLLM's first pass reads input_ids[j] = token_ids[j + 1] (then the newest row's is the
        # sampled token): the ids one place late. succ[j] is the id after row j.
        succ = np.repeat(next_ids, counts)       # placeholders' ids, and every request's newest row's
        if n_plan:
            # Plan rows are in batch order (idx ascends) and only drafting requests have any.
            starts_k = qsl[:-1] if nk == n else qsl[np.asarray(idx, dtype=np.int64)]
            dest = np.arange(n_plan) + np.repeat(starts_k - offs[:-1], n_rows_k)
            gather[dest] = plan.slots
            positions[dest] = plan.positions
            if self.kind == "chain" and n_plan > 1:
                # The id after each row: the next row's, and the sampled token after the newest.
                tok = np.asarray(plan.tokens, dtype=np.int64)
                not_last = np.ones(n_plan, dtype=bool)
                not_last[offs[1:][n_rows_k > 0] - 1] = False
                succ[dest[not_last]] = tok[1:][not_last[:-1]]
        token_ids = np.empty(total, dtype=np.int32)
        if total:
            token_ids[0] = 0
            token_ids[1:] = succ[:-1]
        # The block tables shifted by slot_base // kv block size, on the host as indices: a column
        # past the table, or a request that does not draft, reads the null block.
        bt = rows.block_table[:n]
        col, null = self._shift_columns(pos_base, bt.shape[1])
        null |= ~drafting[:, None]
        blk, off = self._kv_blocks(positions, counts, bt.shape[1])
        dev = self.device
        ctx_rows = self.table.index_select(0, torch.from_numpy(gather).to(dev))
        shifted, slot_mapping = self._shift_on_device(bt, col, null, blk, off)
        positions_t = torch.from_numpy(positions).to(dev)
        return DrafterInputs(
            token_ids=torch.from_numpy(token_ids).to(dev),
            positions=positions_t,
            rows=ctx_rows,
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev),
            query_start_loc_cpu=qsl,
            seq_lens=torch.from_numpy(seq_lens).to(dev),
            seq_lens_cpu=seq_lens,
            block_table=shifted,
            slot_mapping=slot_mapping,
            drafting=drafting,
            pos_base=pos_base,
            rebase=rebase,
            max_query_len=int(counts.max()) if n else 0,
            max_seq_len=int(seq_lens.max()) if n else 0,
        )

    def _shift_columns(self, pos_base: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
        """Each request's block-table columns shifted by ``pos_base // kv block size`` (clamped), and
        which of them fall past the table (they read the null block)."""
        col = np.arange(m, dtype=np.int64) + (pos_base // self.kv_block_size)[:, None]
        null = col >= m
        np.minimum(col, m - 1, out=col)
        return col, null

    def _kv_blocks(self, positions: np.ndarray, counts: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
        """Each row's KV block as a flat index into the ``(N, m)`` shifted tables, and its offset in it."""
        blk, off = np.divmod(positions, self.kv_block_size)
        blk += np.repeat(np.arange(len(counts), dtype=np.int64) * m, counts)
        return blk, off

    def _shift_on_device(self, bt: Any, col: np.ndarray, null: np.ndarray, blk: np.ndarray,
                         off: np.ndarray) -> tuple[Any, Any]:
        """The shifted block tables and each row's KV slot as device operations on ``bt`` (where the
        block tables live on the device): one gather, one masked fill, one index_select and one add."""
        import torch

        dev = self.device
        shifted = bt.gather(1, torch.from_numpy(col).to(dev))
        shifted.masked_fill_(torch.from_numpy(null).to(dev), NULL_BLOCK)
        slot_mapping = torch.add(torch.from_numpy(off).to(dev),
                                 shifted.view(-1).index_select(0, torch.from_numpy(blk).to(dev)),
                                 alpha=self.kv_block_size)
        return shifted, slot_mapping

    def _inputs_dense(self, rows: TargetRows, n: int, plan: Any, active: np.ndarray) -> DrafterInputs:
        """``_inputs`` when every request drafts: the plan's arrays are the batch's, laid out in two
        host buffers that reach the device in two copies (int32: ids, query starts, sequence
        lengths, shifted block tables; int64: positions, row slots, KV slots). With the block
        tables on the host (vLLM's CPU platform) the shift and the KV slots are the core's paged layout
        (``BatchPlan.paged``), written into the buffers, not device operations."""
        import torch

        qsl = plan.row_offsets
        counts = qsl[1:] - qsl[:-1]
        total = int(qsl[-1])
        next_ids = rows.next_token_ids
        bt = rows.block_table          # (N, M): _target_rows gives the batch's rows only
        m = bt.shape[1]
        host_bt = bt.is_cpu if self.tables_on_host is None else self.tables_on_host
        a, b, c = total, total + n + 1, total + 2 * n + 1   # the int32 buffer's parts end here
        i32 = np.empty(c + (n * m if host_bt else 0), dtype=np.int32)
        i64 = np.empty(3 * total, dtype=np.int64)
        token_ids, seq_lens = i32[:a], i32[b:c]
        positions, slots = i64[:total], i64[2 * total:]
        # The ids one place late (as in _inputs): row j gets its own id (a chain drafter's kept id, a
        # block drafter's sampled token) except a request's first row: the previous request's sampled token.
        token_ids[:] = plan.tokens if self.kind == "chain" else np.repeat(next_ids, counts)
        if total:
            token_ids[qsl[1:-1]] = next_ids[:-1]
            token_ids[0] = 0
        i32[a:b] = qsl
        seq_lens[:] = plan.crop_from
        positions[:] = plan.positions
        i64[total:2 * total] = plan.slots
        pos_base = plan.pos_base
        dev = self.device
        if host_bt:  # the core's paged layout, written into the int32 and int64 buffers
            shifted_np = i32[c:].reshape(n, m)
            plan.paged(bt.numpy(), self.kv_block_size, null_block=NULL_BLOCK, tables_out=shifted_np, slots_out=slots)
        d32 = torch.from_numpy(i32).to(dev)
        d64 = torch.from_numpy(i64).to(dev)
        if host_bt:
            shifted, slot_mapping = torch.from_numpy(shifted_np).to(dev), d64[2 * total:]
        else:
            col, null = self._shift_columns(pos_base, m)
            blk, off = self._kv_blocks(positions, counts, m)
            shifted, slot_mapping = self._shift_on_device(bt, col, null, blk, off)
        return DrafterInputs(
            token_ids=d32[:a], positions=d64[:total], rows=self.table.index_select(0, d64[total:2 * total]),
            query_start_loc=d32[a:b], query_start_loc_cpu=qsl, seq_lens=d32[b:c], seq_lens_cpu=seq_lens,
            block_table=shifted, slot_mapping=slot_mapping, drafting=active.copy(), pos_base=pos_base,
            rebase=plan.rebase, max_query_len=int(counts.max()) if n else 0,
            max_seq_len=int(seq_lens.max()) if n else 0)

    def select(self, inp: DrafterInputs, sel: np.ndarray) -> DrafterInputs:
        """``inp`` for the requests ``sel`` only (batch indices, ascending): a retry without the others."""
        import torch

        if len(sel) == len(inp.drafting):
            return inp
        qsl = inp.query_start_loc_cpu
        take = np.concatenate([np.arange(qsl[i], qsl[i + 1]) for i in sel]).astype(np.int64)
        counts = qsl[sel + 1] - qsl[sel]
        sub_qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        dev = self.device
        take_t = torch.from_numpy(take).to(dev)
        sel_t = torch.from_numpy(sel).to(dev)
        succ_next = inp.token_ids.index_select(0, torch.clamp(take_t + 1, max=inp.token_ids.shape[0] - 1))
        # token_ids are laid out one place late: rebuild them for the subset from the successors.
        token_ids = torch.cat([succ_next.new_zeros(1), succ_next[:-1]]) if len(take) else succ_next
        seq_lens = inp.seq_lens_cpu[sel]
        return DrafterInputs(
            token_ids=token_ids, positions=inp.positions.index_select(0, take_t),
            rows=inp.rows.index_select(0, take_t),
            query_start_loc=torch.from_numpy(sub_qsl.astype(np.int32)).to(dev), query_start_loc_cpu=sub_qsl,
            seq_lens=inp.seq_lens.index_select(0, sel_t), seq_lens_cpu=seq_lens,
            block_table=inp.block_table.index_select(0, sel_t),
            slot_mapping=inp.slot_mapping.index_select(0, take_t),
            drafting=inp.drafting[sel], pos_base=inp.pos_base[sel], rebase=inp.rebase[sel],
            max_query_len=int(counts.max()), max_seq_len=int(seq_lens.max()))

    @property
    def all_drafting(self) -> bool:
        """Every request of the latest step's batch opened its round (none refused or skipped)."""
        return self.last is not None and self._all_active and len(self._plan_index) == len(self.last.drafting)

    def note_failure(self, err: BaseException) -> None:
        """A batched drafter call (or the staging) raised: logged once per error type."""
        key = "batch:" + type(err).__name__
        if key not in self._logged:
            self._logged.add(key)
            logger.warning("dspark_core: a drafter batch raised %s: %s; retrying request by request",
                           type(err).__name__, err)

    def note_request_failure(self, req_id: str, err: BaseException) -> None:
        """The drafter raised for ``req_id`` alone: its round fails (logged once per request)."""
        if req_id not in self._logged:
            self._logged.add(req_id)
            logger.warning("dspark_core: the drafter raised for request %s (%s: %s): it decodes without "
                           "drafts this step", req_id, type(err).__name__, err)

    def finish(self, rows: TargetRows, ok: np.ndarray | None = None) -> None:
        """Close the step's rounds: commit the requests whose drafts came back, fail the others.

        The requests without drafts this step (``no_drafts``) are counted by
        reason in ``step_fallbacks`` (and ``fallbacks_by_reason``, ``fallbacks``).

        Args:
            ok: bool ``(N,)`` in batch order: the drafter ran for that request
                (None: it ran for every one).
        """
        plan, idx = self._plan, self._plan_index
        n = len(rows.req_ids)
        if idx and len(idx) == n and self._all_active and (ok is None or ok.all()):
            # The common step: every request drafted; nothing to count but the commit.
            seqs = self._seqs
            self.stager.commit_many(seqs)
            if self.no_drafts or any(self.step_fallbacks.values()):
                self.step_fallbacks, self.no_drafts = dict.fromkeys(FALLBACK_REASONS, 0), set()
            # The next step may be steady: every running request drafts, none disabled, none to publish.
            if self._fast:
                self._steady = self._lazy   # this step's requests, sequences and n_past, every one open
            elif not self.disabled and len(self._seq_of) == n and self._past_prompts:
                self._steady = _Steady(list(rows.req_ids), seqs, self._n_pasts)
            return
        if ok is None:
            ok = np.ones(n, dtype=bool)
        drafted = np.zeros(n, dtype=bool)
        skipped = drafter = 0
        if idx:
            where = np.asarray(idx, dtype=np.int64)
            active = np.asarray(plan.active, dtype=bool)
            went = ok[where]
            seqs = np.asarray(plan.seqs, dtype=np.int64)
            if (active & went).any():
                self.stager.commit_many(seqs[active & went])
            failed = active & ~went
            if failed.any():
                self.stager.fail_many(seqs[failed], "decode")
            drafted[where] = active & went
            skipped, drafter = int((~active).sum()), int(failed.sum())
        self._count({"drafter": drafter, "refused": n - len(idx), "skipped": skipped, "staging": 0},
                    [r for r, d in zip(rows.req_ids, drafted) if not d])

    def step_failed(self, req_ids: list[str]) -> None:
        """The staging of the step raised: none of ``req_ids`` drafts this step."""
        self._count({"drafter": 0, "refused": 0, "skipped": 0, "staging": len(req_ids)}, req_ids)

    def _count(self, by_reason: dict[str, int], no_drafts: list[str]) -> None:
        self.step_fallbacks = by_reason
        self.no_drafts = set(no_drafts)
        for reason, k in by_reason.items():
            self.fallbacks_by_reason[reason] += k
        self.fallbacks += len(no_drafts)
        if self.counter is not None and no_drafts:
            self.counter.count(by_reason)
