"""GPU leases: the lease files (real flock on a temporary directory) and two brokers on
fakes that share one lease directory and one clock."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from cpq.broker import leasedir
from cpq.broker.inventory import fake, resolve_uuids
from cpq.broker.leasedir import LeaseRefused
from cpq.broker.leases import Leases
from cpq.broker.loop import TICK_S
from cpq.broker.placement.yielding import STALE_S

from .fakes import Sim


def test_lease_files_are_made_0666_under_any_umask_in_a_1777_directory(tmp_path: Path) -> None:
    directory = tmp_path / "leases"
    old = os.umask(0o077)
    try:
        assert leasedir.ensure_dir(directory) == ""
        os.close(leasedir.open_lease(directory, "GPU-a"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o1777
    assert stat.S_IMODE((directory / "GPU-a.lease").stat().st_mode) == 0o666


def test_one_holder_at_a_time_and_the_lease_frees_when_the_holder_closes(tmp_path: Path) -> None:
    first = leasedir.try_lock(tmp_path, "GPU-a")
    assert first is not None
    assert leasedir.try_lock(tmp_path, "GPU-a") is None  # another open file: refused
    assert leasedir.is_held(tmp_path, "GPU-a") is True
    os.close(first)
    assert leasedir.is_held(tmp_path, "GPU-a") is False
    second = leasedir.try_lock(tmp_path, "GPU-a")
    assert second is not None
    os.close(second)


def test_a_planted_symlink_or_fifo_refuses_that_gpu_only(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("")
    (tmp_path / "GPU-fake-0.lease").symlink_to(target)
    os.mkfifo(tmp_path / "GPU-fake-1.lease")
    with pytest.raises(LeaseRefused, match="symlink"):
        leasedir.try_lock(tmp_path, "GPU-fake-0")
    leases = Leases(tmp_path, fake(3).uuids, "me")
    refused = leases.prepare(["0", "1", "2"])
    assert set(refused) == {"0", "1"}
    assert "is a symlink; refusing GPU GPU-fake-0" in refused["0"]
    assert "not a regular file; refusing GPU GPU-fake-1" in refused["1"]
    assert target.read_text() == ""  # nothing written through the link


def test_taking_is_all_or_nothing(tmp_path: Path) -> None:
    other = leasedir.try_lock(tmp_path, "GPU-fake-1")
    leases = Leases(tmp_path, fake(4).uuids, "me")
    assert not leases.take(["0", "1"], now=0.0)
    assert leases.held_elsewhere(now=0.0) == {"1"}  # what placement learns for its next try
    assert leasedir.is_held(tmp_path, "GPU-fake-0") is False  # what it got, it gave back
    assert leases.take(["0", "2"], now=1.0)
    assert leases.held_elsewhere(now=1.0) == set()  # not tried again: forgotten after a tick
    leases.drop(["0", "2"])
    assert leasedir.is_held(tmp_path, "GPU-fake-0") is False
    assert other is not None
    os.close(other)


def test_fake_inventory_and_uuid_lookup() -> None:
    inventory = fake(3)
    assert inventory.gpus == ["0", "1", "2"] and inventory.fake
    assert inventory.uuids["2"] == "GPU-fake-2"
    by_index = {"0": "GPU-aaa", "1": "GPU-bbb"}
    assert resolve_uuids(["1", "GPU-ccc", "7"], by_index) == {"1": "GPU-bbb", "GPU-ccc": "GPU-ccc"}


# --------------------------------------------------------------------------- two brokers


def two_brokers(tmp_path: Path) -> tuple[Sim, Sim]:
    config = {"gpus": ["0", "1"], "gpu_uuids": fake(2).uuids, "gpu_leases": tmp_path}
    a = Sim(endpoint="ipc:///fake/a.sock", **config)
    b = Sim(clock=a.clock, endpoint="ipc:///fake/b.sock", **config)
    return a, b


def test_an_idle_group_yields_to_another_brokers_waiting_task_within_two_ticks(
    tmp_path: Path,
) -> None:
    a, b = two_brokers(tmp_path)
    a.client()
    task = a.submit()
    a.bring_up("g1")
    a.finish_all("g1", task)
    assert a.states() == {"g1": "idle"}
    b.client()
    b.submit()
    assert b.broker.pools.groups == {}  # the GPUs are a's
    b.tick(TICK_S)  # publishes its want
    assert b.broker.status()["wants"][0]["this_broker"]
    a.tick(TICK_S)  # reads the want: stops its idle group
    assert a.states() == {"g1": "stopping"}
    assert "yielded its GPUs to" in a.broker.pools.groups["g1"].stop_reason
    a.tick(TICK_S)  # reaped: the lease is free
    b.tick(TICK_S)
    assert b.states() == {"g1": "starting"}
    assert b.broker.pools.groups["g1"].process.gpus == ["0", "1"]
    a.submit()  # a wants them back now, but b's task is older and b's group is busy
    b.bring_up("g1")
    for _ in range(4):
        a.tick(TICK_S)
        b.tick(TICK_S)
    assert b.states() == {"g1": "busy"}  # never interrupted
    assert a.broker.pools.groups == {}


def test_a_busy_group_is_never_stopped_for_a_want(tmp_path: Path) -> None:
    a, b = two_brokers(tmp_path)
    a.client()
    task = a.submit()
    a.bring_up("g1")
    assert a.running("g1") == task
    b.client()
    b.submit()
    for _ in range(int(3 * STALE_S / 0.5) + 1):
        b.tick(0.5)
        a.tick(TICK_S)
    assert a.states() == {"g1": "busy"}
    a.finish_all("g1", task)
    assert a.states() == {"g1": "stopping"}  # idle now: it yields at once


def test_a_broker_that_yielded_does_not_restart_its_spare_on_the_wanted_gpus(
    tmp_path: Path,
) -> None:
    a, b = two_brokers(tmp_path)
    for sim in (a, b):
        sim.config.spares = 1
    a.client()
    task = a.submit()
    a.bring_up("g1")
    a.finish_all("g1", task)
    b.client()
    b.submit()
    b.tick(TICK_S)
    a.tick(TICK_S)
    assert a.states()["g1"] == "stopping"
    a.tick(TICK_S)
    assert set(a.states()) == set()  # reaped; no spare took the GPUs back
    b.tick(TICK_S)
    assert b.states() == {"g1": "starting"}


def test_another_users_lease_file_opens_where_the_kernel_refuses_o_creat_on_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fs.protected_regular (systemd's default) refuses O_CREAT on an existing file another
    user owns in a sticky world-writable directory, even for root: the lease still opens."""
    directory = tmp_path / "leases"
    leasedir.ensure_dir(directory)
    os.close(leasedir.open_lease(directory, "GPU-a"))  # another user's, say
    real_open = os.open

    def protected_regular(path: object, flags: int, mode: int = 0o777) -> int:
        if flags & os.O_CREAT and os.path.exists(str(path)):
            raise PermissionError(13, "Permission denied")
        return real_open(path, flags, mode)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", protected_regular)
    fd = leasedir.try_lock(directory, "GPU-a")
    assert fd is not None
    os.close(fd)


def test_no_lease_is_trusted_in_a_linked_or_unsticky_directory(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    real.chmod(0o1777)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(LeaseRefused, match="symlink"):
        leasedir.ensure_dir(tmp_path / "link")
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    with pytest.raises(LeaseRefused, match="not sticky"):
        leasedir.ensure_dir(loose)
    leases = Leases(tmp_path / "link", {"0": "GPU-a"}, "me")
    assert "symlink" in leases.prepare(["0"])["0"]  # refused, and the broker serves on


@pytest.mark.parametrize(
    "junk",
    [b"[" * 60000, b'{"broker": "x", "refreshed": NaN, "wants": []}', b"\xff\xfe", b"{}" * 9],
    ids=["deeply-nested", "nan", "not-utf8", "not-one-object"],
)
def test_any_want_file_another_user_writes_is_read_or_ignored_never_raises(
    tmp_path: Path, junk: bytes
) -> None:
    from cpq.broker.placement import yielding

    (tmp_path / "want-x.json").write_bytes(junk)
    docs = leasedir.read_wants(tmp_path)
    assert yielding.parse_wants(docs, "me", 1e9) == []
