"""Data flows one way: no module of the package imports a layer above its own (tests/layering.py)."""

from __future__ import annotations

import layering


def test_no_module_imports_a_higher_layer():
    assert layering.violations() == []


def test_the_graph_sees_every_module_and_real_edges():
    g = layering.graph()
    # Every source file is in the graph, under the layer its path says.
    for expected in ("_ext._stager", "_ext._row_format", "core_tables", "reference.stager", "testing.fuzz",
                     "sim.loop", "cli.simulate", ""):
        assert expected in g
    # Known edges are found (top-level, lazy and Cython imports), so an empty violation list means something.
    assert "_ext._row_format" in g["core_tables"]
    assert "config" in g["_ext._stager"] and "stage_plan" in g["_ext._stager"]  # .pyx imports
    assert "testing" in g["testing.fuzz"]  # lazy, function-level imports
    assert "reference" in g["cli.simulate"]


def test_an_upward_import_is_reported():
    fake = {"_ext._stager": {"formats"}, "formats": {"_ext._row_format"}}
    assert layering.violations(fake) == ["_ext._stager (layer 3) imports formats (layer 4)"]


def test_every_extension_has_a_stub():
    """py.typed is shipped: each Cython module has a .pyi (checked against the build by stubtest in CI)."""
    ext = layering.ROOT / "_ext"
    sources = sorted(p.stem for p in ext.glob("*.pyx"))
    assert sources == ["_cuda", "_row_format", "_stager"]
    assert all((ext / f"{name}.pyi").is_file() for name in sources)


#: What the reference twin may take from the rest of the package: the value
#: types it takes and returns, the snapshot and prefix block formats' Python
#: specs, pickling. Never a rule of the contract (a limit, a table, a check, a
#: message).
_REFERENCE_MAY_IMPORT = {
    "config": {"StagerConfig"},
    "errors": {"StateError", "ConfigError"},
    "prefix_hit": {"HIT", "PUBLISH", "PrefixHit", "PrefixHits", "PrefixMoves", "no_prefix_moves"},
    "slot_moves": {"RestoredSlots", "SlotMoves", "no_moves"},
    "stage_plan": {"BatchPlan", "StagePlan"},
    "device_step": {"StepOutputs"},
    "stager_copy": {"reduce_stager"},
    "snapshot_format": None,  # the module itself, given the reference's own name tables
}


def test_the_reference_spells_out_its_own_rules():
    """The oracle must not borrow what it checks: no core table, limit, argument check or
    mismatch rule comes into dspark_core.reference from the core or its binding."""
    import ast

    borrowed = []
    for path in sorted((layering.ROOT / "reference").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.level == 0 and not (node.module or "").startswith(
                    "dspark_core"):
                continue
            if node.level == 1:
                continue  # the reference's own modules
            module = (node.module or "").removeprefix("dspark_core.").removeprefix("dspark_core")
            names = {a.name for a in node.names}
            if module == "" and names <= {"snapshot_format", "prefix_block_format"}:
                continue
            allowed = _REFERENCE_MAY_IMPORT.get(module, set())
            if allowed is None or not names <= allowed:
                borrowed.append(f"{path.name}: from {'.' * node.level}{node.module or ''} import {sorted(names)}")
    assert borrowed == []
