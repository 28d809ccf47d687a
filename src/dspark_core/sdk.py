"""Where the C/C++ SDK inside the installed package lives.

The wheel ships the core for other build systems, next to its Python
extensions: the public headers (``dspark/*.hpp`` and the C ABI
``dspark/dspark.h``), the shared library ``libdspark_core.so`` (C++17; the
package's extension modules load this same file, so a process holds one copy
of the core) and a CMake package config::

    cmake -DCMAKE_PREFIX_PATH="$(python -c 'import dspark_core; print(dspark_core.get_cmake_dir())')" ...
    # CMakeLists.txt: find_package(dspark_core CONFIG REQUIRED)
    #                 target_link_libraries(app PRIVATE dspark_core::core)

    cc app.c -I"$(python -c 'import dspark_core; print(dspark_core.get_include())')" \\
       -L"$(python -c 'import dspark_core; print(dspark_core.get_library_dir())')" \\
       -ldspark_core -Wl,-rpath,<that folder> -lstdc++ -lm -lpthread

A Cython extension can ``cimport dspark_core._ext._lib_stager`` (or
``_lib_row_format``) with ``get_include()`` on its include path and
``libdspark_core.so`` linked. See docs/c_api.md.
"""

from __future__ import annotations

from pathlib import Path

from ._ext import _stager

__all__ = ["get_cmake_dir", "get_include", "get_library_dir"]


def _install_root() -> Path:
    """The ``dspark_core`` folder the build installed into (where the extensions are).

    Found from a compiled extension rather than this file, so that it is
    right for editable installs too (their Python files stay in the source
    tree, the build's output does not).
    """
    depth = _stager.__name__.count(".")  # dspark_core._ext._stager -> 2
    return Path(_stager.__file__).resolve().parents[depth - 1]


def _existing(path: Path, what: str) -> str:
    if not path.is_dir():
        raise FileNotFoundError(f"the dspark_core {what} is not installed at {path} (a build without the SDK?)")
    return str(path)


def get_include() -> str:
    """The folder to put on the include path: it holds ``dspark/dspark.h`` and ``dspark/*.hpp``."""
    return _existing(_install_root() / "include", "headers")


def get_library_dir() -> str:
    """The folder holding ``libdspark_core.so`` (link with ``-ldspark_core``, this folder as the run path)."""
    return _existing(_install_root() / "lib", "library")


def get_cmake_dir() -> str:
    """The folder holding ``dspark_coreConfig.cmake``: a ``CMAKE_PREFIX_PATH`` (or ``dspark_core_DIR``) entry."""
    return _existing(_install_root() / "lib" / "cmake" / "dspark_core", "CMake package config")
