"""Shared fixtures: every Stager test runs against the C++ core and the reference twin."""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from dspark_core import Stager, StagerConfig
from dspark_core.reference import ReferenceStager

# CI runs a few more examples than a local run; both are bounded.
settings.register_profile("ci", max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")

STAGERS = {"core": Stager, "reference": ReferenceStager}


@pytest.fixture(autouse=True, scope="session")
def _one_blas_thread():
    """numpy's OpenBLAS on one thread: the tests' products are small, and on a loaded machine
    its worker threads wait for busy cores (tests/test_loop.py: 58 s with two threads, 5 s
    with one, at load 8 on 2 cores)."""
    from dspark_core.sim.blas_threads import single_blas_thread

    with single_blas_thread():
        yield


@pytest.fixture(params=sorted(STAGERS))
def make_stager(request):
    """A factory ``make_stager(config_or_kwargs)`` for the parametrised implementation."""
    cls = STAGERS[request.param]

    def make(config: StagerConfig | None = None, **kw):
        return cls(config if config is not None else StagerConfig(**kw))

    make.kind = request.param
    return make


#: Real LLM hidden states carry a few "massive activation" channels (1e3..1e5;
#: Gemma 3 270M reaches 87,929 on ordinary text, already on the BOS row).
MASSIVE_PEAK = 87_929.0


def massive_rows(rng: np.random.Generator, n: int, dim: int, peak: float = MASSIVE_PEAK) -> np.ndarray:
    """Rows shaped like real activations: N(0, 1) noise, two massive channels
    (1e3 .. ``peak``), row 0 a huge-norm BOS row whose massive channel is ``peak``."""
    x = rng.standard_normal((n, dim)).astype(np.float32)
    if n == 0:
        return x
    ch = rng.choice(dim, size=min(2, dim), replace=False)
    x[:, ch] *= rng.uniform(1e3, 1e4, size=(n, len(ch))).astype(np.float32)
    x[0] *= np.float32(30.0)  # BOS: a huge norm everywhere
    x[0, ch[0]] = np.float32(peak) * np.sign(x[0, ch[0]] or 1.0)
    return x


def feature_rows(positions, dim: int, version: int = 0, dtype=np.float32) -> np.ndarray:
    """Rows whose values identify their position (and a version, to tell re-sent rows apart)."""
    pos = np.asarray(positions, dtype=np.float64)
    rows = pos[:, None] * 1.0 + version * 0.25 + np.arange(dim)[None, :] * 1e-3
    return rows.astype(dtype)


@contextlib.contextmanager
def flipping(buf: np.ndarray, spot: int) -> Iterator[None]:
    """Another thread flips bit 4 of ``buf[spot]`` until the block ends: a caller's buffer
    changing under a call that reads it with the GIL released."""
    stop = threading.Event()

    def flip() -> None:
        while not stop.is_set():
            buf[spot] ^= 0x10
    t = threading.Thread(target=flip)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def at_once(calls, *extra):
    """Run ``target(*args)`` for each ``(target, args)`` of ``calls`` in its own thread, all
    released together (a barrier), then the ``extra`` callables likewise; returns
    ``{index in calls: result}`` once every thread has finished."""
    import threading

    results: dict[int, object] = {}
    barrier = threading.Barrier(len(calls) + len(extra))

    def run(k, target, args):
        barrier.wait()
        results[k] = target(*args)

    def run_extra(fn):
        barrier.wait()
        fn()

    threads = [threading.Thread(target=run, args=(k, t, a)) for k, (t, a) in enumerate(calls)]
    threads += [threading.Thread(target=run_extra, args=(fn,)) for fn in extra]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results
