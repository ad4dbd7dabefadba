"""What a rank restores before every task (docs/design.md "Fidelity" and README "State
between tasks"), run in this process: the caller's variables applied and the previous
task's gone, ``CPQ_KEEP_ENV`` kept, the working directory, the seeds, the reset hooks."""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy
import pytest

from cpq.rank import reset


@pytest.fixture
def baseline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[reset.Baseline]:
    """A rank's baseline taken in this process, os.environ and cwd restored afterwards."""
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    monkeypatch.chdir(tmp_path)
    os.environ.clear()
    os.environ.update({"PATH": "/usr/bin", "RANK": "1", "CPQ_GROUP_ID": "g1", "OMP_X": "1"})
    try:
        yield reset.Baseline.capture()
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)


def test_the_callers_variables_are_applied_and_the_previous_tasks_are_gone(
    baseline: reset.Baseline,
) -> None:
    reset.reset_state(baseline, 1234, {"MYPROJ_MODE": "fast", "HOME": "/h"})
    assert os.environ["MYPROJ_MODE"] == "fast" and os.environ["HOME"] == "/h"
    assert os.environ["RANK"] == "1" and os.environ["CPQ_GROUP_ID"] == "g1"  # the group's own
    os.environ["LEFT_BY_THE_TASK"] = "x"
    reset.reset_state(baseline, 1234, {"HOME": "/h"})
    assert "MYPROJ_MODE" not in os.environ and "LEFT_BY_THE_TASK" not in os.environ
    assert os.environ["HOME"] == "/h"


def test_a_caller_cannot_set_launcher_or_start_variables_on_a_warm_rank(
    baseline: reset.Baseline,
) -> None:
    reset.reset_state(baseline, 1234, {"RANK": "7", "OMP_X": "9", "NCCL_NVLS_ENABLE": "1"})
    assert os.environ["RANK"] == "1" and os.environ["OMP_X"] == "1"
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"  # multicast stays off, whatever is asked


def test_cpq_keep_env_survives_the_reset(
    baseline: reset.Baseline, monkeypatch: pytest.MonkeyPatch
) -> None:
    os.environ["CPQ_KEEP_ENV"] = "LIB_SET_ON_ITSELF"
    os.environ["LIB_SET_ON_ITSELF"] = "/opt/lib"  # set by a library after start-up
    reset.reset_state(baseline, 1234, {"HOME": "/h"})
    assert os.environ["LIB_SET_ON_ITSELF"] == "/opt/lib"


def test_the_working_directory_and_the_seeds_are_the_baselines(
    baseline: reset.Baseline, tmp_path: Path
) -> None:
    (tmp_path / "elsewhere").mkdir()
    os.chdir(tmp_path / "elsewhere")
    random.random(), numpy.random.rand()  # the previous task drew
    reset.reset_state(baseline, 99, None)
    assert os.getcwd() == str(tmp_path)
    drawn = random.random(), float(numpy.random.rand())
    random.seed(99), numpy.random.seed(99)
    assert drawn == (random.random(), float(numpy.random.rand()))


def test_reset_hooks_run_with_the_tasks_seed(baseline: reset.Baseline) -> None:
    seen: list[int] = []
    hook = reset.register_reset_hook(seen.append)
    try:
        reset.reset_state(baseline, 7, None)
        reset.reset_state(baseline, 8, None)
    finally:
        reset._hooks.remove(hook)
    assert seen == [7, 8]


def test_reset_hooks_named_in_the_environment_are_loaded(baseline: reset.Baseline) -> None:
    os.environ["CPQ_RESET_HOOKS"] = "tests.unit.targets:record_seed"
    sys.modules.pop("tests.unit.targets", None)
    reset.load_hooks_from_env()
    from tests.unit import targets

    try:
        reset.reset_state(baseline, 5, None)
    finally:
        reset._hooks.remove(targets.record_seed)
    assert targets.SEEDS == [5]
