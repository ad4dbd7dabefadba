"""A Megatron-shaped suite on gloo gives, test by test, a fresh ``torchrun -m pytest``'s
verdicts under ``--cpq-world-size 2``, on a cold and a warm session.

Megatron-LM's unit tests (run on one H200 in BENCHMARKS.md) are the model: a ``Utils``
helper joins or creates the default group, builds several model-parallel groups per test
with ``new_group`` and never destroys them (it forgets them: its globals go back to None),
a session fixture destroys the default group at the end, and a test asking for more
model-parallel ranks than the world has fails in every run. What cpq must give such a suite
(docs/design.md, "The process group the code sees"): the groups behave as the code's own
``init_process_group`` would have made them — ``destroy_process_group()`` frees every group
and ``is_initialized()`` says False until the code initialises again — and a failure of the
fresh run fails the same way. Real torchrun, real broker, real gloo.
"""

from __future__ import annotations

import json
import sys

import pytest
from conftest import VERDICTS_PLUGIN, fresh_verdicts, project_session, run_with_verdicts

pytest_plugins = ["pytester"]

PARALLEL_STATE = """
import torch.distributed as dist

_TP = None
_DP = None
_ALL = []


def initialize_model_parallel(tp=1):
    global _TP, _DP
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % tp:
        raise RuntimeError(f"world_size ({world}) is not divisible by tensor parallel ({tp})")
    for start in range(0, world, tp):  # every rank calls new_group for every group
        ranks = list(range(start, start + tp))
        group = dist.new_group(ranks)
        _ALL.append(group)
        if rank in ranks:
            _TP = group
    for offset in range(tp):
        ranks = list(range(offset, world, tp))
        group = dist.new_group(ranks)
        _ALL.append(group)
        if rank in ranks:
            _DP = group
    # and a few more, as Megatron builds (pipeline, context, embedding, ...)
    for _ in range(4):
        _ALL.append(dist.new_group(list(range(world))))


def destroy_model_parallel():
    global _TP, _DP
    _TP = _DP = None  # forgotten, never destroyed


def tp_group():
    return _TP


def dp_group():
    return _DP
"""

UTILS = """
import os
import torch.distributed as dist
import parallel_state as ps


class Utils:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    inited = False
    set_up = 0

    @staticmethod
    def initialize_distributed():
        if not dist.is_initialized():
            Utils.set_up += 1  # where Megatron's helper sets its CUDA device up
            dist.init_process_group(
                backend="gloo", world_size=Utils.world_size, rank=Utils.rank
            )
            dist.barrier()
        Utils.inited = True

    @staticmethod
    def initialize_model_parallel(tp=1):
        ps.destroy_model_parallel()
        Utils.initialize_distributed()
        ps.initialize_model_parallel(tp)
        Utils.inited = True

    @staticmethod
    def destroy_model_parallel():
        if not Utils.inited:
            return
        dist.barrier()
        ps.destroy_model_parallel()
        Utils.inited = False
"""

CONFTEST = """
import os
import pytest
import torch.distributed as dist


def pytest_configure(config):
    os.environ.setdefault("MEGATRON_SHAPED", "1")


@pytest.fixture(scope="session", autouse=True)
def cleanup():
    yield
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def set_env():
    os.environ["SHAPED_FLAG"] = "0"
"""

TESTS = """
import pytest
import torch
import torch.distributed as dist

import parallel_state as ps
from utils import Utils


class TestParallel:
    def setup_method(self, method):
        Utils.initialize_model_parallel(tp=2)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    @pytest.mark.parametrize("n", range(6))
    def test_tp_all_reduce(self, n):
        t = torch.full((4,), float(dist.get_rank() + n))
        dist.all_reduce(t, group=ps.tp_group())
        assert t.tolist() == [2.0 * n + 1] * 4

    def test_dp_is_one_rank_each(self):
        assert dist.get_world_size(ps.dp_group()) == 1


def test_tp_larger_than_world_fails():
    Utils.initialize_model_parallel(tp=4)  # raises, in every run


def test_world_is_two():
    Utils.initialize_distributed()
    assert dist.get_world_size() == 2


def test_env_from_the_autouse_fixture():
    import os

    assert os.environ["SHAPED_FLAG"] == "0"


def test_fails_on_rank_one():
    Utils.initialize_distributed()
    assert dist.get_rank() == 0


def test_the_set_up_of_an_uninitialised_worker_ran_once():
    Utils.initialize_distributed()
    assert Utils.set_up == 1


def test_destroy_frees_every_group():
    Utils.initialize_model_parallel(tp=2)
    group = ps.tp_group()
    dist.destroy_process_group()
    assert not dist.is_initialized()
    with pytest.raises((KeyError, RuntimeError, ValueError)):  # the group is gone
        dist.get_process_group_ranks(group)
    Utils.inited = False  # last in the file: a fresh run's new rendezvous is not tested
"""


def test_a_megatron_shaped_suite_gives_the_fresh_runs_verdicts(
    pytester: pytest.Pytester, broker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    project_session(monkeypatch, broker, pytester.path)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(
        parallel_state=PARALLEL_STATE, utils=UTILS, test_shaped=TESTS, verdicts=VERDICTS_PLUGIN
    )
    project = pytester.path
    args = ["-p", "verdicts", "-p", "no:cacheprovider", "-p", "no:randomly", "test_shaped.py"]
    reference, ref = fresh_verdicts(args, "ref", project)
    assert len(reference) == 13, ref.stdout[-3000:]
    assert reference["test_shaped.py::test_the_set_up_of_an_uninitialised_worker_ran_once"] == (
        "passed"
    )
    assert reference["test_shaped.py::test_tp_larger_than_world_fails"] == "failed"
    assert reference["test_shaped.py::test_fails_on_rank_one"] == "failed"
    assert reference["test_shaped.py::test_destroy_frees_every_group"] == "passed", ref.stdout
    for session in ("cold", "warm"):
        run = run_with_verdicts(
            [sys.executable, "-m", "pytest", "--cpq-world-size", "2", *args],
            project / f"cpq-{session}",
            project,
        )
        got = json.loads((project / f"cpq-{session}-client.json").read_text())
        differ = {
            k: (reference.get(k), got.get(k))
            for k in reference | got
            if reference.get(k) != got.get(k)
        }
        assert not differ, f"{session}: {differ}\n{run.stdout[-4000:]}"
        assert "is not divisible by tensor parallel" in run.stdout  # failing the same way
