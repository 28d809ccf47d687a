"""What a server hands ``dspark_core.cuda.DeviceStep`` cannot lose a step, hand over the wrong
sequence or reach the kernel misaligned: hand-overs move only the handed sequences' columns
(a step of another sequence launched meanwhile is kept), ids and accept counts are converted
by the Stager's rules (the same exceptions as the CPU twin, the same statuses), and buffers
the kernel would read misaligned or from elsewhere are refused when handed over.
Runs where the CUDA kernels were built (a GPU, or DSPARK_CUDA=EMULATE: CI's rehearsal)."""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable

import numpy as np
import pytest

from dspark_core import Stager, StagerConfig, cuda
from dspark_core.stager.device_step import STEP_BAD_COUNT, STEP_OK

gpu = pytest.mark.skipif(not cuda.available(), reason=f"no CUDA device: {cuda.unavailable_reason()}")

#: The sequence stepped on the device while another one is handed over and back.
STEPPED = 0
#: The sequence handed over and back meanwhile.
HANDED = 1
#: Steps of STEPPED in the two-thread test (each equal to the twin's; many hand-overs of HANDED
#: interleave with them, every one of which lost a step now and then before).
THREAD_STEPS = 600
#: How often the interpreter switches threads in the two-thread test (seconds): often, so that
#: launches fall between a hand-over's copies.
SWITCH_INTERVAL = 1e-6


def config(n: int = 4, b: int = 3, w: int = 13) -> StagerConfig:
    return StagerConfig(feature_dim=32, block_size=b, window=w, max_seqs=n, storage="q8_0", rows="external")


def twins(n: int = 4) -> tuple[Stager, Stager]:
    """Two Stagers with the same started sequences: the CPU twin's and the device step's."""
    cpu, dev = Stager(config(n)), Stager(config(n))
    for q in range(n):
        for st in (cpu, dev):
            st.begin(q)
            st.process(q, np.arange(q, q + 7 + 2 * q))
    return cpu, dev


def same(x: Any, y: Any) -> None:
    for name in x.__dataclass_fields__:
        np.testing.assert_array_equal(getattr(x, name), getattr(y, name), err_msg=name)


def same_sequence(cpu: Stager, dev: Stager, q: int) -> None:
    assert dev.state(q) == cpu.state(q)
    assert dev.stats(q) == cpu.stats(q)
    np.testing.assert_array_equal(dev.accepted(q), cpu.accepted(q))


class SteppingStager:
    """A Stager whose ``to_device`` / ``to_host`` first run ``before()``: a step another
    thread launches while a hand-over is under way, at the one moment that matters."""

    def __init__(self, stager: Stager, before: Callable[[], None]) -> None:
        self._stager, self._before = stager, before

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stager, name)

    def to_device(self, *args: Any, **kw: Any) -> Any:
        self._before()
        return self._stager.to_device(*args, **kw)

    def to_host(self, *args: Any, **kw: Any) -> Any:
        self._before()
        return self._stager.to_host(*args, **kw)


@gpu
def test_a_step_launched_during_a_hand_over_is_kept():
    """A step of another sequence launched while one is handed over (to_device) or back
    (to_host) stays done: its sequence comes back as the twin that took the same steps."""
    cpu, dev = twins()
    rng = np.random.default_rng(11)
    step: Any = None

    def step_stepped() -> None:
        c = [int(rng.integers(0, 4))]
        step.set_batch([STEPPED], c)
        step.launch()
        out = step.outputs()
        same(out, cpu.step_many([STEPPED], c))
        assert out.status[0] == STEP_OK

    step = cuda.DeviceStep(SteppingStager(dev, lambda: None), capacity=2)
    cpu.to_device([STEPPED])
    step.to_device([STEPPED])
    step.stager = SteppingStager(dev, step_stepped)
    for _ in range(5):
        cpu.to_device([HANDED])
        step.to_device([HANDED])  # a step of STEPPED runs between this call's copies
        assert dev.on_device(HANDED)
        np.testing.assert_array_equal(cpu.to_host([HANDED]), step.to_host([HANDED]))  # and here
        same_sequence(cpu, dev, HANDED)
    step_stepped()  # (each step above was checked against the twin: a lost one shows in the next)
    step.stager = dev
    cpu.to_host([STEPPED])
    step.to_host([STEPPED])
    same_sequence(cpu, dev, STEPPED)


@gpu
def test_two_threads_lose_no_step():
    """One thread steps a sequence on the device in a loop while another hands a second one
    over and back: every step of the first equals the twin's, and it comes back having taken
    all of them."""
    cpu, dev = twins()
    step = cuda.DeviceStep(dev, capacity=2)
    for st in (cpu, step):
        st.to_device([STEPPED])
    counts = np.random.default_rng(12).integers(0, 4, THREAD_STEPS).tolist()
    handing_started, done = threading.Event(), threading.Event()
    errors: list[BaseException] = []
    hand_overs = [0]

    def stepping() -> None:
        try:
            handing_started.wait()  # the steps begin while the hand-overs go on
            for c in counts:
                step.set_batch([STEPPED], [c])
                step.launch()
                same(step.outputs(), cpu.step_many([STEPPED], [c]))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
        finally:
            done.set()

    def handing() -> None:
        try:
            while not done.is_set():
                step.to_device([HANDED])
                step.to_host([HANDED])
                hand_overs[0] += 1
                handing_started.set()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            handing_started.set()

    old = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL)
    try:
        threads = [threading.Thread(target=stepping), threading.Thread(target=handing)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    if errors:
        raise errors[0]
    assert hand_overs[0] > 0
    cpu.to_host([STEPPED])
    step.to_host([STEPPED])
    assert dev.stats(STEPPED)["verified_rounds"] == cpu.stats(STEPPED)["verified_rounds"] > 0
    same_sequence(cpu, dev, STEPPED)
    for _ in range(hand_overs[0]):  # what a hand-over without steps does, the twin's way
        cpu.to_device([HANDED])
        cpu.to_host([HANDED])
    same_sequence(cpu, dev, HANDED)


def refusal(fn: Callable[[], Any]) -> tuple[type, str]:
    with pytest.raises(Exception) as info:
        fn()
    return info.type, str(info.value)


#: Sequence ids no hand-over may take: not integers, unknown, beyond int64, not 1-D.
BAD_IDS = [[0.9], [1.5], [4], [-1], [2**70], [[0]], [HANDED, 0.5]]


@gpu
@pytest.mark.parametrize("seqs", BAD_IDS, ids=repr)
def test_hand_overs_refuse_the_ids_the_stager_refuses(seqs):
    """to_device / to_host raise what the Stager's own calls raise (type and message) and
    change nothing: no sequence handed over or back, the device copy of the state as it was."""
    cpu, dev = twins()
    step = cuda.DeviceStep(dev, capacity=2)
    for st in (cpu, step):
        st.to_device([HANDED])
    before = dev.step_state.copy()
    device_before = cuda._cuda.copy_to_host(step._state.ptr, before.nbytes)
    assert refusal(lambda: step.to_device(seqs)) == refusal(lambda: cpu.to_device(seqs))
    assert refusal(lambda: step.to_host(seqs)) == refusal(lambda: cpu.to_host(seqs))
    assert [dev.on_device(q) for q in range(4)] == [cpu.on_device(q) for q in range(4)] == [False, True, False, False]
    np.testing.assert_array_equal(dev.step_state, before)
    assert cuda._cuda.copy_to_host(step._state.ptr, before.nbytes) == device_before


@gpu
@pytest.mark.parametrize("seqs", [[0.9], [[0]]], ids=repr)
def test_a_batch_takes_the_ids_the_twin_takes(seqs):
    """set_batch refuses what step_many refuses, with the same exception type."""
    cpu, dev = twins()
    step = cuda.DeviceStep(dev, capacity=2)
    want, _ = refusal(lambda: cpu.step_many(seqs, [0]))
    got, msg = refusal(lambda: step.set_batch(seqs, [0]))
    assert got is want and "seqs" in msg
    assert step.n == 0


#: Accept counts outside int32 (and int64): each a bad count for the twin.
WIDE_COUNTS = [2**32 + 1, 2**31, -(2**31) - 1, -(2**32) - 1, 2**70, -(2**70)]


@gpu
@pytest.mark.parametrize("width", [np.int32, np.int64])
def test_counts_outside_the_count_type_step_as_the_twins(width):
    """Counts the device buffer's type cannot hold step as the CPU twin steps them
    (STEP_BAD_COUNT), from a list or an int64 array, never wrapped into a valid count;
    non-integers raise the twin's exception type."""
    cpu, dev = twins()
    step = cuda.DeviceStep(dev, capacity=2)
    sampler = cuda.DeviceArray.from_numpy(np.zeros(2, np.int64), stream=0)  # alive while the step reads it
    if width is np.int64:  # the sampler's own int64 buffer; int32: the step's own
        step.read_counts_from(sampler)
    for st in (cpu, step):
        st.to_device([STEPPED, HANDED])
    seqs = [STEPPED, HANDED]
    for c in WIDE_COUNTS:
        for given in ([c, 1], np.array([c, 1], np.int64) if abs(c) < 2**63 else None):
            if given is None:
                continue
            step.set_batch(seqs, given)
            step.launch()
            out, want = step.outputs(), cpu.step_many(seqs, [c, 1])
            same(out, want)
            assert out.status[0] == STEP_BAD_COUNT, c
    want_type, _ = refusal(lambda: cpu.step_many(seqs, [1.5, 1]))
    got, msg = refusal(lambda: step.set_counts([1.5, 1]))
    assert got is want_type and "n_accepted" in msg


class Pointer:
    """A device buffer seen through the CUDA array interface at ``ptr`` (any alignment)."""

    def __init__(self, ptr: int, n: int, typestr: str) -> None:
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": typestr, "data": (ptr, False), "version": 3,
                                         "strides": None, "stream": None}


@gpu
@pytest.mark.parametrize("width", [np.int32, np.int64])
def test_misaligned_or_foreign_count_buffers_are_refused(width):
    """read_counts_from refuses a pointer the kernel would read misaligned, host memory and
    another device's memory (ValueError), and keeps reading its counts where it did."""
    cpu, dev = twins()
    step = cuda.DeviceStep(dev, capacity=2)
    buf = cuda.DeviceArray.from_numpy(np.zeros(8, np.int64), stream=0)
    size = np.dtype(width).itemsize
    before = step.counts_ptr
    for off in range(1, size):
        with pytest.raises(ValueError, match="aligned"):
            step.read_counts_from(buf.ptr + off, width)
    host = np.zeros(4, width)
    with pytest.raises(ValueError, match="device memory"):
        step.read_counts_from(host.ctypes.data, width)
    if cuda._cuda.device_count() > 1:
        other = cuda.DeviceArray.from_numpy(np.zeros(4, width), device=1, stream=0)
        with pytest.raises(ValueError, match="device 1"):
            step.read_counts_from(other)
    assert step.counts_ptr == before and step.counts_dtype == np.dtype(np.int32)
    step.read_counts_from(buf.ptr + size, width)  # aligned: taken
    assert step.counts_ptr == buf.ptr + size


@gpu
def test_a_misaligned_token_table_is_refused():
    """A chain drafter's slot token table the server's int32 reads and writes would meet
    misaligned is refused (ValueError) before anything is handed over."""
    cfg = config().replace(kind="chain")
    dev = Stager(cfg)
    dev.begin(0)
    dev.process(0, np.arange(9), tokens=np.arange(9, dtype=np.int32))
    step = cuda.DeviceStep(dev, capacity=1)
    n = dev.new_token_table().size
    raw = cuda.DeviceArray.from_numpy(np.zeros(n + 1, np.int32), stream=0)
    with pytest.raises(ValueError, match="aligned"):
        step.to_device([0], tokens=Pointer(raw.ptr + 2, n, "<i4"))
    assert not dev.on_device(0)
