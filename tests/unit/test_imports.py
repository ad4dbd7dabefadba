"""Who may import whom (docs/design.md, "Module map"), read from the source, TYPE_CHECKING
imports included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "cpq"
SHARED = {
    "cpq.protocol",
    "cpq.paths",
    "cpq.security",
    "cpq.lockfile",
    "cpq.timings",
    "cpq.osutil",
    "cpq.environ",
    "cpq.wirecheck",
}
CLIENT_SIDE = {"cpq.client", "cpq.autostart", "cpq.plugin", "cpq.cli", "cpq.render", "cpq.__main__"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every cpq module ``path`` imports, anywhere in the file."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("cpq"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "cpq":
                found.update(f"cpq.{a.name}" for a in node.names)
            elif node.module.startswith("cpq"):
                found.add(node.module)
    return {m for m in found if m != "cpq.__version__"}


GRAPH = {
    module_name(p): imports_of(p)
    for p in sorted(PACKAGE.rglob("*.py"))
    if "fanout" not in p.parts  # cpq/fanout/ (issue 14) has its own rules
}


def real(name: str) -> str:
    """``from cpq import paths`` names the module; ``from cpq import Client`` the package."""
    return name if name in GRAPH else name.rsplit(".", 1)[0]


@pytest.mark.parametrize("module", sorted(SHARED & set(GRAPH)))
def test_shared_modules_import_only_shared_modules(module: str) -> None:
    assert {real(m) for m in GRAPH[module]} <= SHARED | {"cpq"}, GRAPH[module]


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m.startswith("cpq.broker")))
def test_the_broker_imports_no_client_side_module(module: str) -> None:
    # The package itself counts as client side: cpq/__init__.py imports the client.
    bad = {real(m) for m in GRAPH[module]} & (CLIENT_SIDE | {"cpq"})
    assert not bad and not any(real(m).startswith("cpq.rank") for m in GRAPH[module]), bad


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m.startswith("cpq.rank")))
def test_the_rank_runtime_imports_nothing_of_the_broker(module: str) -> None:
    assert not any(real(m).startswith("cpq.broker") for m in GRAPH[module]), GRAPH[module]
    assert not {real(m) for m in GRAPH[module]} & CLIENT_SIDE


def test_no_import_cycle() -> None:
    graph = {
        m: {real(i) for i in deps if real(i) in GRAPH and real(i) != m} for m, deps in GRAPH.items()
    }
    graph["cpq"] = set()  # the package's re-exports are for users, not for cpq's own modules
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*path, node, dep]))
            if dep not in state:
                visit(dep, [*path, node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])


def test_worker_means_one_thing() -> None:
    assert not (PACKAGE / "worker.py").exists()
