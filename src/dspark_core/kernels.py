"""Runtime kernel dispatch: which instruction-set path each kernel family runs.

The core picks, per process and per kernel family, the fastest path this CPU
supports (x86-64: AVX2 / AVX-512 / SSE4.2; aarch64: NEON / NEON with BF16 /
the ARMv8 CRC32C instructions), with a portable path always there. Every path
of a family gives identical bytes, so a switch changes only speed. Families
and path names come from the core's registry (``dspark/dispatch.hpp``):

* ``"row_format"``: the row-format conversions (``dspark_core.formats``);
  paths ``scalar``, ``avx2``, ``avx512``, ``neon``, ``neon-bf16``;
* ``"crc32c"``: the CRC-32C of snapshots; paths ``portable``, ``sse4.2``,
  ``armv8-crc``.

``DSPARK_SIMD`` forces paths when a process starts: a comma-separated list of
path names, each naming one family's path (``DSPARK_SIMD=avx2``,
``DSPARK_SIMD=neon,portable``); ``scalar`` names every family's portable path.
A name that is unknown, or a path this CPU lacks, is ignored with a
``RuntimeWarning`` at import. ``DSPARK_CRC32C=<crc32c path>`` still works and
warns that it is deprecated (a ``FutureWarning``; use ``DSPARK_SIMD``).

From Python, :func:`set_path` / :func:`use` switch a family process-wide;
``dspark-core kernels`` prints this machine's dispatch table.

There is one registry per process: this package's extension modules
(``_row_format``, ``_stager``, ``_cuda``) share one copy of the core, the
shared library ``dspark_core/lib/libdspark_core.so`` that the C/C++ SDK's users
link too. A switch here is a switch for the format conversions, the Stager's
conversions and snapshot checksums, the CUDA module's host side and a C or C++
caller of that library in the same process alike.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Iterator

from ._ext import _row_format as _core

__all__ = ["ENV", "FAMILIES", "paths", "supported", "best", "active", "set_path", "use", "dispatch_table"]

#: The environment variable that forces paths.
ENV: str = _core.KERNEL_ENV

#: Kernel families, in the core's order.
FAMILIES: tuple[str, ...] = tuple(_core.KERNEL_FAMILIES)


def _as_str(what: str, value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, got {type(value).__name__}")
    return value


def paths(family: str) -> tuple[str, ...]:
    """Every path name of ``family``, the portable one first (other CPUs' paths included)."""
    return tuple(_core.kernel_paths(_as_str("family", family)))


def supported(family: str) -> list[str]:
    """The paths of ``family`` this CPU and build run, the portable one first."""
    return list(_core.kernel_supported(_as_str("family", family)))


def best(family: str) -> str:
    """The fastest supported path of ``family`` (its default unless ``DSPARK_SIMD`` names another)."""
    return str(_core.kernel_best(_as_str("family", family)))


def active(family: str) -> str:
    """The path ``family`` runs now."""
    return str(_core.kernel_active(_as_str("family", family)))


def set_path(family: str, name: str) -> None:
    """Make ``name`` the path of ``family``, process-wide.

    ``ValueError`` for an unknown family or name, or a path this CPU / build
    does not support (nothing changes then).
    """
    _core.kernel_set(_as_str("family", family), _as_str("name", name))


@contextlib.contextmanager
def use(family: str, name: str) -> Iterator[str]:
    """Run the body with ``family`` on path ``name``, then restore the previous path.

    Process-wide, so not for use from several threads at once (tests, benchmarks).
    """
    saved = active(family)
    set_path(family, name)
    try:
        yield name
    finally:
        set_path(family, saved)


def dispatch_table() -> dict[str, dict[str, str]]:
    """For each family, each kernel and the path whose code runs it now.

    A path may borrow another's kernel (the AVX-512 path decodes with the AVX2
    kernels; NEON-BF16 differs from NEON only in f32 -> bf16).
    """
    return {family: dict(_core.kernel_table(family)) for family in FAMILIES}


def _warn_about_env() -> None:
    """The core does not log: a DSPARK_SIMD it ignored (in part), or the
    deprecated DSPARK_CRC32C, is reported once, at import."""
    status = _core.kernel_env_status()
    if status in ("unknown", "unsupported"):
        value = os.environ.get(ENV, "")
        why = "names no kernel path" if status == "unknown" else "names a path this CPU / build does not support"
        valid = ", ".join(name for family in FAMILIES for name in paths(family))
        here = "; ".join(f"{family}: {', '.join(supported(family))}" for family in FAMILIES)
        using = ", ".join(f"{family}={active(family)}" for family in FAMILIES)
        warnings.warn(
            f"{ENV}={value!r} {why}; valid values: {valid} (supported here: {here}); using {using}",
            RuntimeWarning,
            stacklevel=3,
        )
    if _core.kernel_env_deprecated():
        old = _core.KERNEL_ENV_DEPRECATED
        warnings.warn(
            f"{old} is deprecated: {ENV} names CRC-32C paths too ({ENV}={os.environ.get(old, '')}); "
            f"the crc32c path is {active('crc32c')!r}",
            FutureWarning,
            stacklevel=3,
        )


_warn_about_env()
