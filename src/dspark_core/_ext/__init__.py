"""The Cython bindings of the C++ core: ``_row_format``, ``_stager`` and, when built, ``_cuda``."""
