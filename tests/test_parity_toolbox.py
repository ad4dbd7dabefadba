"""Parity with a fresh run for the pytest toolbox (docs/design.md, "Fidelity").

Each test is a difference on CPU/gloo: a small project of a user's (in ``tmp_path``) run
through cpq and plainly (``-p no:cpq``: the body runs in the freshly started pytest process),
comparing what a user compares: verdicts, coverage reports, random draws.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import start_broker
from test_fidelity import run_pytest, session_env, write

from cpq import Client
from cpq.client.autostart import stop_broker


@pytest.fixture(scope="module")
def parity_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private broker with a spare per spec (a stale group's task takes it)."""
    process, endpoint = start_broker(tmp_path_factory.mktemp("parity-state"), "--max-ranks", "6")
    yield endpoint
    stop_broker(process)


# --------------------------------------------------------------------------- import-time env

MODE_LIB = """
import os

MODE = os.environ.get("TPLIB_MODE", "unset")  # read once, while being imported
"""
MODE_TESTS = """
import os
import pytest

FLAG = os.getenv("TPLIB_FLAG", "off")  # the test file's own import-time read

@pytest.mark.cpq(world_size=2)
def test_mode():
    import tplib
    assert tplib.MODE == "unset"

@pytest.mark.cpq(world_size=2)
def test_flag():
    assert FLAG == "off"

@pytest.mark.cpq(world_size=2)
def test_call_time():
    assert os.environ.get("TPLIB_CALL", "unset") == "unset"  # read when called: per task
"""


def test_variables_read_at_import_bind_the_group(parity_broker: str, tmp_path: Path) -> None:
    """``TPLIB_MODE=fast pytest; pytest``: the second session's verdicts are a fresh run's,
    not those of whichever session imported the module first in the warm group."""
    write(tmp_path / "tplib.py", MODE_LIB)
    write(tmp_path / "test_mode.py", MODE_TESTS)
    sessions = [
        {"TPLIB_MODE": "fast", "TPLIB_FLAG": "on", "TPLIB_CALL": "set"},
        {},
        {"TPLIB_MODE": "fast"},
        {},
    ]
    seen = []
    for extra in sessions:
        env = session_env(parity_broker, **extra)
        through_cpq, output = run_pytest(tmp_path, env)
        plain, plain_output = run_pytest(tmp_path, env, plain=True)
        assert through_cpq == plain, f"{extra}\ncpq:\n{output}\nplain:\n{plain_output}"
        seen.append(through_cpq)
    assert seen[0] == dict.fromkeys(["test_mode", "test_flag", "test_call_time"], "failed")
    assert seen[1] == dict.fromkeys(["test_mode", "test_flag", "test_call_time"], "passed")
    assert seen[2]["test_mode"] == "failed" and seen[3]["test_mode"] == "passed"

    with Client(parity_broker, name="cpq-status") as client:
        pools = client.status()["pools"]
    bound = {name for p in pools if p["state"] != "stopping" for name in p["bound_env"]}
    assert {"TPLIB_MODE", "TPLIB_FLAG"} <= bound  # names only, and shown
    assert "TPLIB_CALL" not in bound
    rendered = subprocess.run(
        [sys.executable, "-c", "from cpq.client.cli import status_main; status_main()"],
        env=session_env(parity_broker),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "TPLIB_MODE" in rendered.stdout and "fast" not in rendered.stdout, rendered


def test_own_groups_serve_no_other_session(parity_broker: str, tmp_path: Path) -> None:
    """A module global a test of another session mutated does not reach the next session:
    the session boundary forgets the project's modules (docs/design.md, "The session
    boundary"); ``--cpq-own-groups`` gives the same verdict on groups of its own."""
    write(tmp_path / "counter.py", "CALLS = []\n")
    write(
        tmp_path / "test_state.py",
        """
        import pytest

        @pytest.mark.cpq(world_size=2)
        def test_first_call():
            import counter
            counter.CALLS.append(1)
            assert counter.CALLS == [1]
        """,
    )
    env = session_env(parity_broker)
    first, output = run_pytest(tmp_path, env)
    assert first == {"test_first_call": "passed"}, output
    reused, output = run_pytest(tmp_path, env)
    assert reused == {"test_first_call": "passed"}, output  # imported afresh, as new
    own, output = run_pytest(tmp_path, env, "--cpq-own-groups")
    plain, _ = run_pytest(tmp_path, env, plain=True)
    assert own == plain == {"test_first_call": "passed"}, output


# --------------------------------------------------------------------------- coverage

COV_LIB = """
def only_in_ranks(flag):
    if flag:
        return "yes"
    return "no"


def never_called():
    return 0
"""
COV_TESTS = """
import pytest

@pytest.mark.cpq(world_size=2)
def test_branch():
    import tplib
    assert tplib.only_in_ranks(True) == "yes"

def test_local():
    assert 1 + 1 == 2
"""


def _lines(report: Path) -> dict[str, list[int]]:
    files = json.loads(report.read_text())["files"]
    return {Path(name).name: data["executed_lines"] for name, data in files.items()}


def _contexts(data_file: Path) -> set[str]:
    from coverage import CoverageData

    data = CoverageData(basename=str(data_file))
    data.read()
    return set(data.measured_contexts())


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_coverage_sees_the_ranks(parity_broker: str, tmp_path: Path, workers: list[str]) -> None:
    """``--cov`` (pytest-cov) and ``coverage run -m pytest`` report the lines run only in
    the ranks as a plain run reports them; ``--cov-context=test`` labels them."""
    write(tmp_path / "tplib.py", COV_LIB)
    write(tmp_path / "test_cov.py", COV_TESTS)
    env = session_env(parity_broker)
    reports, contexts, outputs = {}, {}, {}
    for plain in (False, True):
        report = tmp_path / f"cov-{plain}.json"
        args = ["--cov=tplib", f"--cov-report=json:{report}", "--cov-context=test", *workers]
        verdicts, outputs[plain] = run_pytest(tmp_path, env, *args, plain=plain)
        assert verdicts == {"test_branch": "passed", "test_local": "passed"}, outputs[plain]
        reports[plain], contexts[plain] = report, _contexts(tmp_path / ".coverage")
    assert _lines(reports[False]) == _lines(reports[True])
    # merging the ranks' data warned "No data was collected" and "Module tplib was never
    # imported" in the test (a newcomer's trial): the warnings are the plain run's
    for warned in ("No data was collected", "was never imported"):
        assert (warned in outputs[False]) == (warned in outputs[True]), outputs[False]
    assert 3 in _lines(reports[False])["tplib.py"]  # `if flag:`, run only in the ranks
    assert "test_cov.py::test_branch|run" in contexts[False]
    assert contexts[False] == contexts[True]

    runs = {}
    for plain in (False, True):
        data = tmp_path / f".coverage-{plain}"
        command = [sys.executable, "-m", "coverage", "run", f"--data-file={data}"]
        command += ["--source=tplib", "-m", "pytest", "-q", "-p", "no:randomly"]
        command += ["-p", "no:cacheprovider", *workers] + (["-p", "no:cpq"] if plain else [])
        subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, timeout=240)
        if workers:  # `coverage run` sees only the controller: xdist workers report nothing
            continue
        report = tmp_path / f"run-{plain}.json"
        subprocess.run(
            [sys.executable, "-m", "coverage", "json", f"--data-file={data}", "-o", str(report)],
            cwd=tmp_path,
            check=True,
            capture_output=True,
            timeout=60,
        )
        runs[plain] = _lines(report)
    assert runs.get(False) == runs.get(True)


# --------------------------------------------------------------------------- seeds

SEED_TESTS = """
import json
import os
import random

import numpy
import pytest

@pytest.mark.cpq(world_size=2)
def test_draws():
    draws = [random.random(), random.randint(0, 10**9), float(numpy.random.rand())]
    where = os.environ.get("RANK", "plain")
    with open(os.path.join(os.environ["DRAWS_DIR"], where + ".json"), "w") as out:
        json.dump(draws, out)
"""


def _draws(project: Path, env: dict[str, str], *args: str, plain: bool) -> list[list[float]]:
    out = project / "draws"
    out.mkdir(exist_ok=True)
    for old in out.iterdir():
        old.unlink()
    verdicts, output = run_pytest(project, dict(env, DRAWS_DIR=str(out)), *args, plain=plain)
    assert verdicts == {"test_draws": "passed"}, output
    return [json.loads(p.read_text()) for p in sorted(out.iterdir())]


def test_randomly_seed_reaches_every_rank(parity_broker: str, tmp_path: Path) -> None:
    """The body's ``random``/``numpy`` draws on each rank equal a plain run's under the same
    ``--randomly-seed``; without pytest-randomly they are a fresh process's (unpredictable)."""
    write(tmp_path / "test_seed.py", SEED_TESTS)
    env = session_env(parity_broker)
    by_seed = {}
    for seed in ("1", "2"):
        args = ("-p", "randomly", f"--randomly-seed={seed}")
        ranks = _draws(tmp_path, env, *args, plain=False)
        (plain,) = _draws(tmp_path, env, *args, plain=True)
        assert ranks == [plain, plain]
        by_seed[seed] = plain
    assert by_seed["1"] != by_seed["2"]

    # Without it every rank draws from fresh entropy, as each rank of a fresh torchrun does:
    # the ranks differ from each other and from the next session's.
    ranks = _draws(tmp_path, env, "-p", "no:randomly", plain=False)
    again = _draws(tmp_path, env, "-p", "no:randomly", plain=False)
    assert len(ranks) == 2 and ranks[0] != ranks[1] and again != ranks, (ranks, again)
