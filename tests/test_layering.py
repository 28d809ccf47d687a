"""Data flows one way: no module of the package imports a layer above its own (tests/layering.py)."""

from __future__ import annotations

import layering


def test_no_module_imports_a_higher_layer():
    assert layering.violations() == []


def test_the_graph_sees_every_module_and_real_edges():
    g = layering.graph()
    # Every source file is in the graph, under the layer its path says.
    for expected in ("_ext._stager", "_ext._row_format", "stager.core_tables", "reference.stager", "testing.fuzz",
                     "sim.loop", "cli.simulate", "prefix.hit", "rows.host_ring", ""):
        assert expected in g
    # Known edges are found (top-level, lazy and Cython imports), so an empty violation list means something.
    assert "_ext._row_format" in g["stager.core_tables"]
    assert "stager.config" in g["_ext._stager"] and "stager.stage_plan" in g["_ext._stager"]  # .pyx imports
    assert "prefix.keys" in g["_ext._stager"] and "stager.device_step" in g["_ext._stager"]  # its .pxi includes
    assert "testing" in g["testing.fuzz"]  # lazy, function-level imports
    assert "reference" in g["cli.simulate_setup"]


def test_no_import_circle():
    """No module imports one that imports it back while it loads (module-level imports)."""
    assert layering.cycles(layering.graph(lazy=False)) == []


def test_only_known_lazy_import_circles():
    """One circle closes through imports that never run (type annotations); a new one fails here."""
    assert layering.cycles(layering.graph()) == [
        # The twin's mixins (device step, trees) take the stager's type under TYPE_CHECKING only.
        ["reference.device_step", "reference.stager", "reference.tree"],
    ]


def test_the_twins_mixins_share_its_sequences_without_importing_it():
    """The sequence the twin's stager and its mixins share (reference.seq) imports none of
    them, and the mixins take nothing from the stager while they load."""
    g, loaded = layering.graph(), layering.graph(lazy=False)
    twin = {"reference.stager", "reference.device_step", "reference.tree", "reference.prefix_store"}
    assert not g["reference.seq"] & twin
    for mixin in ("reference.device_step", "reference.tree"):
        assert "reference.seq" in loaded[mixin] and "reference.stager" not in loaded[mixin], mixin


def test_an_import_circle_is_reported():
    fake = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert layering.cycles(fake) == [["a", "b", "c"]]


def test_module_level_graph_leaves_out_lazy_imports():
    g = layering.graph(lazy=False)
    assert "cli.simulate_multiturn" not in g["cli.simulate"]  # imported inside add_parser / run
    assert "reference" not in g["cli.simulate_setup"]  # inside make_stager
    assert "stager.config" in g["_ext._stager"] and "prefix.hit" in g["_ext._stager"]  # .pyx, .pxi


def test_top_level_keeps_the_public_face_only():
    """The package groups its modules by concept: ten top-level modules at most."""
    top = sorted(p.stem for p in layering.ROOT.glob("*.py"))
    assert top == ["__init__", "_old_paths", "_version", "context_plan", "errors", "formats", "kernels", "metrics",
                   "sdk"]


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
    "stager.config": {"StagerConfig"},
    "errors": {"StateError", "ConfigError"},
    "prefix.hit": {"HIT", "PUBLISH", "PrefixHit", "PrefixHits", "PrefixMoves", "no_prefix_moves"},
    "rows.slot_moves": {"RestoredSlots", "SlotMoves", "no_moves"},
    "stager.stage_plan": {"BatchPlan", "StagePlan"},
    "stager.device_step": {"StepOutputs", "StepRows"},  # the arrays a step writes (their shapes: the binding's)
    "stager.totals": {"StagerTotals"},
    "stager.pickling": {"reduce_stager"},
    "stager.snapshot_format": None,  # the module itself, given the reference's own name tables
    "prefix.block_format": None,
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
            if module == "stager" and names == {"snapshot_format"} or module == "prefix" and names == {"block_format"}:
                continue
            allowed = _REFERENCE_MAY_IMPORT.get(module, set())
            if allowed is None or not names <= allowed:
                borrowed.append(f"{path.name}: from {'.' * node.level}{node.module or ''} import {sorted(names)}")
    assert borrowed == []


def test_the_binding_holds_no_policy():
    """The extension modules convert and call: no logger of their own (the Python layer's
    stager.protocol_mismatch decides how an event is told) and no rewriting of the core's
    messages (the core names each call as its caller knows it)."""
    import re

    found = []
    for path in sorted((layering.ROOT / "_ext").glob("*.p[yx][xi]")):
        text = path.read_text()
        for pattern in (r"^\s*import logging", r"getLogger\(", r"\blogger\.", r"str\(exc\)\s*$", r"_renamed\("):
            found += [f"{path.name}: {m.group(0).strip()}" for m in re.finditer(pattern, text, re.M)]
    assert found == []
