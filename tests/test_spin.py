"""Spinning (``cpq.spin``) on a real broker and a real ws=2 gloo group: the broker, both
ranks and the client spin between messages, and the verdicts are those of the same tasks
without spinning. On CI's two cores spinning is off by default, so this turns it on
(``CPQ_SPIN_US`` in the broker's environment, which its ranks get, and in the client's);
and a bad value is refused with a clear error before the broker binds anything."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, start_broker

from cpq import Client
from cpq.broker.cli import EXIT_USAGE
from cpq.client.autostart import stop_broker

TASKS: list[tuple[str, dict[str, Any]]] = [
    ("workers.collectives:noop", {}),
    ("workers.collectives:all_reduce_check", {"numel": 64}),
    ("workers.collectives:fail_on_rank", {"rank": 1}),
    ("workers.collectives:skip_everywhere", {}),
    ("workers.collectives:getenv", {"names": ["CPQ_SPIN_US"]}),
]


def verdicts(state: Path, spin_us: str, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    monkeypatch.setenv("CPQ_SPIN_US", spin_us)  # the broker's is its ranks' too
    broker, endpoint = start_broker(state)
    try:
        with Client(endpoint, name="spin") as client:
            assert client._socket.spinner.window_s == int(spin_us) / 1e6
            seen = []
            for _ in range(2):  # the second round on the warm group, right after the first
                for target, kwargs in TASKS:
                    result = client.submit(target, 2, kwargs, roots=[str(ROOT)])
                    seen.append((target, result.outcome, [r.outcome for r in result.ranks]))
                    if target.endswith("getenv"):
                        assert result.ranks[0].value == {"CPQ_SPIN_US": spin_us}
    finally:
        stop_broker(broker)
    return seen


def test_spinning_ranks_broker_and_client_give_the_verdicts_of_blocking_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocking = verdicts(tmp_path / "blocking", "0", monkeypatch)
    spinning = verdicts(tmp_path / "spinning", "300", monkeypatch)
    assert spinning == blocking
    assert [outcome for _, outcome, _ in blocking[:5]] == [
        "passed", "passed", "failed", "skipped", "passed",
    ]  # fmt: skip
    log = (tmp_path / "spinning" / "logs" / "broker.log").read_text()
    assert "spinning 300 us after task traffic" in log
    rank_logs = list((tmp_path / "spinning" / "logs").glob("*rank*.log"))
    assert rank_logs and all("spinning 300 us after a report" in p.read_text() for p in rank_logs)


def test_a_bad_spin_window_is_refused_before_the_broker_serves(tmp_path: Path) -> None:
    env = dict(os.environ, CPQ_SPIN_US="fast", CPQ_STATE_DIR=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-m", "cpq.broker", "--endpoint", f"ipc://{tmp_path / 'b.sock'}"],
        env=env, capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == EXIT_USAGE, proc.stderr
    assert "CPQ_SPIN_US='fast': expected microseconds" in proc.stderr
    assert not (tmp_path / "b.sock").exists()
