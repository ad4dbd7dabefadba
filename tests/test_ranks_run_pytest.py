"""The ranks run pytest: a suite written for ``torchrun -m pytest`` gives, test by test, the
verdicts of a fresh ``torchrun --nproc-per-node 2 -m pytest`` under cpq — with
``--cpq-world-size 2`` and no marker, with a module marker, on the first session and the
next (warm) one. Real torchrun, real broker, real gloo.

The reference and cpq runs load the same small verdict plugin (``-p verdicts``), which writes
each pytest process's outcome per test id; the reference's verdict of a test is its ranks'
combined (failed when any rank failed, skipped when every rank skipped). The reference runs
with cpq's plugin loaded: under a launcher it steps aside, which this checks too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import VERDICTS_PLUGIN, combined_verdicts, project_session, run_with_verdicts

pytest_plugins = ["pytester"]

CONFTEST = """
import os
import pytest
import torch
import torch.distributed as dist


@pytest.fixture(scope="session", autouse=True)
def process_group():
    dist.init_process_group("gloo")  # no guard: under torchrun every process is fresh
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def module_sum():
    t = torch.arange(4.0)
    dist.all_reduce(t)
    return t


class Model:
    def __init__(self):
        self.weight = torch.ones(3) * (dist.get_rank() + 1)


@pytest.fixture
def model():
    return Model()
"""

PLAIN = """
import logging
import os
import random
import warnings

import pytest
import torch
import torch.distributed as dist


def test_module_fixture(module_sum):
    assert module_sum.tolist() == [0.0, 2.0, 4.0, 6.0]


def test_fixture_builds_an_object(model):
    dist.all_reduce(model.weight)
    assert model.weight.tolist() == [3.0, 3.0, 3.0]


def test_tmp_path(tmp_path):
    (tmp_path / "x").write_text(str(dist.get_rank()))
    assert (tmp_path / "x").read_text() == str(dist.get_rank())


def test_monkeypatch(monkeypatch):
    monkeypatch.setenv("CPQ_DIFF_VAR", "1")
    assert os.environ["CPQ_DIFF_VAR"] == "1"


def test_capsys(capsys):
    print("hello")
    assert capsys.readouterr().out == "hello\\n"


def test_caplog(caplog):
    logging.getLogger("project").warning("watch out")
    assert "watch out" in caplog.text


def test_request(request):
    assert request.node.name == "test_request"


def test_root_logger_as_fresh():
    assert logging.getLogger().getEffectiveLevel() == logging.WARNING


def test_ini_filter_makes_deprecation_an_error():
    warnings.warn("old api", DeprecationWarning)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_mark_ignores_deprecation():
    warnings.warn("old api", DeprecationWarning)


def test_assertion_detail():
    assert [1, 2, 3] == [1, 3, 3]


def test_forgot_to_broadcast_weights():
    weights = torch.randn(4)  # every fresh rank draws its own
    gathered = [torch.zeros(4) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, weights)
    assert torch.equal(gathered[0], gathered[1])


def test_broadcast_weights():
    weights = torch.randn(4)
    dist.broadcast(weights, 0)
    gathered = [torch.zeros(4) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, weights)
    assert torch.equal(gathered[0], gathered[1])


def test_random_differs_per_rank():
    drawn = [None] * dist.get_world_size()
    dist.all_gather_object(drawn, random.random())
    assert drawn[0] != drawn[1]


@pytest.mark.xfail(reason="known bug")
def test_xfail():
    assert False


def test_skip_inside():
    pytest.skip("not on this world")


@pytest.mark.parametrize("n", [1, 2], ids=["one", "two"])
def test_param_ids(n):
    assert n in (1, 2)


MADE = []


@pytest.fixture(scope="module")
def made_once():
    MADE.append(1)  # module state: a fresh process starts it empty
    return len(MADE)


def test_module_fixture_once_a(made_once):
    assert made_once == 1


def test_module_fixture_once_b(made_once):
    assert made_once == 1


@pytest.mark.skipif(int(os.environ.get("WORLD_SIZE", "1")) < 2, reason="needs two ranks")
def test_skipif_reads_the_ranks_world_size():
    assert dist.get_world_size() == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU node: cpq assigns the GPUs")
def test_gpus_as_the_shell_left_them():
    assert "CUDA_VISIBLE_DEVICES" not in os.environ  # unset in the shell, as fresh


class TestSetupMethod:
    def setup_method(self):
        self.rank = dist.get_rank()

    def teardown_method(self):
        del self.rank

    def test_rank_from_setup(self):
        assert self.rank == dist.get_rank()


class TestClassScope:
    @pytest.fixture(scope="class", autouse=True)
    def group(self, request):
        request.cls.pg = dist.new_group([0, 1])
        yield
        dist.destroy_process_group(request.cls.pg)

    def test_uses_class_group(self):
        t = torch.ones(1)
        dist.all_reduce(t, group=self.pg)
        assert t.item() == 2.0
"""

MARKED = """
import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.cpq(world_size=2)


def test_marked_passes(module_sum):
    assert module_sum.sum().item() == 12.0


def test_marked_fails_on_rank_one():
    assert dist.get_rank() == 0
"""

INI = """
[pytest]
filterwarnings =
    error::DeprecationWarning
"""


@pytest.fixture
def project(pytester: pytest.Pytester, broker: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    project_session(monkeypatch, broker, pytester.path)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_plain=PLAIN, test_marked=MARKED, verdicts=VERDICTS_PLUGIN)
    pytester.makeini(INI)
    return pytester.path


def test_a_torchrun_suite_gives_the_fresh_runs_verdicts(project: Path) -> None:
    pytest_args = ["-p", "verdicts", "-p", "no:cacheprovider", "-p", "no:randomly", "-rA"]
    ref = run_with_verdicts(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "-m",
            "pytest",
            *pytest_args,
        ],
        project / "ref",
        project,
    )
    assert "cpq steps aside" in ref.stdout, ref.stdout[-3000:]
    reference = combined_verdicts(
        [json.loads((project / f"ref-{rank}.json").read_text()) for rank in (0, 1)]
    )
    # What makes a fresh run differ from a warm bare function call, each in the reference:
    assert reference["test_plain.py::test_forgot_to_broadcast_weights"] == "failed"
    assert reference["test_plain.py::test_ini_filter_makes_deprecation_an_error"] == "failed"
    assert reference["test_plain.py::test_tmp_path"] == "passed"
    assert reference["test_plain.py::test_skipif_reads_the_ranks_world_size"] == "passed"
    assert len(reference) == 26, reference

    for session in ("cold", "warm"):
        run = run_with_verdicts(
            [sys.executable, "-m", "pytest", "--cpq-world-size", "2", *pytest_args],
            project / f"cpq-{session}",
            project,
        )
        got = json.loads((project / f"cpq-{session}-client.json").read_text())
        differ = {
            k: (reference.get(k), got.get(k))
            for k in reference | got
            if reference.get(k) != got.get(k)
        }
        assert not differ, (
            f"{session} session differs from the fresh run: {differ}\n{run.stdout[-4000:]}"
        )
        # What each rank's session ends with, as its conftest's sessionfinish sees it
        # (rank 1 fails a test rank 0 passes: 1 and 0 in the fresh run).
        statuses = {
            rank: [
                (project / f"{name}-{rank}.exitstatus").read_text()
                for name in ("ref", f"cpq-{session}")
            ]
            for rank in (0, 1)
        }
        assert all(ref == got for ref, got in statuses.values()), statuses
        # pytest's own assertion detail, from the rank that failed
        assert "At index 1 diff: 2 != 3" in run.stdout
        assert "cpq: 26 task(s)" in run.stdout

    # A module marker alone (no --cpq-world-size): the marked tests, the same verdicts.
    run = run_with_verdicts(
        [sys.executable, "-m", "pytest", "test_marked.py", *pytest_args],
        project / "marker",
        project,
    )
    got = json.loads((project / "marker-client.json").read_text())
    assert got == {k: v for k, v in reference.items() if k.startswith("test_marked.py")}, run.stdout
    assert "failed on rank(s) [1] of 2" in run.stdout


RENDER_COUNTER = """
import os

import _pytest.nodes

CALLER = "RANK" not in os.environ  # a rank (torchrun's variables) counts nothing
rendered = []
if CALLER:
    _render = _pytest.nodes.Node._repr_failure_py

    def _counting(self, excinfo, *args, **kwargs):
        rendered.append(self.nodeid)
        return _render(self, excinfo, *args, **kwargs)

    _pytest.nodes.Node._repr_failure_py = _counting


def pytest_sessionfinish(session):
    if CALLER:
        with open(os.environ["RENDERED_OUT"], "w") as out:
            out.write(str(len(rendered)))
"""


def test_the_calling_process_renders_no_failure_of_the_ranks(
    pytester: pytest.Pytester, broker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A test that fails on the ranks is reported with the ranks' rendering; the calling
    process's pytest does not render the hollow phase's exception as well (it cost 20-80 ms
    a failing test, BENCHMARKS.md "Where the warm session's wall goes"). The same counter
    in a plain pytest run renders the failure once: it can see a rendering."""
    project_session(monkeypatch, broker, pytester.path)
    pytester.makepyfile(
        render_counter=RENDER_COUNTER,
        test_fails="def test_fails():\n    value = 41\n    assert value + 1 == 43\n",
    )
    counts = {}
    for name, extra in (("plain", ["-p", "no:cpq"]), ("cpq", ["--cpq-world-size", "2"])):
        out = pytester.path / f"{name}.count"
        monkeypatch.setenv("RENDERED_OUT", str(out))
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "render_counter", "-p", "no:randomly", *extra],
            cwd=pytester.path,
            capture_output=True,
            text=True,
            timeout=300,
            env={k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")},
        )
        assert "1 failed" in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]
        assert "E       assert (41 + 1) == 43" in run.stdout, run.stdout[-3000:]
        counts[name] = int(out.read_text())
    assert counts == {"plain": 1, "cpq": 0}


FIXTURES_THAT_BREAK = """
import pytest


@pytest.fixture
def broken():
    raise RuntimeError("the fixture broke")


@pytest.fixture
def breaks_at_teardown():
    yield
    raise RuntimeError("the teardown broke")
"""

FIXTURE_ERRORS = """
def test_setup_error(broken):
    pass


def test_teardown_error(breaks_at_teardown):
    pass


def test_fails():
    assert 1 + 1 == 3
"""


def _errors_and_failures(out: str) -> list[str]:
    """The ERRORS and FAILURES sections as a user reads them, without cpq's own section
    (which rank failed) and the run's timing."""
    start = out.index("= ERRORS =")
    end = out.index("short test summary info")
    lines, in_cpq = [], False
    for line in out[start:end].splitlines():
        if line.startswith("-") and " cpq " in line:
            in_cpq = True
            continue
        if in_cpq and (line.startswith("_") or line.startswith("=")):
            in_cpq = False
        if not in_cpq and not line.startswith("- cpq:"):
            lines.append(line)
    return lines


def test_a_fixture_error_is_reported_as_a_fresh_run_reports_it(
    pytester: pytest.Pytester, broker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fixture's error at setup or teardown, and a failure, read as in a fresh run: no
    frame of cpq's hook wrappers in the ranks' tracebacks (a newcomer's trial found two)."""
    project_session(monkeypatch, broker, pytester.path)
    pytester.makeconftest(FIXTURES_THAT_BREAK)  # a conftest's: pytest keeps more frames
    pytester.makepyfile(test_errors=FIXTURE_ERRORS)
    common = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly"]
    common += ["-p", "no:flaky"]  # its protocol wrapper shows a frame of its own in a fresh run
    fresh = subprocess.run(
        [*common, "-p", "no:cpq"], cwd=pytester.path, capture_output=True, text=True, timeout=120
    )
    warm = subprocess.run(
        [*common, "--cpq-world-size", "1"],
        cwd=pytester.path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "cpq/rank" not in warm.stdout, warm.stdout
    assert _errors_and_failures(warm.stdout) == _errors_and_failures(fresh.stdout)


EXITS_CONFTEST = """
import atexit, os


def _bye(path):
    with open(path, "a") as handle:
        handle.write("bye\\n")


def _never():
    raise AssertionError("an unregistered handler ran")


who = os.environ.get("RANK", "caller")
atexit.register(_bye, os.path.join(os.environ["EXITS_DIR"], f"bye-{who}.txt"))
atexit.register(_never)
atexit.unregister(_never)
"""


def test_a_conftests_atexit_handler_runs_on_every_rank_as_in_a_fresh_run(
    pytester: pytest.Pytester, broker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh rank runs its conftest's ``atexit`` handlers when it exits; a warm rank runs
    them at its session's end (cpq.rank.exits), once a session: a second session on the
    same group writes its own files once, not the first session's again. Your pytest
    process imports the conftest too, and runs its handler at its own exit."""
    project_session(monkeypatch, broker, pytester.path)
    pytester.makeconftest(EXITS_CONFTEST)
    pytester.makepyfile(test_exits="def test_one():\n    pass\n")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    fresh = [*torchrun, "--nproc-per-node", "2", "-m", "pytest", "-p", "no:randomly"]
    cpq = [sys.executable, "-m", "pytest", "--cpq-world-size", "2", "-p", "no:randomly"]
    files = {}
    for name, command in (("fresh", fresh), ("cold", cpq), ("warm", cpq)):
        out = pytester.path / f"exits-{name}"
        out.mkdir()
        run = run_with_verdicts(command, out / "v", pytester.path, EXITS_DIR=str(out))
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for name in ("fresh", "cold", "warm"):  # read last: a handler run twice would show
        written = (pytester.path / f"exits-{name}").glob("bye-*.txt")
        files[name] = {path.name: path.read_text() for path in written}
    assert files["fresh"] == {"bye-0.txt": "bye\n", "bye-1.txt": "bye\n"}
    for name in ("cold", "warm"):
        assert files[name] == {**files["fresh"], "bye-caller.txt": "bye\n"}, name
