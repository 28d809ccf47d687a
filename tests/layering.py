"""The package's layers and its import graph (``python tests/layering.py`` prints it).

Each module of ``src/dspark_core`` belongs to one layer; a module imports
only modules of its own or a lower layer, lazy (function-level) imports
included. Layers, bottom up:

0 base       errors, _version, rows._bf16 (bfloat16, loaded when first used), prefix.keys,
             the concept packages' ``__init__`` (stager, rows, prefix: they import nothing):
             no import from the package
1 binding    _ext._row_format: the C++ row formats and the core's name tables and limits
2 contract   stager (core_tables, _args, config, stage_plan, device_step, snapshot_format,
             protocol_mismatch, pickling), rows.slot_moves, rows.row_dtypes, prefix.hit, prefix.block_format:
             the tables, the binding's argument conversions, the value types the Stager
             binding takes and returns, how a protocol mismatch is logged, and how a Stager
             is pickled (config plus snapshots)
3 binding    _ext._stager (with its .pxi includes), _ext._cuda: the C++ Stager, PrefixStore
             and CUDA conversions
4 api        formats, kernels, cuda, gguf, context_plan, sdk, rows.ring_owner, rows.host_ring,
             prefix.table_owner, prefix.host_table: the Python API over the core
5 reference  reference: the pure-Python twin (test oracle)
6 tools      testing, sim, engines, vllm: differential runner, fuzzing, the loop, toy models,
             real-engine adapters and the vLLM plugin (optional engines, imported lazily)
7 cli        cli: commands and all table / text presentation
8 root       the package's ``__init__`` (the embedding API)

No module imports itself back at import time: :func:`cycles` of
``graph(lazy=False)`` (module-level imports) is empty.

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
    "_old_paths": 0,
    "_version": 0,
    "_ext": 1,
    "_ext._row_format": 1,
    "stager": 2,
    "rows": 0,
    "rows._bf16": 0,
    "rows.slot_moves": 2,
    "rows.row_dtypes": 2,
    "rows.ring_owner": 4,
    "rows.host_ring": 4,
    "prefix": 0,
    "prefix.keys": 0,
    "prefix.hit": 2,
    "prefix.block_format": 2,
    "prefix.table_owner": 4,
    "prefix.host_table": 4,
    "_ext._stager": 3,
    "_ext._cuda": 3,
    "formats": 4,
    "kernels": 4,
    "cuda": 4,
    "gguf": 4,
    "context_plan": 4,
    "metrics": 4,
    "sdk": 4,
    "reference": 5,
    "testing": 6,
    "sim": 6,
    "engines": 6,
    "vllm": 6,
    "cli": 7,
    "": 8,
}
LAYER_NAMES = ("base", "binding", "contract", "binding", "api", "reference", "tools", "cli", "root")

_PYX_IMPORT = re.compile(r"^(\s*)(?:from\s+([\w.]+)\s+c?import\s+([\w, ()*]+)|c?import\s+([\w.]+))", re.M)
_PYX_INCLUDE = re.compile(r'^include\s+"([\w.]+)"', re.M)


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


def _pyx_text(path: pathlib.Path) -> str:
    """A Cython module's source with the ``.pxi`` files it includes (they are the same module)."""
    text = path.read_text()
    return text + "".join("\n" + (path.parent / name).read_text() for name in _PYX_INCLUDE.findall(text))


def _import_nodes(tree: ast.Module, lazy: bool) -> list[ast.stmt]:
    """The import statements of a module; without ``lazy``, only those run when it is imported
    (not in a function, not under ``if TYPE_CHECKING``)."""
    if lazy:
        return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    found: list[ast.stmt] = []
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                todo.extend(child.orelse)
            else:
                todo.append(child)
    return found


def imports_of(path: pathlib.Path, lazy: bool = True) -> set[str]:
    """Package modules ``path`` imports (lazy imports included unless ``lazy`` is false)."""
    module = module_name(path)
    is_pkg = path.stem == "__init__"
    found: set[str] = set()
    prefix = PACKAGE + "."
    if path.suffix == ".pyx":
        for m in _PYX_IMPORT.finditer(_pyx_text(path)):
            if m.group(1) and not lazy:
                continue  # indented: inside a function
            name = m.group(2) or m.group(4)
            if name == PACKAGE or name.startswith(prefix):
                rel = name[len(prefix):] if name != PACKAGE else ""
                items = [s.strip(" ()") for s in (m.group(3) or "").split(",")]
                found.update(_internal(rel, [i.split(" as ")[0] for i in items if i]))
        return found
    for node in _import_nodes(ast.parse(path.read_text()), lazy):
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


def graph(lazy: bool = True) -> dict[str, set[str]]:
    """Module -> the package modules it imports (at import time only, without ``lazy``)."""
    files = sorted(p for p in ROOT.rglob("*") if p.suffix in (".py", ".pyx") and "__pycache__" not in p.parts)
    return {module_name(p): imports_of(p, lazy) for p in files}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``g``: each strongly connected set of two or more modules, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm (the graph is a few hundred edges deep at most)
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(g.get(v, ())):
            if w not in g:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = []
            while True:
                w = stack.pop()
                members.append(w)
                if w == v:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return sorted(found)


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
    circles = cycles(graph(lazy=False))
    print("import circles (module level):", "none" if not circles else "")
    for c in circles:
        print("  " + " <-> ".join(c))
    print("import circles through lazy imports:", ", ".join(" <-> ".join(c) for c in cycles(g)) or "none")
    return 1 if bad or circles else 0


if __name__ == "__main__":
    sys.exit(main())
