"""The package's layers and its import graph (``python tests/layering.py`` prints it).

Each module of ``src/dspark_core`` belongs to one layer; a module imports
only modules of its own or a lower layer, lazy (function-level) imports
included. Layers, bottom up:

0 base       errors, _version, _bf16 (bfloat16, loaded when first used): no import from the package
1 binding    _ext._row_format: the C++ row formats and the core's name tables and limits
2 contract   core_tables, _args, config, stage_plan, slot_moves, snapshot_format,
             protocol_mismatch, stager_copy, device_step: the tables, the binding's argument
             conversions, the value types the Stager binding takes and returns, how a
             protocol mismatch is logged, and how a Stager is pickled (config plus snapshots)
3 binding    _ext._stager, _ext._cuda: the C++ Stager and CUDA conversions
4 api        formats, kernels, cuda, gguf, context_plan, ring_owner, host_ring, prefix_table_owner,
             host_prefix_table: the Python API over the core
5 reference  reference: the pure-Python twin (test oracle)
6 tools      testing, sim, engines: differential runner, fuzzing, the loop, toy models,
             real-engine adapters (optional engines, imported lazily)
7 cli        cli: commands and all table / text presentation
8 root       the package's ``__init__`` (the embedding API)

``_old_paths`` (the deprecated-path finder) imports modules by name only.
"""

from __future__ import annotations

import ast
import pathlib
import re
import sys

PACKAGE = "dspark_core"
ROOT = pathlib.Path(__file__).resolve().parents[1] / "src" / PACKAGE

#: Module (or subpackage) -> layer. A module not listed inherits its subpackage's layer.
LAYERS: dict[str, int] = {
    "errors": 0,
    "_args": 2,
    "_old_paths": 0,
    "_version": 0,
    "_bf16": 0,
    "_ext": 1,
    "_ext._row_format": 1,
    "core_tables": 2,
    "config": 2,
    "stage_plan": 2,
    "device_step": 2,
    "slot_moves": 2,
    "prefix_keys": 0,
    "prefix_hit": 2,
    "prefix_block_format": 2,
    "snapshot_format": 2,
    "protocol_mismatch": 2,
    "stager_copy": 2,
    "_ext._stager": 3,
    "_ext._cuda": 3,
    "formats": 4,
    "kernels": 4,
    "cuda": 4,
    "ring_owner": 4,
    "host_ring": 4,
    "prefix_table_owner": 4,
    "host_prefix_table": 4,
    "gguf": 4,
    "context_plan": 4,
    "sdk": 4,
    "reference": 5,
    "testing": 6,
    "sim": 6,
    "engines": 6,
    "cli": 7,
    "": 8,
}
LAYER_NAMES = ("base", "binding", "contract", "binding", "api", "reference", "tools", "cli", "root")

_PYX_IMPORT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+c?import\s+([\w, ()*]+)|c?import\s+([\w.]+))", re.M)


def module_name(path: pathlib.Path) -> str:
    """``dspark_core``-relative dotted name of a source file ("" for the package root)."""
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(parts)


def layer_of(module: str) -> int:
    parts = module.split(".") if module else []
    while parts:
        key = ".".join(parts)
        if key in LAYERS:
            return LAYERS[key]
        parts.pop()
    return LAYERS[""]


def _resolve(module: str, is_pkg: bool, level: int, target: str | None) -> str:
    """Absolute ``dspark_core``-relative name of a relative import."""
    base = module.split(".") if module else []
    if not is_pkg:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, *(target.split(".") if target else [])])


def _internal(name: str, imported: list[str]) -> list[str]:
    """Package modules named by ``from <name> import <imported>`` (submodules when they are ones)."""
    out = []
    for item in imported or [""]:
        cand = f"{name}.{item}" if name and item else (name or item)
        out.append(cand if cand and _exists(cand) else name)
    return out


def _exists(module: str) -> bool:
    p = ROOT.joinpath(*module.split("."))
    return p.is_dir() or any(p.with_suffix(s).exists() for s in (".py", ".pyx"))


def imports_of(path: pathlib.Path) -> set[str]:
    """Package modules ``path`` imports (lazy imports included)."""
    module = module_name(path)
    is_pkg = path.stem == "__init__"
    found: set[str] = set()
    prefix = PACKAGE + "."
    if path.suffix == ".pyx":
        for m in _PYX_IMPORT.finditer(path.read_text()):
            name = m.group(1) or m.group(3)
            if name == PACKAGE or name.startswith(prefix):
                rel = name[len(prefix):] if name != PACKAGE else ""
                items = [s.strip(" ()") for s in (m.group(2) or "").split(",")]
                found.update(_internal(rel, [i.split(" as ")[0] for i in items if i]))
        return found
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                rel = _resolve(module, is_pkg, node.level, node.module)
            elif node.module and (node.module == PACKAGE or node.module.startswith(prefix)):
                rel = node.module[len(prefix):] if node.module != PACKAGE else ""
            else:
                continue
            found.update(_internal(rel, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith(prefix):
                    found.add(a.name[len(prefix):])
    found.discard(module)
    return found


def graph() -> dict[str, set[str]]:
    files = sorted(p for p in ROOT.rglob("*") if p.suffix in (".py", ".pyx") and "__pycache__" not in p.parts)
    return {module_name(p): imports_of(p) for p in files}


def violations(g: dict[str, set[str]] | None = None) -> list[str]:
    """Edges from a module to a higher layer."""
    g = graph() if g is None else g
    return [
        f"{m or PACKAGE} (layer {layer_of(m)}) imports {t or PACKAGE} (layer {layer_of(t)})"
        for m, targets in g.items()
        for t in sorted(targets)
        if layer_of(t) > layer_of(m)
    ]


def main() -> int:
    g = graph()
    for layer, name in enumerate(LAYER_NAMES):
        mods = sorted(m for m in g if layer_of(m) == layer)
        if not mods:
            continue
        print(f"layer {layer} {name}")
        for m in mods:
            deps = ", ".join(f"{t or PACKAGE}[{layer_of(t)}]" for t in sorted(g[m]))
            print(f"  {m or PACKAGE:28s} -> {deps or '-'}")
    bad = violations(g)
    print("\nupward imports:", "none" if not bad else "")
    for b in bad:
        print("  " + b)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
