"""The import graph of fidelity: no module imports itself back through others (no cycles), and no layer imports a layer
above it. Imports are read with `ast` (top level and inside functions, classes and `if`s alike), so a late import
that only hides a cycle still counts."""
from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Layers, lowest first. A module may import its own layer and the layers before it. Test support (test packs, the
# fault server) lives outside the package, in testkit/, which no module of fidelity imports.
ORDER = ["base", "packs", "oracle", "measuring", "engine/suites", "report", "commands", "cli"]
LAYER_OF = {  # first matching prefix wins; a module matches `p` if it is `p` or lies under `p.`
    "fidelity.packs": "packs",
    "fidelity.oracle": "oracle",
    "fidelity.panels.build": "engine/suites",  # prompts answered through the engine client
    "fidelity.panels.check": "engine/suites",  # overlap with the suites' texts
    "fidelity.panels": "measuring",  # rows, text rows, pack encoders: what compare and the store read
    "fidelity.engine": "engine/suites",
    "fidelity.suites": "engine/suites",
    "fidelity.report": "report",
    "fidelity.commands": "commands",
    "fidelity.cli": "cli",
    "fidelity.__main__": "cli",
    "fidelity.measuring": "measuring",  # compare, store, metrics, stats
    "fidelity.plan": "measuring",
    "fidelity": "base",  # the package root, errors, blas, vector_math, content_hash, numerics
}

# (importer, imported) -> why it is still there; the test fails when one disappears, so the list only shrinks
KNOWN_VIOLATIONS: dict[tuple[str, str], str] = {
}


def allowed_layers(layer: str) -> set[str]:
    return set(ORDER[:ORDER.index(layer) + 1])


def layer_of(module: str) -> str:
    for prefix, layer in LAYER_OF.items():
        if module == prefix or module.startswith(prefix + "."):
            return layer
    raise AssertionError(f"{module} belongs to no layer: add it to LAYER_OF")


def modules_under(root: Path, package: str = "fidelity") -> dict[str, tuple[Path, bool]]:
    """dotted name -> (file, is_package) for every .py under root/package."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def import_graph(root: Path, package: str = "fidelity") -> dict[str, set[str]]:
    """module -> the package's modules it imports anywhere in its body. `from pkg import name` points at the submodule
    pkg.name when there is one, else at pkg."""
    modules = modules_under(root, package)

    def known(name: str) -> str | None:  # the longest prefix that is one of our modules
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, (path, is_package) in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module.split(".") if is_package else module.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                names = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
            else:
                continue
            targets |= {t for t in map(known, (n for n in names if n.split(".")[0] == package)) if t}
        graph[module] = targets - {module}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return sorted(cycles)


def layer_violations(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(a, b) for a, targets in graph.items() for b in targets
            if layer_of(b) not in allowed_layers(layer_of(a))}


def describe(graph, cycles) -> str:
    return "\n".join(" <-> ".join(c) + ": " + ", ".join(f"{a} -> {b}" for a in c for b in sorted(graph[a]) if b in c)
                     for c in cycles)


def test_no_import_cycles():
    graph = import_graph(ROOT)
    assert len(graph) > 90  # the walk found the package
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + describe(graph, cycles)


def test_no_layer_imports_a_layer_above_it():
    found = layer_violations(import_graph(ROOT))
    new = {f"{a} ({layer_of(a)}) -> {b} ({layer_of(b)})" for a, b in found - set(KNOWN_VIOLATIONS)}
    assert not new, "imports from a lower layer to a higher one:\n" + "\n".join(sorted(new))
    assert set(KNOWN_VIOLATIONS) <= found, f"fixed, remove from KNOWN_VIOLATIONS: {set(KNOWN_VIOLATIONS) - found}"


def test_only_the_cli_imports_commands():
    graph = import_graph(ROOT)
    importers = {a for a, targets in graph.items() for b in targets
                 if layer_of(b) == "commands" and layer_of(a) != "commands"}
    assert importers - {a for a, _ in KNOWN_VIOLATIONS} == {"fidelity.cli"}


def test_cycle_finder_on_a_known_graph():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e2"}, "e2": {"e"}, "f": {"d"}}
    assert find_cycles(graph) == [["a", "b", "c"], ["e", "e2"]]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_a_planted_cycle_and_an_upward_import_are_caught(tmp_path):
    # a copy of the real package, then two late imports: packs.base -> oracle.runner (upward) and back
    shutil.copytree(ROOT / "fidelity", tmp_path / "fidelity", ignore=shutil.ignore_patterns("__pycache__", "data"))
    clean = import_graph(tmp_path)
    assert find_cycles(clean) == [] and layer_violations(clean) == set(KNOWN_VIOLATIONS)
    base = tmp_path / "fidelity" / "packs" / "base.py"
    base.write_text(base.read_text() + "\n\ndef _planted():\n    from ..oracle import runner  # noqa: F401\n")
    runner = tmp_path / "fidelity" / "oracle" / "runner.py"
    runner.write_text(runner.read_text() + "\n\ndef _planted():\n    from fidelity.packs.base import Pack  # noqa\n")
    planted = import_graph(tmp_path)
    assert any({"fidelity.oracle.runner", "fidelity.packs.base"} <= set(c) for c in find_cycles(planted))
    assert ("fidelity.packs.base", "fidelity.oracle.runner") in layer_violations(planted)


def imports_of_testkit(root: Path) -> list[str]:
    """file:line of every import of testkit (the repository's test support, not installed) in root/fidelity."""
    found = []
    for path in sorted((root / "fidelity").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            if any(n == "testkit" or n.startswith("testkit.") for n in names):
                found.append(f"{path.relative_to(root).as_posix()}:{node.lineno}")
    return found


def test_the_package_never_imports_the_testkit(tmp_path):
    assert imports_of_testkit(ROOT) == []
    shutil.copytree(ROOT / "fidelity", tmp_path / "fidelity", ignore=shutil.ignore_patterns("__pycache__", "data"))
    demo = tmp_path / "fidelity" / "commands" / "demo.py"
    demo.write_text(demo.read_text() + "\n\ndef _planted():\n    from testkit.faults import ToyModel  # noqa: F401\n")
    assert imports_of_testkit(tmp_path) == [f"fidelity/commands/demo.py:{len(demo.read_text().splitlines())}"]


@pytest.mark.parametrize("layer", ORDER)
def test_every_layer_has_modules(layer):
    modules = modules_under(ROOT)
    assert any(layer_of(m) == layer for m in modules)
