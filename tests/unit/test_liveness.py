"""Busy or dead (cpq/broker/liveness.py): a quiet peer whose main thread gains CPU time is
busy; one whose CPU time stands still (deadlocked, blocked, stopped) is dead on time."""

from __future__ import annotations

import pytest

from cpq.broker import liveness

HEARTBEAT = 1.0
SILENCE = 5.0  # liveness x heartbeat


def quiet_after(monkeypatch: pytest.MonkeyPatch, cpu_per_look: list[float | None]) -> float:
    """Seconds of silence the broker counts after 10 s without a message, looking every
    0.5 s while the peer's main thread shows the given CPU times."""
    readings = iter(cpu_per_look)
    monkeypatch.setattr(liveness, "main_thread_cpu_s", lambda pid: next(readings, None))
    watch, quiet = liveness.BusyWatch(), 0.0
    for step in range(1, 21):
        quiet, _ = liveness.check(watch, now=step * 0.5, last_seen=0.0, pid=4242, heartbeat_s=1.0)
    return quiet


def test_a_peer_whose_cpu_time_stands_still_is_dead_on_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a deadlocked rank: alive to the kernel, never gaining a tick
    assert quiet_after(monkeypatch, [3.0] * 20) > SILENCE


def test_a_peer_whose_cpu_time_grows_is_busy_not_dead(monkeypatch: pytest.MonkeyPatch) -> None:
    assert quiet_after(monkeypatch, [3.0 + i for i in range(20)]) < SILENCE


def test_a_stopped_or_gone_peer_is_dead_on_time(monkeypatch: pytest.MonkeyPatch) -> None:
    assert quiet_after(monkeypatch, [None] * 20) > SILENCE


def test_a_peer_that_stops_computing_is_dead_one_silence_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # busy for the first 3 s of the spell, then stuck: dead 5 s after it last computed
    assert quiet_after(monkeypatch, [float(i) for i in range(6)] + [5.0] * 14) > SILENCE
