"""Who may import whom (docs/design.md, "Module map"), read from the source, TYPE_CHECKING
imports included. ``tests/test_imports.py`` checks the same rules at run time, per process."""

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
    "cpq.tracepoints",  # CPQ_TRACE_DIR: every process on a task's path notes its steps
    "cpq.environ",
    "cpq.wirecheck",
    "cpq.wirefast",  # the decoder's and encoder's compiled fast paths
    "cpq.spin",  # spin, then block: the broker's, a rank's and a client's waits
    "cpq.features",
    "cpq.specs",
    "cpq.records",
    "cpq.rng",  # the caller's random state: read by the client, installed by the ranks
    # the timeline's format and pictures: read by the broker, the status CLI and the merge
    "cpq.timeline",
    "cpq.timeline.records",
    "cpq.timeline.run",
    "cpq.timeline.layout",
    "cpq.timeline.summary",
    "cpq.timeline.trace",
    "cpq.timeline.html",
    "cpq.timeline.command",
}
# A process folder may import the shared leaves and the folders listed here, nothing else.
FOLDERS = {
    "cpq.broker": set(),
    "cpq.rank": set(),
    "cpq.fanout": set(),
    "cpq.client": {"cpq.fanout", "cpq.caller"},  # the plugin registers the fan-out; `cpq
    # merge` runs it; a session is handed to the warm caller (``cpq.caller.wire``)
    "cpq.caller": {"cpq.rank"},  # the warm caller imports ahead as a rank does
}


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
                # ``from cpq.client import items`` imports the module cpq.client.items
                # (:func:`real` keeps the names that are not modules to their module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
    return {m for m in found if m != "cpq.__version__"}


GRAPH = {module_name(p): imports_of(p) for p in sorted(PACKAGE.rglob("*.py"))}


def real(name: str) -> str:
    """``from cpq import paths`` names the module; ``from cpq import Client`` the package."""
    return name if name in GRAPH else name.rsplit(".", 1)[0]


def folder(module: str) -> str | None:
    return next((f for f in FOLDERS if module == f or module.startswith(f + ".")), None)


def test_every_module_is_a_shared_leaf_or_in_a_process_folder() -> None:
    loose = {m for m in GRAPH if m not in SHARED and folder(m) is None}
    assert loose <= {"cpq", "cpq.__main__"}, loose


@pytest.mark.parametrize("module", sorted(SHARED & set(GRAPH)))
def test_shared_modules_import_only_shared_modules(module: str) -> None:
    assert {real(m) for m in GRAPH[module]} <= SHARED, GRAPH[module]


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if folder(m) is not None))
def test_a_process_folder_imports_only_the_leaves_and_its_allowed_folders(module: str) -> None:
    own = folder(module)
    assert own is not None
    allowed = {own, *FOLDERS[own]}
    bad = {
        real(m) for m in GRAPH[module] if real(m) not in SHARED and folder(real(m)) not in allowed
    }
    # the bare package counts as foreign: its names lead into the client (`cpq.Client`)
    assert not bad, f"{module} imports {sorted(bad)}"


def test_the_package_and_python_m_cpq_reach_their_names_lazily() -> None:
    """``cpq/__init__`` imports no cpq module at import time (PEP 562 ``__getattr__``)."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    eager = [
        node
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cpq")
    ]
    assert not eager, [ast.unparse(n) for n in eager]


def test_no_import_cycle() -> None:
    graph = {
        m: {real(i) for i in deps if real(i) in GRAPH and real(i) != m} for m, deps in GRAPH.items()
    }
    graph["cpq"] = set()  # the package's lazy names are for users, not for cpq's own modules
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
