"""The vLLM plugin's staging fast paths against its general paths, without an engine (needs torch).

``RequestStaging`` takes a steady decode step (the same requests as the last
step, each drafting and committed, rows following on) and a step where every
request drafts through shortcuts (``_stage_steady``, ``_inputs_dense``). With
``fast_paths = False`` every step takes the general code, which the engine
tests check against vLLM itself; here a server-shaped run (requests joining,
finishing, preempted and recomputed, chunked prefills, drafter failures, a
refused request, rows recomputed in place, rebases past the window) goes through both, and every step's
drafter inputs, fallbacks, prefix publishes, the Stager's counters and every
sequence's snapshot bytes must be equal, and every KV slot must be the one a
paged-attention kernel reads (a loop oracle). The device-side block-table shift (``tables_on_host = False``, what a
GPU runs) is checked on CPU tensors the same way.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: pip install 'dspark-core[vllm]' (docs/vllm.md)")

from dspark_core.vllm.staging import DrafterInputs, RequestStaging, TargetRows  # noqa: E402

D = 16          # captured row width
W = 32          # the drafter's trained range
KV_BLOCK = 8    # vLLM's KV block size
M = 24          # block-table columns
MAX_SEQS = 6


class _RecordingPrefix:
    """A prefix store that stores nothing and records what the staging publishes (and never hits)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def publish(self, req_id, prompt, first, rows) -> None:
        self.calls.append((req_id, first, int(rows.shape[0])))

    def hit(self, *args) -> bool:
        return False

    def forget(self, req_id) -> None:
        self.calls.append((req_id, -1, 0))


@dataclasses.dataclass
class _Request:
    rid: str
    prompt: list[int]
    pos: int = 0            # n_past: the target's computed tokens
    chunk: int = 0          # tokens of the prompt prefilled per step (chunked prefill)


def _activations(gen: torch.Generator, n: int, first_is_bos: bool) -> torch.Tensor:
    """Rows shaped like a target's: N(0, 1) with a few massive channels, a huge-norm BOS row."""
    x = torch.randn(n, D, generator=gen)
    x[:, 3] *= 40.0
    x[:, 11] -= 25.0
    if first_is_bos and n:
        x[0] *= 300.0
    return x


def _server_run(kind: str, k: int, seed: int, steps: int = 160):
    """A vLLM-shaped sequence of (TargetRows, ok) with every event the staging handles."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    running: list[_Request] = []
    preempted: list[_Request] = []
    made = 0
    tables = {}
    for _ in range(steps):
        if len(running) + len(preempted) < MAX_SEQS and (not running or rng.random() < 0.15):
            plen = int(rng.integers(3, 70))
            req = _Request(f"r{made}", [int(t) for t in rng.integers(3, 500, plen)],
                           chunk=int(rng.integers(8, 40)) if rng.random() < 0.3 else plen)
            made += 1
            running.append(req)
            tables[req.rid] = rng.permutation(np.arange(1, 4 * M))[:M].astype(np.int32)
        if preempted and rng.random() < 0.2:     # resumed: recomputed from the start
            req = preempted.pop(0)
            req.pos = 0
            running.append(req)
        if len(running) > 1 and rng.random() < 0.04:
            preempted.append(running.pop(int(rng.integers(len(running)))))
        if running and rng.random() < 0.04:           # rolled back in place: rows recomputed from an earlier position
            req = running[int(rng.integers(len(running)))]
            if req.pos > 1:
                req.pos = int(rng.integers(1, req.pos))
        if len(running) > 1 and rng.random() < 0.05:   # finished
            gone = running.pop(int(rng.integers(len(running))))
            tables.pop(gone.rid)
        lens, firsts, n_valid = [], [], []
        for req in running:
            if req.pos < len(req.prompt):        # (chunked) prefill: every row kept
                n = min(req.chunk, len(req.prompt) - req.pos)
                lens.append(n)
                n_valid.append(n)
            else:                                # a verify batch: the sampled token and k drafts
                lens.append(k + 1)
                n_valid.append(1 + int(rng.integers(0, k + 1)))
            firsts.append(req.pos)
        qsl = np.zeros(len(running) + 1, dtype=np.int64)
        np.cumsum(lens, out=qsl[1:])
        positions = np.concatenate([np.arange(f, f + n) for f, n in zip(firsts, lens)]).astype(np.int64)
        rows = torch.cat([_activations(gen, n, f == 0) for f, n in zip(firsts, lens)])
        target = TargetRows(
            req_ids=[r.rid for r in running], query_start_loc=qsl, positions=positions,
            n_valid=np.asarray(n_valid, dtype=np.int64), rows=rows,
            token_ids=rng.integers(3, 500, len(positions)).astype(np.int64),
            next_token_ids=rng.integers(3, 500, len(running)).astype(np.int64),
            block_table=torch.from_numpy(np.stack([tables[r.rid] for r in running])),
            live={r.rid for r in running} | {r.rid for r in preempted},
            prompts={r.rid: r.prompt for r in running + preempted})
        for req, nv in zip(running, n_valid):
            req.pos += nv
        ok = np.ones(len(running), dtype=bool)
        if rng.random() < 0.05:
            ok[int(rng.integers(len(running)))] = False    # the drafter raised for one request
        yield target, ok


def _staging(kind: str, k: int, *, fast: bool, tables_on_host: bool | None = None) -> RequestStaging:
    block = k if kind == "chain" else k + 1
    st = RequestStaging(kind=kind, feature_dim=D, block_size=block, window=W, max_seqs=MAX_SEQS,
                        kv_block_size=KV_BLOCK, dtype=torch.float32, device=torch.device("cpu"))
    st.fast_paths = fast
    st.tables_on_host = tables_on_host
    st.prefix = _RecordingPrefix()
    return st


def _same_sequences(a: RequestStaging, b: RequestStaging) -> bool:
    """The same requests on the same sequences, and every sequence's snapshot the same bytes."""
    return a._seq_of == b._seq_of and all(a.stager.snapshot(q) == b.stager.snapshot(q) for q in a._seq_of.values())


def _equal(a: DrafterInputs, b: DrafterInputs) -> list[str]:
    """The fields where two drafter inputs differ (values and dtypes)."""
    diff = []
    for f in dataclasses.fields(DrafterInputs):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            same = x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        elif isinstance(x, np.ndarray):
            same = x.dtype == y.dtype and np.array_equal(x, y)
        else:
            same = x == y
        if not same:
            diff.append(f.name)
    return diff


def _kv_slots_as_paged_attention_reads_them(rows: TargetRows, inp: DrafterInputs) -> list[int]:
    """The rows whose KV slot is not what a paged-attention kernel reads for them (an oracle of
    plain loops, independent of both paths): drafter position ``p`` of request ``i`` lives in
    column ``pos_base[i] // KV_BLOCK + p // KV_BLOCK`` of the request's own block table (the
    window's slot base rounded down to a block), at offset ``p % KV_BLOCK``; a column past the
    table, or a request that does not draft, is the null block."""
    bad = []
    tables, qsl = rows.block_table.numpy(), inp.query_start_loc_cpu
    for i in range(len(qsl) - 1):
        for j in range(int(qsl[i]), int(qsl[i + 1])):
            p = int(inp.positions[j])
            col = int(inp.pos_base[i]) // KV_BLOCK + p // KV_BLOCK
            block = int(tables[i, col]) if inp.drafting[i] and col < M else 0
            if int(inp.slot_mapping[j]) != block * KV_BLOCK + p % KV_BLOCK:
                bad.append(j)
    return bad


@pytest.mark.parametrize("kind,k,seed", [("chain", 3, 0), ("block", 3, 1), ("chain", 2, 2), ("block", 4, 3)])
def test_fast_paths_give_the_general_paths_inputs(kind, k, seed):
    general = _staging(kind, k, fast=False)
    fast = _staging(kind, k, fast=True)
    on_device = _staging(kind, k, fast=True, tables_on_host=False)
    steady_steps = dense_steps = rebases = failures = 0
    for i, (rows, ok) in enumerate(_server_run(kind, k, seed)):
        want = general.stage(rows)
        for st in (fast, on_device):
            got = st.stage(rows)
            assert _equal(want, got) == [], f"step {i}"
        assert not general._fast and _kv_slots_as_paged_attention_reads_them(rows, want) == [], f"step {i}"
        steady_steps += fast._fast
        dense_steps += int(want.drafting.all())
        rebases += int(want.rebase.any())
        failures += int(not ok.all())
        for st in (general, fast, on_device):
            st.finish(rows, ok)
        for st in (fast, on_device):
            assert st.no_drafts == general.no_drafts and st.step_fallbacks == general.step_fallbacks, f"step {i}"
            assert st.stager.totals() == general.stager.totals(), f"step {i}"
            assert st.prefix.calls == general.prefix.calls, f"step {i}"
            assert _same_sequences(st, general), f"step {i}"
    assert fast.fallbacks_by_reason == general.fallbacks_by_reason
    # The run really exercised both paths and the events that leave the steady one.
    assert steady_steps >= 40 and dense_steps > steady_steps and rebases >= 5 and failures >= 3
    assert general.fallbacks_by_reason["drafter"] >= 3
    assert any(first > 0 for _, first, _ in general.prefix.calls)   # a chunked prefill published its second chunk


class _Refusing:
    """A Stager that refuses any batch holding ``bad_seq`` while ``on`` (as it refuses rows it cannot stage)."""

    def __init__(self, stager, bad_seq: int) -> None:
        self._stager, self.bad_seq, self.on = stager, bad_seq, False

    def process_many(self, seqs, *args, **kwargs):
        if self.on and self.bad_seq in list(seqs):
            raise ValueError(f"sequence {self.bad_seq}: refused")
        return self._stager.process_many(seqs, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._stager, name)


def test_a_refused_request_leaves_the_steady_path_alike():
    """At step 40 the Stager refuses sequence 0's rows: the fast staging refuses the same request at
    the same step as the general one, and the two stay equal after it."""
    general, fast = _staging("chain", 3, fast=False), _staging("chain", 3, fast=True)
    for st in (general, fast):
        st.stager = _Refusing(st.stager, bad_seq=0)
    steady_with_refused = steady_after = 0
    for i, (rows, ok) in enumerate(_server_run("chain", 3, seed=7)):
        for st in (general, fast):
            st.stager.on = i == 40
        want, got = general.stage(rows), fast.stage(rows)
        assert _equal(want, got) == [], f"step {i}"
        assert fast.disabled == general.disabled, f"step {i}"
        # A refused request in the batch keeps the step on the general path; once it is gone, steady again.
        steady_with_refused += int(fast._fast and bool(fast.disabled & set(rows.req_ids)))
        steady_after += int(i > 40 and fast._fast)
        general.finish(rows, ok)
        fast.finish(rows, ok)
        assert fast.no_drafts == general.no_drafts and fast.stager.totals() == general.stager.totals()
        assert _same_sequences(fast, general), f"step {i}"   # the refused step included
    assert general.fallbacks_by_reason["refused"] > 0 and not general.disabled   # refused, then finished
    assert fast.fallbacks_by_reason == general.fallbacks_by_reason
    assert steady_with_refused == 0 and steady_after > 0   # steady again once the refused request is gone
