"""Spin, then block (``cpq.spin``), on a fake poller and a fake clock: a wait spins only in
the window after activity, never longer than its timeout, and blocks as asked after it;
the window comes from ``CPQ_SPIN_US`` or the cores, and a bad value is an error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cpq import protocol, spin

from .fakes import Sim


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Poller:
    """Answers poll(0) ``events_after`` spins later (never, when None); each poll(0) takes
    ``step`` seconds of the clock; records every timeout it was called with."""

    def __init__(self, clock: Clock, events_after: int | None, step: float = 0.0001) -> None:
        self.clock, self.events_after, self.step = clock, events_after, step
        self.calls: list[int] = []

    def poll(self, timeout: int | None = None) -> list[tuple[Any, int]]:
        assert timeout is not None
        self.calls.append(timeout)
        if timeout == 0:
            self.clock.now += self.step
            spins = len(self.calls)
            if self.events_after is not None and spins >= self.events_after:
                return [("socket", 1)]
            return []
        return []  # a blocking poll that timed out


def test_an_idle_wait_blocks_at_once() -> None:
    clock = Clock()
    poller = Poller(clock, events_after=1)
    spin.Spinner(0.002, clock).poll(poller, 250)
    assert poller.calls == [250]


def test_after_activity_it_spins_until_a_message_comes() -> None:
    clock = Clock()
    spinner = spin.Spinner(0.002, clock)
    spinner.note()
    poller = Poller(clock, events_after=5)
    assert spinner.poll(poller, 250) == [("socket", 1)]
    assert poller.calls == [0] * 5
    assert spinner.last == 100.0  # its owner says what activity is (not every message)


def test_a_quiet_window_ends_in_the_blocking_poll_with_the_time_left() -> None:
    clock = Clock()
    spinner = spin.Spinner(0.002, clock)
    spinner.note()
    poller = Poller(clock, events_after=None, step=0.0005)
    spinner.poll(poller, 250)
    assert poller.calls == [0, 0, 0, 0, 248]  # 2 ms of spins, then the rest blocking
    clock.now += 1.0
    poller.calls.clear()
    spinner.poll(poller, 250)
    assert poller.calls == [250]  # long after the activity: no spin


def test_a_short_timeout_bounds_the_spin() -> None:
    clock = Clock()
    spinner = spin.Spinner(0.05, clock)
    spinner.note()
    poller = Poller(clock, events_after=None, step=0.0004)
    spinner.poll(poller, 1)
    assert poller.calls == [0, 0, 0, 0]  # 1 ms, then nothing left to block for


def test_no_window_never_spins() -> None:
    clock = Clock()
    spinner = spin.Spinner(0.0, clock)
    spinner.note()
    poller = Poller(clock, events_after=1)
    spinner.poll(poller, 250)
    assert poller.calls == [250]


def test_the_window_comes_from_the_variable_else_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    assert spin.default_window_s({"CPQ_SPIN_US": "500"}) == 0.0005
    assert spin.default_window_s({"CPQ_SPIN_US": "0"}) == 0.0
    monkeypatch.setattr(spin, "usable_cores", lambda: 2)
    assert spin.default_window_s({}) == 0.0  # CI's two cores: a spinner takes a needed core
    monkeypatch.setattr(spin, "usable_cores", lambda: 16)
    assert spin.default_window_s({}) == spin.DEFAULT_WINDOW_S


def test_a_cgroup_quota_bounds_the_cores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A container limited to two cores on a 64-core host must not spin (its affinity
    still lists all 64)."""
    monkeypatch.setattr(spin.os, "sched_getaffinity", lambda pid: set(range(64)))
    assert spin.usable_cores(str(tmp_path)) == 64  # no cgroup files: the affinity
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert spin.usable_cores(str(tmp_path)) == 64
    (tmp_path / "cpu.max").write_text("200000 100000\n")
    assert spin.usable_cores(str(tmp_path)) == 2.0
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("400000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert spin.usable_cores(str(tmp_path)) == 4.0
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert spin.usable_cores(str(tmp_path)) == 64


def test_a_wait_without_a_timeout_or_forever_is_bounded_right() -> None:
    clock = Clock()
    spinner = spin.Spinner(0.002, clock)
    spinner.note()
    poller = Poller(clock, events_after=None, step=0.0005)
    spinner.poll(poller, 0)
    assert poller.calls == [0]  # asked not to wait: one look, no spin
    poller.calls.clear()
    spinner.poll(poller, -1)
    assert poller.calls == [0, 0, 0, -1]  # the window's rest (one look took 0.5 ms), then for ever


@pytest.mark.parametrize("bad", ["fast", "-1", "1.5"])
def test_a_bad_window_is_an_error_that_names_the_variable(bad: str) -> None:
    with pytest.raises(ValueError, match="CPQ_SPIN_US"):
        spin.default_window_s({"CPQ_SPIN_US": bad})


def test_the_broker_spins_after_task_traffic_never_after_a_heartbeat() -> None:
    sim = Sim(spares=0)
    client = sim.client()
    sim.client_send(client, protocol.Heartbeat())
    assert sim.wire.activity == 0  # a peer's heartbeat, every second: no spinning
    task = sim.submit()
    assert sim.wire.activity == 1
    sim.bring_up("g1")  # each rank's ready: the task goes out, its reports come soon
    noted = sim.wire.activity
    assert noted > 1
    sim.finish_all("g1", task)
    assert sim.wire.activity == noted + 2  # each rank's report
