"""The spawn wait each verdict carries: measured by the broker where the wait happens."""

from __future__ import annotations

import pytest

from cpq import protocol

from .fakes import Sim, spec


def test_a_task_that_waited_for_its_group_carries_the_wait_and_a_warm_one_zero() -> None:
    sim = Sim()
    sim.client(features=sorted(protocol.ALL_FEATURES))
    first = sim.submit(pool_spec=spec(1))
    sim.tick(3.0)  # the group's ranks take 3 s to report ready
    sim.bring_up("g1")
    sim.tick(0.5)
    sim.finish_all("g1", first)
    second = sim.submit(pool_spec=spec(1))  # the group is warm now
    sim.tick(0.5)
    sim.finish_all("g1", second)
    done = sim.done()
    assert done[first].spawn_wait_s == pytest.approx(3.0, abs=0.01)
    assert done[first].queue_s == pytest.approx(3.0, abs=0.01)
    assert done[second].spawn_wait_s == 0.0


def test_a_group_started_before_the_task_counts_only_from_the_queueing() -> None:
    """A warm-up starts the group; the test is queued 2 s later and waits 1 s more."""
    sim = Sim()
    sim.client(features=sorted(protocol.ALL_FEATURES))
    sim.client_send(b"c1", protocol.Warm(specs=[spec(1)], counts=[1]))
    sim.tick(2.0)
    task = sim.submit(pool_spec=spec(1))
    sim.tick(1.0)
    sim.bring_up("g1")
    sim.finish_all("g1", task)
    assert sim.done()[task].spawn_wait_s == pytest.approx(1.0, abs=0.01)


def test_a_client_without_the_feature_gets_no_field() -> None:
    sim = Sim()
    sim.client()  # an older client: lists no features
    task = sim.submit(pool_spec=spec(1))
    sim.tick(2.0)
    sim.bring_up("g1")
    sim.finish_all("g1", task)
    assert sim.done()[task].spawn_wait_s is None  # left out of the frame: not measured
