"""Adapters to real target engines (optional; each imports its engine lazily).

* :mod:`dspark_core.engines.llama_cpp`: capture a llama.cpp target's hidden
  states through llama-cpp-python (``pip install 'dspark_core[llama-cpp]'``).

Importing :mod:`dspark_core` or this package never imports an engine.
"""

from __future__ import annotations

__all__: list[str] = []
