"""docs/design.md is true to the code where a test can tell: the module map names every
module and what it may import, and the ``Class.member`` names the document uses exist."""

from __future__ import annotations

import ast
import re

import pytest

from .test_imports import GRAPH, PACKAGE, real

DOC = PACKAGE.parent / "docs" / "design.md"
TEXT = DOC.read_text()


def module_map() -> list[tuple[set[str], list[str]]]:
    """Rows of the module map: (the modules of the row, its allowed-import patterns)."""
    section = TEXT.split("## Module map", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        modules: set[str] = set()
        for path in re.findall(r"`([^`]+\.py)`", cells[0]):
            for file in sorted(PACKAGE.glob(path)):
                parts = file.relative_to(PACKAGE.parent).with_suffix("").parts
                modules.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
        patterns: list[str] = []
        for token in re.findall(r"`([^`]+)`", cells[-1]):
            braces = re.fullmatch(r"(.*)\{(.*)\}", token)
            names = [braces[1] + n for n in braces[2].split(",")] if braces else [token]
            patterns += [f"cpq.{n}" for n in names]
        rows.append((modules, patterns))
    return rows


ROWS = module_map()


def allowed(module: str, patterns: list[str]) -> bool:
    for pattern in patterns:
        if pattern.endswith(".*"):
            folder = pattern[:-2]
            if module == folder or module.startswith(folder + "."):
                return True
        elif module == pattern or pattern.startswith(module + "."):  # a package: a module of it
            return True
    return False


def test_every_module_is_in_exactly_one_row() -> None:
    seen = [m for modules, _ in ROWS for m in modules]
    assert sorted(set(GRAPH) - set(seen)) == [], "modules missing from the module map"
    assert sorted({m for m in seen if seen.count(m) > 1}) == [], "modules in two rows"


@pytest.mark.parametrize(("modules", "patterns"), ROWS, ids=lambda v: ",".join(sorted(v))[:60])
def test_a_module_imports_only_what_its_row_allows(modules: set[str], patterns: list[str]) -> None:
    for module in sorted(modules):
        imported = {real(m) for m in GRAPH[module]} - {module}
        extra = sorted(m for m in imported if not allowed(m, patterns))
        assert not extra, f"{module} imports {extra}; docs/design.md allows {patterns}"


def members() -> dict[str, set[str]]:
    """Every class of cpq with the names its body defines (methods, fields, self.attrs)."""
    found: dict[str, set[str]] = {}
    for file in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ClassDef):
                names = found.setdefault(node.name, set())
                for sub in ast.walk(node):
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.add(sub.name)
                    elif isinstance(sub, ast.AnnAssign) and isinstance(sub.target, ast.Name):
                        names.add(sub.target.id)
                    elif isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store):
                        names.add(sub.attr)
                    elif isinstance(sub, ast.Assign):
                        names.update(t.id for t in sub.targets if isinstance(t, ast.Name))
    return found


def test_the_class_members_the_document_names_exist() -> None:
    classes = members()
    named = set(re.findall(r"`([A-Z][A-Za-z]+)\.([a-z_]+)(?:\(\))?`", TEXT))
    assert named, "the document names no Class.member (the pattern no longer matches)"
    missing = sorted(f"{c}.{m}" for c, m in named if c in classes and m not in classes[c])
    unknown = sorted(f"{c}.{m}" for c, m in named if c not in classes)
    assert not missing and not unknown, f"docs/design.md names {missing + unknown}"
