"""Each xdist worker is one pytest process, as in a fresh run: what one of its tests leaves
reaches its next test, also while another worker's tests run on the same broker's groups.
A newcomer's trial found the difference: two workers measuring coverage shared one session
id, took turns on one group (a session's groups of its own), and each turn put torch's
switches back, so a test that set the default dtype no longer reached the next test of its
own file. Compared with the same tests run fresh (``torchrun -m pytest``); real broker,
real torchrun, real gloo, real xdist."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import VERDICTS_PLUGIN, fresh_verdicts, project_session, run_with_verdicts

pytest_plugins = ["pytester"]

FLAGS = ["-p", "verdicts", "-p", "no:cacheprovider", "-p", "no:randomly"]

STATE = """
import time

import torch


def test_a_sets_the_default_dtype():
    torch.set_default_dtype(torch.float64)


def test_b_lets_the_other_worker_run():
    time.sleep(1.5)


def test_c_sees_the_default_dtype():
    assert torch.get_default_dtype() == torch.float64
"""

OTHER = """
import time

import pytest


@pytest.mark.parametrize("i", range(4))
def test_busy(i):
    time.sleep(1.0)
"""


@pytest.fixture
def project(pytester: pytest.Pytester, broker: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    project_session(monkeypatch, broker, pytester.path)
    pytester.makepyfile(verdicts=VERDICTS_PLUGIN, test_state=STATE, test_other=OTHER)
    return pytester.path


def test_a_workers_tests_keep_what_its_earlier_tests_left_on_groups_of_its_own(
    project: Path,
) -> None:
    files = ["test_state.py", "test_other.py"]
    reference, run = fresh_verdicts([*FLAGS, *files], "fresh", project)
    assert set(reference.values()) == {"passed"} and len(reference) == 7, run.stdout[-3000:]
    command = [sys.executable, "-m", "pytest", "--cpq-world-size", "2", "--cpq-own-groups"]
    command += ["-n", "2", "--dist", "loadfile", *FLAGS, *files]
    run = run_with_verdicts(command, project / "cpq", project)
    got = json.loads((project / "cpq-client.json").read_text())
    assert got == reference, f"{got} != {reference}\n{run.stdout[-4000:]}"
