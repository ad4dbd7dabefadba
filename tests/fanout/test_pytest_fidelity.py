"""A fanned-out suite's results say what a plain pytest run says, and its group starts are
spawn time: real pytest sessions as shards, real brokers and groups (gloo on CPU).

* The merged JUnit of shards whose tests ran on the ranks (``--cpq-world-size 2``) carries
  pytest's own types and messages (xfail, skip, setup and teardown errors, failures),
  compared with ``pytest --junitxml`` of the same suite run plainly.
* A ``--cpq-torchrun`` suite in two shards, each with its node's own broker: the seconds
  each shard waited for its launches' group to start are its summary's ``wait s`` (equal
  to the group's start in the broker's timeline) and stay out of the learnt durations.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from conftest import start_broker

from cpq.client.autostart import stop_broker
from cpq.fanout import cli

pytest_plugins = ["pytester"]

BASE = ("-p", "cpq.client.plugin", "-p", "no:cacheprovider")

OUTCOMES = """
import pytest


@pytest.fixture
def broken():
    raise ValueError("boom in setup")


@pytest.fixture
def refused():
    pytest.fail("no device here", pytrace=False)


@pytest.fixture
def leaky():
    yield
    raise OSError("left a file behind")


def test_pass():
    pass


@pytest.mark.xfail(reason="known bug 12")
def test_xfail():
    assert False


def test_setup_error(broken):
    pass


def test_setup_fail(refused):
    pass


def test_teardown_error(leaky):
    pass


def test_fail():
    assert 1 == 2, "one is not two"


def test_skip():
    pytest.skip("not here")


@pytest.mark.xfail(reason="strict one", strict=True)
def test_xpass_strict():
    pass
"""


def verdicts(path: Path) -> dict[str, list[tuple[str, str | None, str | None]]]:
    """Per test name: the failure/error/skipped elements' (tag, type, message)."""
    return {
        str(case.get("name")): [
            (e.tag, e.get("type"), e.get("message"))
            for e in case
            if e.tag in ("failure", "error", "skipped")
        ]
        for case in ET.parse(path).iter("testcase")
    }


@pytest.fixture
def _plain_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("CPQ_RUN_ID", "run-1")


@pytest.mark.usefixtures("_plain_plugins", "broker")
def test_merged_junit_of_shards_on_the_ranks_is_pytests(
    pytester: pytest.Pytester, capsys: pytest.CaptureFixture[str]
) -> None:
    pytester.makepyfile(test_suite=OUTCOMES)
    plain = pytester.runpytest_subprocess(*BASE, "--junitxml=plain.xml")
    assert plain.ret == 1
    results = pytester.path / "out"
    for index in range(2):
        pytester.runpytest_subprocess(
            *BASE, "--cpq-world-size=2", f"--cpq-shard={index}/2", f"--cpq-results={results}"
        )
    merged = results / "junit.xml"
    assert cli.main(["--junit", str(merged), str(results)]) == 1, capsys.readouterr().out
    expected = verdicts(pytester.path / "plain.xml")
    assert expected["test_xfail"] == [("skipped", "pytest.xfail", "known bug 12")]  # the oracle
    assert expected["test_setup_error"] == [
        ("error", None, 'failed on setup with "ValueError: boom in setup"')
    ]
    assert verdicts(merged) == expected
    ran = [json.loads(p.read_text()) for p in sorted(results.glob("shard-*.json"))]
    assert all(d["spawns"] or not d["tests"] for d in ran) and sum(d["spawns"] for d in ran) >= 1


TRAIN = """
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
print(f"SUM {t.item()} ON {dist.get_rank()}")
dist.destroy_process_group()
"""

LAUNCHES = """
import pathlib
import subprocess
import time

import pytest


@pytest.mark.parametrize("n", range(4))
def test_launch(n):
    start = time.monotonic()
    done = subprocess.run(
        ["torchrun", "--nproc-per-node", "2", "train.py"], capture_output=True, text=True,
        timeout=300,
    )
    pathlib.Path(f"wall-{n}.txt").write_text(str(time.monotonic() - start))  # the launch's
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("SUM 2.0") == 2
"""


def group_starts(timeline: Path) -> float:
    """Seconds the groups that started during a shard took (ready minus spawn, per group),
    as its node's broker recorded them."""
    records = [json.loads(line) for line in timeline.read_text().splitlines() if line.strip()]
    spawned = {r["group"]: r["t"] for r in records if r.get("ev") == "spawn"}
    ready = {r["group"]: r["t"] for r in records if r.get("ev") == "ready"}
    return sum(ready[g] - t for g, t in spawned.items() if g in ready)


def test_group_starts_of_torchrun_launches_are_spawn_waits_not_test_time(
    pytester: pytest.Pytester, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytester.makepyfile(test_launches=LAUNCHES, train=TRAIN)
    results, learned = pytester.path / "out", pytester.path / "durations.json"
    for index in range(2):  # two nodes: a broker each, started fresh
        state = tmp_path / f"node{index}"
        process, endpoint = start_broker(state, "--spares", "0")
        env = dict(os.environ, CPQ_ENDPOINT=endpoint, CPQ_STATE_DIR=str(state))
        env.update(CPQ_RUN_ID="run-t", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
        env.pop("CPQ_TORCHRUN", None)
        try:
            done = subprocess.run(
                [sys.executable, "-m", "pytest", *BASE, "--cpq-torchrun", "-q",
                 f"--cpq-shard={index}/2", f"--cpq-results={results}"],
                cwd=pytester.path, env=env, capture_output=True, text=True, timeout=600,
            )  # fmt: skip
        finally:
            stop_broker(process)
        assert done.returncode == 0, done.stdout + done.stderr
    walls = {
        f"test_launches.py::test_launch[{n}]": float((pytester.path / f"wall-{n}.txt").read_text())
        for n in range(4)
    }
    code = cli.main(["--durations", str(learned), str(results)])
    summary = capsys.readouterr().out
    assert code == 0, summary
    learnt = json.loads(learned.read_text())
    for index in range(2):
        data: dict[str, Any] = json.loads((results / f"shard-{index}-of-2.json").read_text())
        waited = sum(data["spawn_s"].values())
        starts = group_starts(results / f"shard-{index}-of-2.timeline.jsonl")
        print(f"shard {index}: wait {waited:.2f}s, group starts {starts:.2f}s, {data['tests']}")
        assert data["spawns"] == 1 and starts > 1.0, data
        assert abs(waited - starts) <= 0.5 + 0.1 * starts, (waited, starts)
        row = re.search(rf"^  {index}/2 +\S+ +2/2 +0 +[0-9.]+ +1 +([0-9.]+) ", summary, re.M)
        assert row and abs(float(row[1]) - waited) <= 0.051, summary
        times = {t: learnt[t] for t in data["selected"]}
        first = max(data["tests"], key=lambda t: data["tests"][t]["spawn_wait_s"] or 0.0)
        other = next(t for t in times if t != first)
        # The test that launched first waited for the group: its wall holds the start, its
        # learnt seconds do not (a warm launch of the same script is the other test).
        assert walls[first] >= times[first] + 0.8 * starts, (walls, times)
        assert times[first] <= times[other] + 0.5 * starts, times
