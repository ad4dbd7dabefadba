"""The ranks open a ``--cpq-world-size`` session while the pytest process collects
(cpq.client.opening), compared with a fresh ``torchrun -m pytest``: a rank collects as a
fresh rank does, before any test (no ``PYTEST_CURRENT_TEST``), and the session's first test
runs in the rank process that collected it, as in a fresh run's one process per rank; what
the conftest set at import (a torch switch) holds in the session's tests, as in a fresh rank."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import (
    VERDICTS_PLUGIN,
    fresh_verdicts,
    project_session,
    run_with_verdicts,
    start_broker,
    stop_broker,
)

pytest_plugins = ["pytester"]

FLAGS = ["-p", "verdicts", "-p", "no:cacheprovider", "-p", "no:randomly", "-rA"]

CONFTEST = """
import json
import os

import torch

torch.set_default_dtype(torch.float64)  # at import: the session's own, as in a fresh rank


def pytest_collection_finish(session):
    # what a rank's collection saw, for the tests to compare with themselves
    if "RANK" in os.environ:
        with open(f"{os.environ['SEEN_OUT']}-{os.environ['RANK']}.json", "w") as handle:
            json.dump(
                {"current_test": os.environ.get("PYTEST_CURRENT_TEST"), "pid": os.getpid()},
                handle,
            )
"""

TESTS = """
import json
import os


def _seen():
    with open(f"{os.environ['SEEN_OUT']}-{os.environ['RANK']}.json") as handle:
        return json.load(handle)


def test_collected_before_any_test():
    assert _seen()["current_test"] is None


def test_runs_where_it_was_collected():
    assert _seen()["pid"] == os.getpid()


def test_keeps_what_the_conftest_set_at_import():
    import torch

    assert torch.get_default_dtype() == torch.float64


def test_fails_on_rank_one():
    assert os.environ["RANK"] != "1"
"""


@pytest.fixture
def own_broker(tmp_path: Path) -> Iterator[str]:
    """A broker of this test's alone: the header's check below (no group busy with someone
    else's work) holds only where nobody else submits; the suite's shared broker serves the
    other xdist worker's tests meanwhile."""
    process, endpoint = start_broker(tmp_path / "own-state")
    try:
        yield endpoint
    finally:
        stop_broker(process)


@pytest.fixture
def project(pytester: pytest.Pytester, own_broker: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    project_session(monkeypatch, own_broker, pytester.path)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(verdicts=VERDICTS_PLUGIN, test_session=TESTS)
    return pytester.path


def test_the_ranks_collect_as_a_fresh_rank_does_and_run_the_first_test_there(
    project: Path,
) -> None:
    seen = {"SEEN_OUT": str(project / "seen-fresh")}
    reference, run = fresh_verdicts([*FLAGS, "test_session.py"], "fresh", project, **seen)
    assert reference == {
        "test_session.py::test_collected_before_any_test": "passed",
        "test_session.py::test_runs_where_it_was_collected": "passed",
        "test_session.py::test_keeps_what_the_conftest_set_at_import": "passed",
        "test_session.py::test_fails_on_rank_one": "failed",
    }, run.stdout[-3000:]
    command = [sys.executable, "-m", "pytest", "--cpq-world-size", "2", *FLAGS, "test_session.py"]
    for session in ("cold", "warm"):
        junit = project / f"{session}.xml"
        run = run_with_verdicts(
            [*command, f"--junitxml={junit}"],
            project / session,
            project,
            SEEN_OUT=str(project / f"seen-{session}"),
        )
        got = json.loads((project / f"{session}-client.json").read_text())
        assert got == reference, f"{session}: {got} != {reference}\n{run.stdout[-4000:]}"
        # Nothing else runs on this broker's groups: the header, written while the ranks
        # open the session, never shows a group as busy with someone else's work.
        header = next(line for line in run.stdout.splitlines() if line.startswith("cpq: broker"))
        assert "[busy]" not in header, header
    # The warm session waited for no group: its JUnit testcases carry no properties, as a
    # fresh run's carry none (cpq's wait property is for a wait, or for the fan-out's records)
    assert "<property " not in (project / "warm.xml").read_text()
