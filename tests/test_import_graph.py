"""The import graph of the packages: no circle, no upward import.

Layers, top to bottom: scripts/ and tests/ → swarmtest → peer → swarm → optim → compress. A module imports only from
its own layer or a lower one, and no package imports a module of tests/ or scripts/. Inside swarm/, each subpackage
or top-level module is a unit, layered the same way (``SWARM_LAYERS``, top to bottom):

    plan                          the throughput model, and its measurement of the real pipeline in one process
    node                          the Node and its roles: assembles a peer from everything below
    recovery, sim, export         CheckFree and rebalancing, the in-process simulator, the model's export
    pipeline, outer               the microbatch path and the outer step, side by side (neither imports the other)
    dht                           records, membership, the DHT process
    config, config_toml           the swarm config (its sections come from model/, optim/, compress/); its TOML text
    model, rpc                    the plain model and its stages; the servicer base, auth, blobs
    errors, hardware, faults, events, cli_fields    leaves

and no two units import each other, even through others. Every import counts: at module level, inside functions and
under ``if TYPE_CHECKING:`` (a type-only import is still a dependency a reader follows). The graph comes from walking
the tree, so new modules are checked as they appear; a new unit of swarm/ must be placed in ``SWARM_LAYERS``.

    $ python3 -m pytest -q tests/test_import_graph.py
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("compress", "optim", "swarm", "peer", "swarmtest")  # bottom to top
OUTSIDE_PACKAGES = ("scripts", "tests")  # the top: run, never imported by a package
SWARM_LAYERS: tuple[tuple[str, ...], ...] = (  # bottom to top
    ("errors", "hardware", "faults", "events", "cli_fields"),
    ("model", "rpc"),
    ("config", "config_toml"),
    ("dht",),
    ("pipeline", "outer"),
    ("recovery", "sim", "export"),
    ("node",),
    ("plan",),
)


@dataclass(frozen=True)
class Import:
    importer: str  # the importing module
    target: str  # the imported module (a package's is its __init__)
    line: int

    def __str__(self) -> str:
        return f"{self.importer} (line {self.line}) imports {self.target}"


def find_modules(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """{dotted module name: its file} of every module in ``packages`` under ``root`` (missing packages skipped)."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_names(module: str, path: Path) -> list[tuple[str, str | None, int]]:
    """(module, name imported from it or None, line) of every import anywhere in the file: ``import a.b`` gives
    ("a.b", None), ``from a import b`` ("a", "b"), where b may be a module or a name in a."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    names: list[tuple[str, str | None, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .x import y
                base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
            names += [(base, None if alias.name == "*" else alias.name, node.lineno) for alias in node.names]
    return names


def import_graph(modules: Mapping[str, Path]) -> tuple[list[Import], list[str]]:
    """Every import between ``modules``, and the imports of a package's module that does not exist (the graph cannot
    place them)."""
    packages = {name.split(".")[0] for name in modules}
    imports, missing = [], []
    for module, path in modules.items():
        for base, name, line in imported_names(module, path):
            if base.split(".")[0] not in packages:
                continue
            if name and f"{base}.{name}" in modules:  # from a import b, b a module
                target = f"{base}.{name}"
            elif base in modules:
                target = base
            else:
                missing.append(f"{module} (line {line}) imports {base}, which is no module")
                continue
            if target != module:
                imports.append(Import(module, target, line))
    return imports, missing


def cycles(edges: Mapping[str, Mapping[str, Import]]) -> list[list[Import]]:
    """One circle of imports through each strongly connected part of the graph {node: {node it imports: how}}."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    parts: list[set[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm; the graphs are a few hundred nodes deep at most
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in edges.get(node, {}):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            part = {stack.pop()}
            while node not in part:
                part.add(stack.pop())
            if len(part) > 1:
                parts.append(part)

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return [_circle_through(min(part), part, edges) for part in parts]


def _circle_through(start: str, part: set[str], edges: Mapping[str, Mapping[str, Import]]) -> list[Import]:
    """The shortest circle from ``start`` back to it inside one strongly connected ``part`` (breadth first)."""
    came_by: dict[str, Import] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for other, how in sorted(edges.get(node, {}).items()):
                if other == start:
                    circle = [how]
                    while circle[0].importer != start:
                        circle.insert(0, came_by[circle[0].importer])
                    return circle
                if other in part and other not in came_by:
                    came_by[other] = how
                    following.append(other)
        frontier = following
    raise AssertionError(f"{start} is in no circle of {sorted(part)}")


def upward(imports: Iterable[Import], layer_of: Mapping[str, int | None]) -> list[Import]:
    """The imports from a layer to a higher one (units without a layer are the caller's to report)."""
    found = []
    for imp in imports:
        low, high = layer_of.get(imp.importer), layer_of.get(imp.target)
        if low is not None and high is not None and high > low:
            found.append(imp)
    return found


def swarm_unit(module: str) -> str | None:
    """swarm.outer.replica → "outer", swarm.config → "config"; None outside swarm/ and for the package itself."""
    parts = module.split(".")
    return parts[1] if parts[0] == "swarm" and len(parts) > 1 else None


def circle_text(circle: Sequence[Import]) -> str:
    names = " → ".join([circle[0].importer, *(imp.target for imp in circle)])
    return f"{names}\n" + "".join(f"      {imp}\n" for imp in circle)


def _edges(imports: Iterable[Import], unit: Callable[[str], str | None] = str) -> dict[str, dict[str, Import]]:
    """{importer: {target: the first such import}}, between ``unit``s of modules (modules themselves by default)."""
    edges: dict[str, dict[str, Import]] = {}
    for imp in imports:
        importer, target = unit(imp.importer), unit(imp.target)
        if importer is not None and target is not None and importer != target:
            edges.setdefault(importer, {}).setdefault(target, Import(importer, target, imp.line))
    return edges


MODULES = find_modules(ROOT, LAYERS)
IMPORTS, MISSING = import_graph(MODULES)


def test_every_import_of_a_package_names_a_module() -> None:
    assert not MISSING, "imports the graph cannot place:\n  " + "\n  ".join(MISSING)


def test_no_import_circle_between_modules() -> None:
    found = cycles(_edges(IMPORTS))
    assert not found, "import circles (restructure so the dependency points one way):\n  " + "  ".join(
        map(circle_text, found)
    )


def test_no_package_imports_a_higher_layer() -> None:
    layer_of = {module: LAYERS.index(module.split(".")[0]) for module in MODULES}
    found = upward(IMPORTS, layer_of)
    assert not found, f"upward imports (layers, bottom to top: {' → '.join(LAYERS)}):\n  " + "\n  ".join(
        map(str, found)
    )


def test_no_package_imports_tests_or_scripts() -> None:
    outside = set(OUTSIDE_PACKAGES) | {path.stem for name in OUTSIDE_PACKAGES for path in (ROOT / name).glob("*.py")}
    outside -= set(sys.stdlib_module_names)
    found = [
        f"{module} (line {line}) imports {name}"
        for module, path in MODULES.items()
        for name, _, line in imported_names(module, path)
        if name.split(".")[0] in outside
    ]
    assert not found, "a package imports tests/ or scripts/ (move what it needs into the package):\n  " + "\n  ".join(
        found
    )


def test_swarm_units_are_layered() -> None:
    layer_of = {unit: level for level, units in enumerate(SWARM_LAYERS) for unit in units}
    unplaced = sorted({unit for module in MODULES if (unit := swarm_unit(module)) and unit not in layer_of})
    assert not unplaced, f"swarm units in no layer: {unplaced}; place each in SWARM_LAYERS (and the docstring)"
    inside = [imp for imp in IMPORTS if swarm_unit(imp.importer) and swarm_unit(imp.target)]
    found = upward(inside, {module: layer_of.get(swarm_unit(module) or "") for module in MODULES})
    assert not found, (
        f"upward imports between swarm's units (layers, bottom to top: {SWARM_LAYERS}):\n  "
        + "\n  ".join(map(str, found))
    )
    circles = cycles(_edges(inside, swarm_unit))
    assert not circles, "swarm's units import each other:\n  " + "  ".join(map(circle_text, circles))


def test_the_checks_find_a_circle_and_an_upward_import(tmp_path: Path) -> None:
    """The checks above can fail: a small tree with a circle (a.x → a.y → a.x, one import inside a function) and an
    upward one (a → b)."""
    for name, text in {
        "a/__init__.py": "",
        "a/x.py": "from a import y\n",
        "a/y.py": "def f():\n    from .x import f\n",
        "a/z.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import b.w\n",
        "b/__init__.py": "",
        "b/w.py": "import a.z\nfrom a.gone import thing\n",
    }.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    imports, missing = import_graph(find_modules(tmp_path, ("a", "b")))
    assert missing == ["b.w (line 2) imports a.gone, which is no module"]
    assert [circle_text(circle).splitlines()[0] for circle in cycles(_edges(imports))] == [
        "a.x → a.y → a.x",
        "a.z → b.w → a.z",
    ]
    assert upward(imports, {"a.z": 0, "b.w": 1}) == [Import("a.z", "b.w", 3)]
