"""Placement against a real broker: when the node is full, an idle group of another spec
is evicted (least recently used first) so a waiting spec can start."""

from __future__ import annotations

from pathlib import Path

from conftest import start_broker, stop_broker

from cpq import Client

ROOT = str(Path(__file__).resolve().parents[1])


def test_idle_group_of_another_spec_is_evicted_when_ranks_are_short(tmp_path: Path) -> None:
    # Memory for one CPU group only: the second spec can start only by evicting the first
    # (groups kept within --memory are test_spares' subject).
    process, endpoint = start_broker(tmp_path / "state", "--max-ranks", "2", "--memory", "0")
    try:
        with Client(endpoint) as client:
            first = client.submit(
                "workers.collectives:rank_info", 2, roots=[ROOT], env={"CPQ_TEST_POOL": "a"}
            )
            assert first.outcome == "passed", first
            second = client.submit(
                "workers.collectives:rank_info", 2, roots=[ROOT], env={"CPQ_TEST_POOL": "b"}
            )
            assert second.outcome == "passed", second
            assert second.group_id != first.group_id
            status = client.status()
        assert status["totals"]["groups_started"] == 2
        pools = {p["id"]: p for p in status["pools"]}
        assert first.group_id not in pools or pools[first.group_id]["state"] == "stopping"
        assert pools[second.group_id]["env"]["CPQ_TEST_POOL"] == "b"
        log = (tmp_path / "state" / "logs" / "broker.log").read_text()
        assert f"evicting idle group {first.group_id}" in log
    finally:
        stop_broker(process)
