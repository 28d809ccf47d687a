"""Run numpy's OpenBLAS on one thread while a simulation runs.

The toy models multiply skinny matrices (a block of ``B`` query rows against up
to a few tens of thousands of keys). OpenBLAS splits every such product over all
cores, and on a loaded machine its worker threads wait for cores that other
processes hold: on 2 cores at load 8, ``q @ k.T`` for ``(8, 32) x (32, 24000)``
float64 took 174 ms with two threads and 6 ms with one. One thread is also what
a memory-bound product this small needs.

:func:`single_blas_thread` finds the OpenBLAS library numpy loaded (bundled
``scipy_openblas`` in numpy's wheels, or a system ``libopenblas``) and sets its
thread count through its own C API for the duration of a ``with`` block; it does
nothing where there is no OpenBLAS (MKL, Accelerate). ``threadpoolctl`` does the
same for every BLAS; this is the part ``dspark-core simulate`` needs, without
the dependency.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
from typing import Iterator

__all__ = ["single_blas_thread", "openblas_libraries"]

#: ``<prefix>_set_num_threads<suffix>``: numpy >= 2 bundles scipy-openblas with
#: 64-bit integers (``scipy_openblas_set_num_threads64_``); older wheels and
#: system builds export ``openblas_set_num_threads`` (``64_`` for ILP64).
_PREFIXES = ("scipy_openblas", "openblas")
_SUFFIXES = ("64_", "")


def _loaded_paths() -> list[str]:
    """Paths of the shared libraries this process mapped whose name says OpenBLAS (Linux)."""
    out: list[str] = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6:
                    path = fields[5].strip()
                    if "openblas" in os.path.basename(path).lower() and path not in out:
                        out.append(path)
    except OSError:
        pass
    return out


def _bundled_paths() -> list[str]:
    """OpenBLAS libraries shipped inside numpy's wheel (macOS, Windows, or no /proc)."""
    import numpy

    root = os.path.dirname(os.path.dirname(numpy.__file__))
    pats = ("numpy.libs/*openblas*", "numpy/.dylibs/*openblas*")
    return sorted({p for pat in pats for p in glob.glob(os.path.join(root, pat))})


def openblas_libraries() -> list[tuple[ctypes.CDLL, str, str]]:
    """``(library, set_name, get_name)`` for each loaded OpenBLAS with a thread-count API."""
    import numpy  # noqa: F401  (loads its BLAS, so /proc/self/maps lists it)

    found = []
    for path in _loaded_paths() or _bundled_paths():
        try:
            lib = ctypes.CDLL(path)  # already loaded by numpy: the same library, not a second copy
        except OSError:
            continue
        for prefix in _PREFIXES:
            for suffix in _SUFFIXES:
                setter, getter = f"{prefix}_set_num_threads{suffix}", f"{prefix}_get_num_threads{suffix}"
                if hasattr(lib, setter) and hasattr(lib, getter):
                    found.append((lib, setter, getter))
                    break
            else:
                continue
            break
    return found


@contextlib.contextmanager
def single_blas_thread() -> Iterator[int]:
    """Run the ``with`` block with OpenBLAS on one thread; restore the previous count after.

    Yields the number of OpenBLAS libraries it limited (0: none found, nothing changed).
    """
    libs = openblas_libraries()
    before = []
    for lib, setter, getter in libs:
        before.append(int(getattr(lib, getter)()))
        getattr(lib, setter)(1)
    try:
        yield len(libs)
    finally:
        for (lib, setter, _), n in zip(libs, before):
            getattr(lib, setter)(n)
