"""A rank's pytest session is the caller's own: built from the arguments the caller was given
(paths, node ids, or its ini's ``testpaths``), so conftest discovery, ``rootdir`` and the
collection tree are the caller's — on every supported pytest (tools/test.sh runs this file on
the oldest and the newest too). Each scenario is a difference against the same arguments run
fresh, ``torchrun --nproc-per-node 2 -m pytest ARGS``. Real torchrun, real broker, real gloo.

The suite's tests live in two folders with conftests of their own, under ``tests/conftest.py``
(``golden_sizes``, which ``tests/layers`` extends, an autouse fixture, a module fixture);
pytest 9.1+ attaches a conftest's fixtures to its directory's node, so a rank that collected
each module on its own lost ``tests/conftest.py``'s after the first module (``fixture
'golden_sizes' not found``, the autouse fixture not run). ``tests/conftest.py`` (the ini's
``testpaths``) also drops every test outside ``tests/`` at collection: a rank that loaded it
while the caller ran ``dbg`` had no test to run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import VERDICTS_PLUGIN, fresh_verdicts, project_session, run_with_verdicts

pytest_plugins = ["pytester"]

ROOT_CONFTEST = """
import os
import pytest
import torch.distributed as dist


@pytest.fixture(scope="session", autouse=True)
def process_group():
    dist.init_process_group("gloo")  # no guard: under torchrun every process is fresh
    yield
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def root_flag(monkeypatch):
    monkeypatch.setenv("ROOT_FLAG", "1")
"""

TESTS_CONFTEST = """
import pytest


def pytest_collection_modifyitems(config, items):
    # as a project's own hook may: only its tests/ folder
    items[:] = [item for item in items if item.nodeid.startswith("tests/")]


@pytest.fixture
def golden_sizes():
    return [1, 2, 3]


@pytest.fixture(autouse=True)
def tests_flag(monkeypatch):
    monkeypatch.setenv("TESTS_FLAG", "1")


@pytest.fixture(scope="module")
def module_token(request):
    return request.module.__name__
"""

FOLDER_CONFTEST = """
import pytest


@pytest.fixture(autouse=True)
def folder_flag(monkeypatch):
    monkeypatch.setenv("FOLDER", {folder!r})
"""

#: ``tests/layers`` extends ``tests/conftest.py``'s fixture with its own.
LAYERS_CONFTEST = (
    FOLDER_CONFTEST
    + """

@pytest.fixture
def golden_sizes(golden_sizes):
    return [*golden_sizes, 4]
"""
)

CKPT = """
import os
import torch.distributed as dist


def test_load_missing_raises(golden_sizes):
    assert golden_sizes == [1, 2, 3]


def test_autouse_ran():
    flags = [os.environ.get(name) for name in ("ROOT_FLAG", "TESTS_FLAG", "FOLDER")]
    assert flags == ["1", "1", "ckpt"]


def test_module_fixture(module_token):
    assert module_token.endswith("test_ckpt")


def test_fails_on_rank_one():
    assert dist.get_rank() == 0
"""

LAYERS = """
import os
import torch
import torch.distributed as dist


def test_single_rank_is_dense(golden_sizes):
    assert golden_sizes == [1, 2, 3, 4]


def test_autouse_ran_too():
    flags = [os.environ.get(name) for name in ("ROOT_FLAG", "TESTS_FLAG", "FOLDER")]
    assert flags == ["1", "1", "layers"]


def test_all_reduce(module_token):
    t = torch.ones(2)
    dist.all_reduce(t)
    assert (t.tolist(), module_token.rpartition(".")[2]) == ([2.0, 2.0], "test_layers")
"""

PROBE = """
import os


def test_probe(request):
    loaded = sorted(
        str(getattr(plugin, "__file__", ""))
        for plugin in request.config.pluginmanager.get_plugins()
        if getattr(plugin, "__name__", "").endswith("conftest")
    )
    print("CONFTESTS", loaded, "args", request.config.args)
    assert not [path for path in loaded if "/tests/" in path], loaded
"""

INI = """
[pytest]
testpaths = tests
"""

BAD_MARKERS = """
import pytest


@pytest.mark.cpq(world_size="2")
def test_world_size_a_string():
    pass


@pytest.mark.cpq(world_sise=2)
def test_a_typo():
    pass


@pytest.mark.cpq(world_size=0)
def test_world_size_zero():
    pass


@pytest.mark.cpq(world_size=2)
def test_good_marker():
    pass


def test_plain():
    pass
"""

FLAGS = ["-p", "verdicts", "-p", "no:cacheprovider", "-p", "no:randomly", "-rA"]


@pytest.fixture
def project(pytester: pytest.Pytester, broker: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    project_session(monkeypatch, broker, pytester.path)
    pytester.makeini(INI)
    pytester.makeconftest(ROOT_CONFTEST)
    pytester.makepyfile(verdicts=VERDICTS_PLUGIN)
    files = {
        "tests/conftest.py": TESTS_CONFTEST,
        "tests/ckpt/conftest.py": FOLDER_CONFTEST.format(folder="ckpt"),
        "tests/ckpt/test_ckpt.py": CKPT,
        "tests/layers/conftest.py": LAYERS_CONFTEST.format(folder="layers"),
        "tests/layers/test_layers.py": LAYERS,
        "dbg/test_probe.py": PROBE,
    }
    for name, text in files.items():
        path = pytester.path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return pytester.path


def _fresh(project: Path, args: list[str], name: str) -> dict[str, str]:
    """The verdicts of ``torchrun --nproc-per-node 2 -m pytest ARGS``, its ranks combined."""
    reference, run = fresh_verdicts([*FLAGS, *args], name, project)
    assert "cpq steps aside" in run.stdout, run.stdout[-3000:]
    return reference


def _warm(project: Path, args: list[str], name: str) -> tuple[dict[str, str], str]:
    command = [sys.executable, "-m", "pytest", "--cpq-world-size", "2", *FLAGS, *args]
    run = run_with_verdicts(command, project / name, project)
    path = project / f"{name}-client.json"
    assert path.exists(), run.stdout[-4000:] + run.stderr[-2000:]
    return json.loads(path.read_text()), run.stdout


#: (what it shows, the arguments, the tests it runs)
SELECTIONS = [
    ("by-path", ["tests/layers", "tests/ckpt/test_ckpt.py"], 7),
    # the order: the module collected first had the fixtures, the next had none
    (
        "by-node-id",
        [
            "tests/ckpt/test_ckpt.py::test_load_missing_raises",
            "tests/layers/test_layers.py::test_single_rank_is_dense",
            "tests/layers/test_layers.py::test_autouse_ran_too",
        ],
        3,
    ),
    ("by-keyword", ["-k", "dense or autouse or rank_one"], 4),  # testpaths, then -k
    ("outside-testpaths", ["dbg"], 1),  # the ini's testpaths' conftest stays out
]


@pytest.mark.parametrize(
    ("name", "args", "count"), SELECTIONS, ids=[name for name, _, _ in SELECTIONS]
)
def test_a_selection_gives_the_fresh_runs_verdicts(
    project: Path, name: str, args: list[str], count: int
) -> None:
    reference = _fresh(project, args, f"{name}-fresh")
    assert len(reference) == count, reference
    # the reference passes but for the one test meant to fail (rank 1)
    failing = {k for k, v in reference.items() if v != "passed"}
    assert failing <= {"tests/ckpt/test_ckpt.py::test_fails_on_rank_one"}, reference
    got, out = _warm(project, args, f"{name}-cpq")
    differ = {
        k: (reference.get(k), got.get(k)) for k in reference | got if reference.get(k) != got.get(k)
    }
    assert not differ, f"{name}: cpq differs from the fresh run: {differ}\n{out[-4000:]}"


def test_a_marker_cpq_cannot_use_fails_only_its_test(
    pytester: pytest.Pytester, broker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The marker means nothing to a fresh run (every test passes there); under cpq the
    three it cannot use fail naming the problem, before anything of theirs runs, and the
    session's other tests run and pass."""
    project_session(monkeypatch, broker, pytester.path)
    pytester.makepyfile(test_markers=BAD_MARKERS, verdicts=VERDICTS_PLUGIN)
    run = run_with_verdicts(
        [sys.executable, "-m", "pytest", *FLAGS, "test_markers.py"],
        pytester.path / "markers",
        pytester.path,
    )
    got = json.loads((pytester.path / "markers-client.json").read_text())
    assert got == {
        "test_markers.py::test_world_size_a_string": "error",
        "test_markers.py::test_a_typo": "error",
        "test_markers.py::test_world_size_zero": "error",
        "test_markers.py::test_good_marker": "passed",
        "test_markers.py::test_plain": "passed",
    }, run.stdout[-4000:]
    assert run.returncode == 1, run.stdout[-4000:]  # tests failed; not a usage error (4)
    out = run.stdout
    assert "world_size must be an int of at least 1, got '2'" in out, out[-4000:]
    assert "unknown argument(s) world_sise" in out, out[-4000:]
    assert "world_size must be an int of at least 1, got 0" in out, out[-4000:]
    assert "cpq: 1 task(s)" in out, out[-4000:]  # the bad ones sent nothing
