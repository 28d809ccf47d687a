"""Old module paths (the flat layout's, then the top level's), kept importable with a DeprecationWarning.

``import dspark_core.loop`` (and every other path in :data:`MOVED`) returns the
module at its new path, after a DeprecationWarning that names it. The aliases
are served by a finder instead of shim files, so the old paths hold no code.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types
import warnings
from typing import TYPE_CHECKING, Sequence

#: Old module path -> new module path.
MOVED = {
    "dspark_core.loop": "dspark_core.sim.loop",
    "dspark_core.toy": "dspark_core.sim.toy",
    "dspark_core.drafter_info": "dspark_core.gguf.drafter_info",
    "dspark_core.reference_formats": "dspark_core.reference.formats",
    "dspark_core.fuzz": "dspark_core.testing.fuzz",
    "dspark_core.commands": "dspark_core.cli",
    "dspark_core.commands.simulate": "dspark_core.cli.simulate",
    "dspark_core.commands.inspect": "dspark_core.cli.inspect",
    "dspark_core.commands.fuzz": "dspark_core.cli.fuzz",
    "dspark_core._stager": "dspark_core._ext._stager",
    "dspark_core._row_format": "dspark_core._ext._row_format",
    "dspark_core._cuda": "dspark_core._ext._cuda",
    # Grouped by concept (stager/, rows/, prefix/): the top level keeps the public face.
    "dspark_core.config": "dspark_core.stager.config",
    "dspark_core.core_tables": "dspark_core.stager.core_tables",
    "dspark_core._args": "dspark_core.stager._args",
    "dspark_core.stage_plan": "dspark_core.stager.stage_plan",
    "dspark_core.snapshot_format": "dspark_core.stager.snapshot_format",
    "dspark_core.protocol_mismatch": "dspark_core.stager.protocol_mismatch",
    "dspark_core.stager_copy": "dspark_core.stager.pickling",
    "dspark_core.device_step": "dspark_core.stager.device_step",
    "dspark_core.ring_owner": "dspark_core.rows.ring_owner",
    "dspark_core.host_ring": "dspark_core.rows.host_ring",
    "dspark_core.slot_moves": "dspark_core.rows.slot_moves",
    "dspark_core._bf16": "dspark_core.rows._bf16",
    "dspark_core.prefix_hit": "dspark_core.prefix.hit",
    "dspark_core.prefix_keys": "dspark_core.prefix.keys",
    "dspark_core.prefix_block_format": "dspark_core.prefix.block_format",
    "dspark_core.prefix_table_owner": "dspark_core.prefix.table_owner",
    "dspark_core.host_prefix_table": "dspark_core.prefix.host_table",
}


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} moved to {new}; import it from there", DeprecationWarning, stacklevel=3)


# Plain classes at run time, not importlib.abc's: importing importlib.abc pulls in
# importlib.resources, pathlib, tempfile and inspect (tens of ms at every
# `import dspark_core`); the import system needs only the methods.
if TYPE_CHECKING:
    from importlib.abc import Loader as _LoaderBase
else:
    _LoaderBase = object


class _AliasLoader(_LoaderBase):
    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        _warn(self.old, self.new)
        return importlib.import_module(self.new)

    def exec_module(self, module: types.ModuleType) -> None:
        """The module is the new one, already executed."""

    def get_code(self, fullname: str) -> types.CodeType:
        """``python -m <old path>`` runs the new module as ``__main__``."""
        source = (
            "import runpy, warnings\n"
            f"warnings.warn({self.old!r} ' moved to ' {self.new!r}, DeprecationWarning)\n"
            f"runpy.run_module({self.new!r}, run_name='__main__', alter_sys=True)\n"
        )
        return compile(source, f"<{self.old}>", "exec")

    def is_package(self, fullname: str) -> bool:
        return False


class _AliasFinder:
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        is_pkg = any(k.startswith(fullname + ".") for k in MOVED)
        spec = importlib.machinery.ModuleSpec(fullname, _AliasLoader(fullname, new), is_package=is_pkg)
        if is_pkg:
            spec.submodule_search_locations = []
        return spec


def install() -> None:
    """Serve the old paths (idempotent)."""
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())  # before the path finder: an old package path (dspark_core.commands) must not load its submodules twice
