"""The CSR rows of the device step on the CUDA device (``cuda.DeviceStep(..., rows="csr")``):
captured once into a CUDA graph with the step and replayed over batches whose size changes
(padding entries past them and inside them, entries not in the step), the device's CSR rows
equal the CPU twin's ``step_rows`` of the same step and the padded layout's rows, with and
without the padded arrays; the raw call's argument errors. Runs where the CUDA kernels were
built (a GPU, or DSPARK_CUDA=EMULATE)."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_core import Stager, cuda
from dspark_core.stager.device_step import PADDING_ID, STEP_OK, STEP_REBASE, StepOutputs, StepRows
from test_device_step_rows import make as make_stager, padded_rows

gpu = pytest.mark.skipif(not cuda.available(), reason=f"no CUDA device: {cuda.unavailable_reason()}")


def make(n: int, b: int, w: int, seed: int) -> Stager:
    return make_stager(Stager, n, b, w, seed)


def same_rows(x: StepRows, y: StepRows) -> None:
    np.testing.assert_array_equal(x.row_offsets, y.row_offsets)
    t = x.total
    np.testing.assert_array_equal(x.row_slots[:t], y.row_slots[:t])
    np.testing.assert_array_equal(x.row_positions[:t], y.row_positions[:t])


@gpu
@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("n,b,w,cap,seed", [(6, 3, 11, 8, 1), (40, 2, 9, 40, 2)])
def test_captured_csr_rows_equal_the_cpu_twin_over_changing_batches(padded, n, b, w, cap, seed):
    cu = cuda._cuda
    cpu, dev = make(n, b, w, seed), make(n, b, w, seed)
    max_rows = cpu.step_layout[1]
    seqs_all = list(range(n))
    cpu.to_device(seqs_all)
    step = cuda.DeviceStep(dev, capacity=cap, padded=padded, rows="csr")
    step.to_device(seqs_all)
    step.set_batch([], pad=True)
    stream = cu.Stream(0)
    cu.capture_begin(stream.handle)
    try:
        step.launch(stream.handle)
    finally:
        graph = cu.capture_end(stream.handle)  # fails had the CSR pass synchronized, allocated or copied
    emulated = cu.emulated_launches() >= 0
    rng = np.random.default_rng(seed)
    out = StepOutputs.empty(cap, max_rows, b)
    rows = StepRows.empty(cap, max_rows)
    seen = {"rebase": 0, "rows": 0, "skip": 0}
    for _ in range(60):
        k = int(rng.integers(0, min(n, cap) + 1))
        seqs = [int(q) for q in rng.permutation(n)[:k]]
        counts = [int(rng.integers(-1, b + 1)) if rng.random() < 0.15 else int(rng.integers(0, b + 1)) for _ in seqs]
        if seqs and len(seqs) < cap and rng.random() < 0.3:
            at = int(rng.integers(0, len(seqs) + 1))
            seqs[at:at], counts[at:at] = [PADDING_ID], [-1]
        step.set_batch(seqs, counts, pad=True)
        before = cu.emulated_launches()
        graph.launch(stream.handle)
        cu.synchronize(stream.handle)
        if emulated:
            assert cu.emulated_launches() - before == 3  # the step, the offsets' scan, the rows
        cpu.step_many(seqs, counts, out=out)
        cpu.step_rows(seqs, out, rows)
        got = step.csr_rows()
        same_rows(got, rows)
        offsets, slots, pos = padded_rows(out, len(seqs))
        np.testing.assert_array_equal(got.row_offsets[:len(seqs) + 1], offsets)
        np.testing.assert_array_equal(got.row_slots[:got.total], slots)
        np.testing.assert_array_equal(got.row_positions[:got.total], pos)
        dev_out = step.outputs()
        assert (dev_out.row_slots is None) == (not padded)
        np.testing.assert_array_equal(dev_out.n_rows[:len(seqs)], out.n_rows[:len(seqs)])
        ok = out.status[:len(seqs)] == STEP_OK
        seen["rebase"] += int(((out.flags[:len(seqs)] & STEP_REBASE) != 0).sum())
        seen["skip"] += int((ok & (out.skip[:len(seqs)] != 0)).sum())
        seen["rows"] += rows.total
    assert seen["rebase"] and seen["rows"], seen
    step.to_host(seqs_all)
    cpu.to_host(seqs_all)
    for q in seqs_all:
        assert cpu.state(q) == dev.state(q)


@gpu
def test_csr_rows_arguments():
    n, b, w = 3, 2, 9
    st = make(n, b, w, 0)
    with pytest.raises(ValueError, match='rows must be None or "csr"'):
        cuda.DeviceStep(st, capacity=n, rows="padded")
    step = cuda.DeviceStep(st, capacity=n)
    with pytest.raises(ValueError, match="no CSR rows"):
        step.csr_rows()
    cu = cuda._cuda
    c = step._config
    offsets = cuda.DeviceArray.from_numpy(np.zeros(n + 1, np.int64), stream=0)
    outs = tuple(int(step._out[name][0].ptr) for name in cu.STEP_OUTPUT_KEYS)
    with pytest.raises(ValueError, match="rows for 2 entries, a batch of 3"):
        cu.device_step_rows(c, step._state.ptr, step._seqs.ptr, 3, outs, 2, offsets.ptr, 0, 0, 0)
    host = np.zeros(n + 1, np.int64)
    with pytest.raises(ValueError, match="row offset array"):
        cu.device_step_rows(c, step._state.ptr, step._seqs.ptr, 3, outs, 3, host.ctypes.data, 0, 0, 0)
    with pytest.raises(ValueError, match="n_rows array"):
        cu.device_step_rows(c, step._state.ptr, step._seqs.ptr, 3, tuple(0 if k == "n_rows" else p for k, p in
                                                                         zip(cu.STEP_OUTPUT_KEYS, outs)),
                            3, offsets.ptr, 0, 0, 0)
    np.testing.assert_array_equal(offsets.get(), np.zeros(n + 1, np.int64))
