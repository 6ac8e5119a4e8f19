"""The house's size rules (issue 44 §6): in swarm/, optim/ and compress/ no module over 500 lines, no class over 300 and
no function over 60, so that no room grows crowded again unnoticed."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("swarm", "optim", "compress")
MAX_MODULE_LINES, MAX_CLASS_LINES, MAX_FUNCTION_LINES = 500, 300, 60


def oversized(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """Every module, class and function of ``packages`` under ``root`` over its limit."""
    found = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            source = path.read_text()
            where = path.relative_to(root)
            if (lines := source.count("\n")) > MAX_MODULE_LINES:
                found.append(f"{where}: {lines} lines (module, at most {MAX_MODULE_LINES})")
            for node in ast.walk(ast.parse(source)):
                span = (node.end_lineno or node.lineno) - node.lineno + 1 if hasattr(node, "lineno") else 0
                if isinstance(node, ast.ClassDef) and span > MAX_CLASS_LINES:
                    found.append(f"{where}: class {node.name} {span} lines (at most {MAX_CLASS_LINES})")
                elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and span > MAX_FUNCTION_LINES:
                    found.append(f"{where}: {node.name} {span} lines (function, at most {MAX_FUNCTION_LINES})")
    return found


def test_no_module_class_or_function_outgrows_its_limit() -> None:
    assert oversized() == []


def test_the_rule_finds_a_function_a_class_and_a_module_over_their_limits(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    long_function = "def long() -> None:\n" + "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    short_methods = "".join(
        f"    def m{i}(self) -> int:\n        return {i}\n\n" for i in range(MAX_CLASS_LINES // 3 + 1)
    )
    (tmp_path / "pkg" / "a.py").write_text(long_function + "\nclass Big:\n" + short_methods)
    (tmp_path / "pkg" / "b.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    (tmp_path / "pkg" / "c.py").write_text("def short() -> None:\n    pass\n")
    found = oversized(tmp_path, ("pkg",))
    assert len(found) == 3, found
    assert any("long 61 lines" in f for f in found) and any("class Big" in f for f in found)
    assert any(f.startswith("pkg/b.py") for f in found)
