# cython: language_level=3
# distutils: language = c++
"""Another Cython extension using dspark_core's C++ core through its .pxd files.

Build it against the installed wheel (.ci/sdk_check.sh does):
  cython --cplus cimport_check.pyx
  c++ -std=c++17 -shared -fPIC cimport_check.cpp -I<Python include> \
      -I"$(python -c 'import dspark_core; print(dspark_core.get_include())')" \
      -L"$LIB" -ldspark_core -Wl,-rpath,"$LIB" -o cimport_check$(python3-config --extension-suffix)
  (LIB=$(python -c 'import dspark_core; print(dspark_core.get_library_dir())'): the package's own
  libdspark_core.so, so this extension shares the package's core and its dispatch registry)
"""
from libc.stdint cimport int64_t

from dspark_core._ext._lib_row_format cimport Storage, dspark_set_error_types, row_bytes
from dspark_core._ext._lib_stager cimport Stager, StagerOptions

from dspark_core.errors import ConfigError, StateError

# The exception translator is header-only: register the Python classes in
# this extension too, or C++ ConfigError surfaces as a plain ValueError.
dspark_set_error_types(ConfigError, StateError)


def stager_geometry(int64_t dim, int64_t block, int64_t window):
    """``(w_keep, row_bytes)`` of a q4_0 Stager built by the C++ core directly."""
    cdef StagerOptions o
    o.feature_dim = dim
    o.block_size = block
    o.window = window
    o.storage = Storage.Q4_0
    cdef Stager* s = new Stager(o)
    try:
        return s.w_keep(), s.row_bytes()
    finally:
        del s


def q4_0_row_bytes(size_t dim):
    return row_bytes(Storage.Q4_0, dim)
