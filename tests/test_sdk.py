"""The C/C++ SDK inside the installed package: headers, library, CMake package, C ABI.

The package must carry exactly the core's public headers (those of this
checkout), the shared library and a CMake package of its own version; a C
program built against those paths alone (examples/sdk/window_loop_c.c, through the
C ABI dspark/dspark.h) must print what the Python API prints for the same
window loop and q4_0 round trip (examples/sdk/window_loop.py, which checks itself
against the hand-worked plan table and gguf-py). .ci/sdk_check.sh runs the
same against a repaired manylinux wheel, plus the C++ / CMake and Cython paths.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import dspark_core

ROOT = Path(__file__).resolve().parents[1]
PUBLIC_HEADERS = sorted(p.name for p in (ROOT / "csrc" / "include" / "dspark").iterdir())


def test_headers_are_the_public_ones_of_this_checkout():
    inc = Path(dspark_core.get_include())
    installed = sorted(p.name for p in (inc / "dspark").iterdir())
    assert installed == PUBLIC_HEADERS
    assert "dspark.h" in installed and "stager.hpp" in installed
    for name in installed:
        assert (inc / "dspark" / name).read_bytes() == (ROOT / "csrc" / "include" / "dspark" / name).read_bytes(), name
    # The binding's header, for Cython users of the .pxd files.
    assert (inc / "_errors.hpp").is_file()


def test_library_and_cmake_package_match_the_package_version():
    # The shared core: the one copy the extension modules load too (tests/test_one_core.py).
    assert (Path(dspark_core.get_library_dir()) / "libdspark_core.so").is_file()
    cmake_dir = Path(dspark_core.get_cmake_dir())
    for name in ("dspark_coreConfig.cmake", "dspark_coreConfigVersion.cmake", "dspark_coreTargets.cmake"):
        assert (cmake_dir / name).is_file(), name
    version = re.search(r'set\(PACKAGE_VERSION "([^"]+)"\)', (cmake_dir / "dspark_coreConfigVersion.cmake").read_text())
    assert version is not None and version.group(1) == dspark_core.__version__
    assert "dspark_core::core" in (cmake_dir / "dspark_coreTargets.cmake").read_text()


def test_pxd_files_are_in_the_package():
    # Where Cython's cimport looks (the package folder on sys.path, for a wheel install).
    ext = Path(dspark_core.__file__).parent / "_ext"
    assert (ext / "_lib_stager.pxd").is_file() and (ext / "_lib_row_format.pxd").is_file()


def _interface_link_options() -> list[str]:
    """The library's link usage requirements from its CMake package (a sanitizer build adds -fsanitize=...)."""
    targets = (Path(dspark_core.get_cmake_dir()) / "dspark_coreTargets.cmake").read_text()
    found = re.search(r'INTERFACE_LINK_OPTIONS "([^"]*)"', targets)
    return [opt for opt in found.group(1).split(";") if opt] if found else []


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")
def test_c_program_through_the_c_abi_prints_what_python_prints(tmp_path):
    exe = tmp_path / "window_loop_c"
    build = subprocess.run(
        ["cc", "-std=c99", "-O1", "-Wall", "-Wextra", "-Wpedantic", "-Werror", str(ROOT / "examples/sdk/window_loop_c.c"),
         f"-I{dspark_core.get_include()}", f"-L{dspark_core.get_library_dir()}",
         "-ldspark_core", f"-Wl,-rpath,{dspark_core.get_library_dir()}", "-lstdc++", "-lm", "-lpthread",
         *_interface_link_options(), "-o", str(exe)],
        capture_output=True, text=True,
    )
    assert build.returncode == 0, build.stderr
    c_out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    py_out = subprocess.run([sys.executable, str(ROOT / "examples/sdk/window_loop.py")], check=True, capture_output=True,
                            text=True).stdout
    assert c_out == py_out
    assert c_out.count("\n") == 22 and "loop q4_0 stats rounds=8 commits=8 rebases=4" in c_out
    # DEMO_ACCEPTS (7 3 0 7 5 1 4, block 7): each accept verified its round.
    assert "loop q4_0 accepted 1 1 0 1 1 1 0 2 verified_rounds=7" in c_out
