"""Spares on a real broker (issues 15, 20): a group that must be replaced is replaced at once.

A private broker keeps one clean spare group per used spec. Two ways a group must go —
an edit of a helper module the group imported (its ranks refuse the next task), and a
failing task whose stuck peer makes the broker recycle the group — and in both the next
task runs on the group that was already the idle spare when it was submitted: it waits
for no spawn.
"""

from __future__ import annotations

import os
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import start_broker, wait_for_status

from cpq import Client
from cpq.client.autostart import stop_broker

TARGETS = """
import time

import torch.distributed as dist

from spare_helper import value


def read():
    return value()


def fail_while_a_peer_hangs():
    if dist.get_rank() == 0:
        raise AssertionError("rank 0 fails")
    time.sleep(120)  # rank 1 is stuck: the broker recycles the group
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("spare-project")
    (root / "spare_targets.py").write_text(textwrap.dedent(TARGETS))
    (root / "spare_helper.py").write_text("def value():\n    return 1\n")
    return root


@pytest.fixture(scope="module")
def spare_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Client]:
    state = tmp_path_factory.mktemp("spare-broker")
    process, endpoint = start_broker(
        state, "--gpus", "none", "--max-ranks", "4", "--spares", "1", "--failure-grace", "1"
    )
    try:
        with Client(endpoint, name="test_spares") as client:
            yield client
    finally:
        stop_broker(process)


def idle_spares(client: Client, used: str) -> list[str]:
    """Wait (bounded) until the spec has an idle spare besides the used group ``used``."""

    def found(status: dict[str, Any]) -> bool:
        return any(p["spare"] and p["state"] == "idle" for p in status["pools"])

    status = wait_for_status(client, "idle spare", found, within=120)
    # a loaded CI box once showed two idle spares; either one serves the next task
    spares = [p["id"] for p in status["pools"] if p["spare"] and p["state"] == "idle"]
    assert used not in spares, (used, spares)
    return [str(spare) for spare in spares]


def run(client: Client, project: Path, function: str) -> Any:
    return client.submit(f"spare_targets:{function}", 2, roots=[str(project)], timeout=60)


def test_after_an_edit_of_a_helper_the_next_task_runs_on_the_spare(
    spare_client: Client, project: Path
) -> None:
    first = run(spare_client, project, "read")
    assert first.outcome == "passed" and first.value == 1
    spares = idle_spares(spare_client, first.group_id)
    helper = project / "spare_helper.py"
    helper.write_text("def value():\n    return 2\n")
    # Saved a second ago, as by an editor before the rerun (a file modified within 50 ms
    # before the task that imports it counts as changed at once, on the spare too).
    saved = time.time_ns() - 1_000_000_000
    os.utime(helper, ns=(saved, saved))
    second = run(spare_client, project, "read")
    assert second.outcome == "passed" and second.value == 2, second
    # the stale group ran nothing; a spare was ready
    assert len(second.groups) == 1 and second.groups[0] in spares
    pools = {p["id"]: p for p in spare_client.status()["pools"]}
    assert first.group_id not in pools or pools[first.group_id]["state"] == "stopping"


def test_an_idle_group_whose_code_changed_is_stopped_without_a_task(
    spare_client: Client, tmp_path: Path
) -> None:
    """Issue 37: a group for code that changed since it started goes when it is idle, not
    when a task next finds it stale; its stop reason names the file."""
    project = tmp_path / "idle-project"  # its own helper: the module's project is edited above
    project.mkdir()
    (project / "spare_targets.py").write_text(textwrap.dedent(TARGETS))
    (project / "spare_helper.py").write_text("def value():\n    return 1\n")
    first = run(spare_client, project, "read")
    assert first.outcome == "passed" and first.value == 1
    helper = project / "spare_helper.py"
    helper.write_text("def value():\n    return 2\n")
    saved = time.time_ns() - 1_000_000_000
    os.utime(helper, ns=(saved, saved))

    def stopped(status: dict[str, Any]) -> bool:
        pools = {p["id"]: p for p in status["pools"]}
        return first.group_id not in pools or pools[first.group_id]["state"] == "stopping"

    wait_for_status(spare_client, "the stale group stopped", stopped, within=60)
    log = (Path(spare_client.status()["broker"]["log_dir"]).parent / "broker.stdout").read_text()
    assert f"code changed since it started: {helper}" in log, log[-3000:]


def test_after_a_failure_that_recycled_a_group_the_next_task_runs_on_the_spare(
    spare_client: Client, project: Path
) -> None:
    warm = run(spare_client, project, "read")
    assert warm.outcome == "passed"
    spares = idle_spares(spare_client, warm.group_id)
    failing = run(spare_client, project, "fail_while_a_peer_hangs")
    assert failing.outcome == "failed" and "recycled" in failing.message, failing.message
    assert failing.group_id == warm.group_id
    following = run(spare_client, project, "read")
    assert following.outcome == "passed"
    assert len(following.groups) == 1 and following.groups[0] in spares


def test_idle_groups_live_in_memory_so_a_full_box_keeps_a_spare_per_spec(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Issues 20 and 29: a ws=1 and a ws=2 group use every core of a --max-ranks 3 box. An
    idle rank costs memory, not a core, so both specs still get a spare (within --memory,
    each group counting its measured RSS), and after an edit of a helper the ws=2 task runs
    on its spare at once: its verdict says it waited for no spawn. (Counted against cores,
    neither spare could start: tests/unit/test_spares.py.)"""
    project = tmp_path_factory.mktemp("spare-memory-project")  # its own helper to edit
    (project / "spare_targets.py").write_text(textwrap.dedent(TARGETS))
    (project / "spare_helper.py").write_text("def value():\n    return 1\n")
    state = tmp_path_factory.mktemp("spare-memory-broker")
    process, endpoint = start_broker(
        state, "--gpus", "none", "--max-ranks", "3", "--memory", "8000"
    )
    try:
        with Client(endpoint, name="test_spare_memory") as client:
            for ws in (1, 2):
                warm = client.submit("spare_targets:read", ws, roots=[str(project)], timeout=60)
                assert warm.outcome == "passed", warm

            def both_spares(status: dict[str, Any]) -> bool:
                spares = [p for p in status["pools"] if p["spare"] and p["state"] == "idle"]
                return sorted(p["world_size"] for p in spares) == [1, 2]

            status = wait_for_status(client, "a spare per spec", both_spares, within=120)
            spares = {p["world_size"]: p for p in status["pools"] if p["spare"]}
            live = [p for p in status["pools"] if p["state"] != "stopping"]
            assert status["broker"]["memory_used_mb"] == pytest.approx(
                sum(sum(p["rss_mb"]) for p in status["pools"])
            )  # every live group counts its measured RSS
            assert sum(p["world_size"] for p in live) == 6  # 3 cores: twice as many ranks
            helper = project / "spare_helper.py"
            helper.write_text("def value():\n    return 3\n")
            saved = time.time_ns() - 1_000_000_000
            os.utime(helper, ns=(saved, saved))
            edited = client.submit("spare_targets:read", 2, roots=[str(project)], timeout=60)
            assert edited.outcome == "passed" and edited.value == 3, edited
            assert edited.groups == [spares[2]["id"]]
            assert edited.spawn_wait_s == 0.0
    finally:
        stop_broker(process)
