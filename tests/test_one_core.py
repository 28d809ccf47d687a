"""One copy of the core per process: one dispatch registry, one override.

The extension modules (``_row_format``, ``_stager``, ``_cuda`` where built)
link the shared core in ``dspark_core/lib`` (the SDK's library) instead of a
static copy each, so a path forced from Python is the path every surface runs:
the format conversions, the Stager's conversions and checksums, the CUDA
module's host side, and a C/C++ caller of that library in the same process
(here: ctypes, calling the C++ registry functions of the installed library).
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import dspark_core
from dspark_core import formats, kernels
from dspark_core._ext import _row_format, _stager

PACKAGE = Path(_stager.__file__).resolve().parents[1]
LIBRARY = Path(dspark_core.get_library_dir()) / "libdspark_core.so"
# A string only the registry's implementation holds (csrc/src/dispatch.cpp's
# set_kernel_path): a binary with it has its own registry. (DSPARK_SIMD itself
# is in every binary that reads the public dispatch.hpp's KERNEL_ENV, the
# binding that names the variable to Python included.)
REGISTRY_MARKER = b"dspark: unknown kernel family code "
NEEDED = b"libdspark_core.so\x00"

# The C++ registry of the installed library (dspark/dispatch.hpp), by its mangled names.
_ACTIVE = "_ZN6dspark18active_kernel_pathENS_12KernelFamilyE"
_SET = "_ZN6dspark15set_kernel_pathENS_12KernelFamilyEi"


def _binaries() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*") if p.is_file() and p.suffix in (".so", ".a", ".dylib"))


def _library() -> ctypes.CDLL:
    # The file the extension modules loaded (RUNPATH $ORIGIN/../lib): the loader hands back that copy.
    lib = ctypes.CDLL(str(LIBRARY))
    getattr(lib, _ACTIVE).argtypes = [ctypes.c_uint8]
    getattr(lib, _ACTIVE).restype = ctypes.c_int
    return lib


def _library_paths(lib: ctypes.CDLL) -> dict[str, str]:
    """Each family's active path, as the library's C++ registry reports it."""
    return {f: kernels.paths(f)[getattr(lib, _ACTIVE)(i)] for i, f in enumerate(kernels.FAMILIES)}


def test_exactly_one_binary_of_the_package_holds_the_registry():
    holders = [p.relative_to(PACKAGE).as_posix() for p in _binaries() if REGISTRY_MARKER in p.read_bytes()]
    assert holders == ["lib/libdspark_core.so"], holders


def test_every_extension_module_links_the_shared_core():
    modules = sorted((PACKAGE / "_ext").glob("*.so"))
    names = {m.name.split(".")[0] for m in modules}
    assert {"_row_format", "_stager"} <= names, names
    for m in modules:
        data = m.read_bytes()
        assert NEEDED in data, f"{m.name} does not load libdspark_core.so"
        assert REGISTRY_MARKER not in data, f"{m.name} has its own copy of the registry"


def test_a_switch_from_python_is_the_librarys_and_back():
    lib = _library()
    assert _library_paths(lib) == {f: kernels.active(f) for f in kernels.FAMILIES}
    for family in kernels.FAMILIES:
        f = kernels.FAMILIES.index(family)
        for name in kernels.supported(family):
            with kernels.use(family, name):
                assert _library_paths(lib)[family] == name
        # The other way: a C++ caller's switch is the one Python reports and the formats run.
        before = kernels.active(family)
        try:
            getattr(lib, _SET)(ctypes.c_uint8(f), ctypes.c_int(0))
            assert kernels.active(family) == kernels.paths(family)[0]
            if family == "row_format":
                assert formats.active_simd_path() == "scalar"
        finally:
            kernels.set_path(family, before)
        assert _library_paths(lib)[family] == before


@pytest.mark.parametrize("storage", ["f16", "bf16", "q8_0", "q4_0"])
def test_every_surface_runs_the_forced_path(storage: str):
    # Each path of the shared registry, forced from Python, through the formats module and the
    # Stager (and the CUDA module's host side where it is built): identical bytes on every path,
    # the library reporting the forced path while they ran.
    lib = _library()
    rows = np.random.default_rng(5).standard_normal((24, 128), dtype=np.float32)
    want = formats.quantize_rows(rows, storage).tobytes()
    for name in kernels.supported("row_format"):
        with kernels.use("row_format", name):
            assert _library_paths(lib)["row_format"] == name
            assert formats.quantize_rows(rows, storage).tobytes() == want, name
            st = dspark_core.Stager(dspark_core.StagerConfig(feature_dim=128, block_size=4, window=32,
                                                             storage=storage, max_seqs=1))
            st.process(0, np.arange(24), rows)
            plan = st.draft(0, 24)
            assert plan.encoded_rows.tobytes() == want[-len(plan.encoded_rows.tobytes()):], name
            assert _library_paths(lib)["row_format"] == name


def test_cuda_module_shares_the_registry_where_built():
    try:
        from dspark_core._ext import _cuda
    except ImportError:
        pytest.skip("the _cuda extension is not built")
    data = Path(_cuda.__file__).read_bytes()
    assert NEEDED in data and REGISTRY_MARKER not in data


def test_env_dspark_simd_reaches_every_surface_through_one_read():
    env = dict(os.environ, DSPARK_SIMD="scalar")
    code = textwrap.dedent(f"""
        import ctypes, json
        import dspark_core
        from dspark_core import kernels
        lib = ctypes.CDLL({str(LIBRARY)!r})
        active = getattr(lib, {_ACTIVE!r})
        active.argtypes = [ctypes.c_uint8]
        print(json.dumps({{"python": {{f: kernels.active(f) for f in kernels.FAMILIES}},
                          "library": [active(i) for i in range(len(kernels.FAMILIES))]}}))
    """)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["python"] == {f: kernels.paths(f)[0] for f in kernels.FAMILIES}
    assert out["library"] == [0] * len(kernels.FAMILIES)


def test_row_format_set_simd_path_switches_the_same_registry():
    lib = _library()
    before = kernels.active("row_format")
    try:
        _row_format.set_simd_path("scalar")
        assert kernels.active("row_format") == "scalar" == _library_paths(lib)["row_format"]
    finally:
        kernels.set_path("row_format", before)
