"""What a run leaves in its results directory: one run's files, readable as the umask says,
earlier attempts kept, and the broker options a shard chooses (no processes started)."""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest

from cpq.fanout import brokerargs, cli, durations, junit
from cpq.fanout.attempts import TimelineTail, carry_over
from cpq.fanout.manifest import Manifest, TestRecord, read

from .test_merge import shard_results, write_results


@pytest.fixture
def umask_027() -> Iterator[None]:
    old = os.umask(0o027)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.usefixtures("umask_027")
def test_every_file_of_a_run_gets_the_users_umask(tmp_path: Path) -> None:
    directory = write_results(tmp_path, shard_results())
    junit.write(directory / "shard-0-of-3.xml", shard_results()[:1])
    out = tmp_path / "out"
    args = ["--junit", str(out / "junit.xml"), "--durations", str(out / "durations.json")]
    assert cli.main([*args, str(directory)]) == 0
    files = [*directory.iterdir(), *out.iterdir()]
    assert len(files) == 6
    assert {oct(p.stat().st_mode & 0o777) for p in files} == {"0o640"}  # 0666 less 027


def record(tests: int, **fields: object) -> Manifest:
    ids = [f"t{n}" for n in range(4)]
    shard = Manifest(
        index=0, count=1, collection_hash="c", partition_hash="p", collected=ids, selected=ids,
        run_id="r", hostname="n2", wall_s=15.0, spawns=1,
        tests={i: TestRecord("passed", 5.0) for i in ids[:tests]},
    )  # fmt: skip
    for key, value in fields.items():
        setattr(shard, key, value)
    return shard


def test_a_shard_keeps_its_runs_lost_attempt_and_clears_another_runs(tmp_path: Path) -> None:
    lost = record(3)
    lost.write(tmp_path)
    (tmp_path / "shard-0-of-1.timeline.jsonl").write_text('{"ev": "broker", "t": 1}\n')
    (tmp_path / "shard-0-of-1.xml").write_text("<testsuites/>")
    (attempt,) = carry_over(tmp_path, 0, 1, "r")
    assert (attempt.tests, attempt.complete, attempt.wall_s, attempt.hostname) == (
        3, False, 15.0, "n2"
    )  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-0-of-1.attempt-0.timeline.jsonl"]
    assert attempt.timeline == "shard-0-of-1.attempt-0.timeline.jsonl"

    again = record(4, complete=True, attempts=[attempt], restart_count=1)  # lost, no timeline
    again.write(tmp_path)
    earlier = carry_over(tmp_path, 0, 1, "r")
    assert [(a.restart_count, a.timeline) for a in earlier] == [
        (0, "shard-0-of-1.attempt-0.timeline.jsonl"), (1, "")
    ]  # fmt: skip
    assert read(again.write(tmp_path)).attempts == [attempt]  # they travel in the manifest

    record(4, run_id="earlier").write(tmp_path)  # a reused directory: another run's files
    (tmp_path / "shard-0-of-1.attempt-0.timeline.jsonl").write_text("")
    assert carry_over(tmp_path, 0, 1, "r") == []
    assert list(tmp_path.iterdir()) == []


def test_timeline_tail_appends_whole_new_records_of_the_session(tmp_path: Path) -> None:
    source, out = tmp_path / "history.jsonl", tmp_path / "shard.timeline.jsonl"
    source.write_text('{"ev": "ready", "t": 5}\n{"ev": "spawn", "t": 10}\n{"ev": "rea')
    tail = TimelineTail(source, out, since=10)
    assert tail.flush() == 1  # the older record is another session's, the torn one waits
    with source.open("a") as handle:
        handle.write('dy", "t": 11}\n')
    assert tail.flush() == 1 and tail.flush() == 0
    assert [json.loads(line)["t"] for line in out.read_text().splitlines()] == [10, 11]
    assert TimelineTail(tmp_path / "none", out, 0).flush() == 0  # no broker history here


@pytest.mark.parametrize(
    ("given", "specs", "expected"),
    [
        ("", ["ws1", "ws1", None], "--spares 0"),
        ("--max-ranks 4", ["ws1"], "--spares 0 --max-ranks 4"),
        ("--max-tasks-per-group=5", ["ws2"] * 3, "--spares 0 --max-tasks-per-group=5"),
        ("--spares 1", ["ws1"], "--spares 1"),  # the user's choice
        ("--max-tasks-per-group 2", ["ws1", "ws2", "ws2", "ws2"], "--max-tasks-per-group 2"),
        ("--max-ranks '4", ["ws1"], "--max-ranks '4"),  # the autostart names the bad quote
    ],
)
def test_a_shard_keeps_a_spare_only_where_its_tests_will_use_it(
    given: str, specs: list[str | None], expected: str
) -> None:
    env = {brokerargs.BROKER_ARGS_VAR: given} if given else {}
    brokerargs.configure_spares(env, specs)
    assert env[brokerargs.BROKER_ARGS_VAR] == expected


def test_junit_names_its_run_and_gives_each_test_its_own_time(tmp_path: Path) -> None:
    shard = record(0, spawn_s={"ws2": 5.0})
    shard.tests = {
        "t0": TestRecord("passed", 7.0, spawn_wait_s=5.0),  # waited for cpq.run in its wall
        "t1": TestRecord("passed", 2.0, spawn_wait_s=5.0, wait_in_wall=False),  # the ranks'
        "t2": TestRecord("failed", 1.0, message="boom"),
    }
    junit.write(tmp_path / "j.xml", [shard])
    root = ET.parse(tmp_path / "j.xml").getroot()
    assert (root.get("name"), root.get("tests"), root.get("failures")) == ("cpq run r", "3", "1")
    props = {p.get("name"): p.get("value") for p in root.iter("property")}
    assert props["cpq_run_id"] == "r" and props["cpq_spawn_wait_s"] == "5.000"
    times = {c.get("name"): c.get("time") for c in root.iter("testcase")}
    assert times == {"t0": "2.000", "t1": "2.000", "t2": "1.000"}


def test_an_incomplete_merge_leaves_no_junit_or_timeline_of_an_earlier_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = shard_results()
    results.pop()
    directory = write_results(tmp_path, results)
    earlier = {name: tmp_path / name for name in ("junit.xml", "timeline.html", "trace.json")}
    for path in earlier.values():
        path.write_text("an earlier run's")
    learned = tmp_path / "durations.json"
    durations.write_json_atomic(learned, {"t": 1.0})
    args = [f"--{n.split('.')[0]}={p}" for n, p in earlier.items()]
    assert cli.main([*args, f"--durations={learned}", str(directory)]) == 2
    assert not any(p.exists() for p in earlier.values())
    assert f"removed {earlier['junit.xml']}" in capsys.readouterr().out
    assert durations.load(learned) == {"t": 1.0}  # what earlier runs taught: kept
    assert cli.main(["--run-id", "r", str(tmp_path / "empty")]) == 4  # no such directory
    (tmp_path / "empty").mkdir()
    assert cli.main(["--run-id", "r", str(tmp_path / "empty")]) == 2  # all cancelled early
    assert "no results of run r" in capsys.readouterr().out


def test_a_runs_junit_is_replaced_only_by_a_complete_merge_of_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rerun of one shard that is cancelled midway leaves its run's earlier verdict in
    place; a merge of another run removes it, whatever that merge's verdict."""
    results = shard_results()
    for shard in results:
        shard.run_id = "run-a"
    directory = write_results(tmp_path, results)
    out = tmp_path / "junit.xml"
    assert cli.main(["--junit", str(out), str(directory)]) == 0
    assert ET.parse(out).getroot().get("name") == "cpq run run-a"
    written = out.read_bytes()

    results[1].complete = False  # the rerun of shard 1, cancelled midway
    results[1].write(directory)
    assert cli.main(["--junit", str(out), "--run-id", "run-a", str(directory)]) == 2
    assert out.read_bytes() == written, "a complete verdict of the run stays"
    assert "kept" in capsys.readouterr().out
    assert cli.main(["--junit", str(out), str(directory)]) == 2  # the run found, not given
    assert out.read_bytes() == written

    results[1].complete = True  # the rerun again, to its end: a new complete verdict
    results[1].tests[results[1].selected[0]] = TestRecord("failed", 1.0, message="no")
    results[1].write(directory)
    assert cli.main(["--junit", str(out), str(directory)]) == 1
    assert b'message="no"' in out.read_bytes()

    results[0].run_id = "run-b"  # another run's merge (incomplete): run-a's file goes
    results[0].write(directory)
    assert cli.main(["--junit", str(out), "--run-id", "run-b", str(directory)]) == 2
    assert not out.exists()


def test_junit_says_what_pytests_junit_says(tmp_path: Path) -> None:
    """Messages and types as ``_pytest.junitxml`` writes them (the records come from real
    sessions in test_pytest_fidelity.py; here each kind once)."""
    records = {
        "t.py::test_setup": TestRecord("error", 0.1, message="ValueError: x", when="setup"),
        "t.py::test_teardown": TestRecord("error", 0.1, message="OSError", when="teardown"),
        "t.py::test_fail": TestRecord("failed", 0.1, message="assert 1 == 2", when="call"),
        "t.py::test_xfail": TestRecord("skipped", 0.1, message="bug 12", kind="pytest.xfail"),
        "t.py::test_skip": TestRecord(
            "skipped", 0.1, message="no gpu", details="t.py:3: no gpu", kind="pytest.skip"
        ),
    }
    shard = record(0, selected=list(records), collected=list(records))
    shard.tests = records
    junit.write(tmp_path / "j.xml", [shard])
    got = {
        c.get("name"): [(e.tag, e.get("type"), e.get("message"), e.text) for e in c]
        for c in ET.parse(tmp_path / "j.xml").iter("testcase")
    }
    assert got == {
        "test_setup": [("error", None, 'failed on setup with "ValueError: x"', None)],
        "test_teardown": [("error", None, 'failed on teardown with "OSError"', None)],
        "test_fail": [("failure", None, "assert 1 == 2", None)],
        "test_xfail": [("skipped", "pytest.xfail", "bug 12", None)],
        "test_skip": [("skipped", "pytest.skip", "no gpu", "t.py:3: no gpu")],
    }


def test_the_message_is_the_exception_never_cpqs_line_about_the_ranks() -> None:
    """A report of a test the ranks ran may be text only (a rank's plain-text report with
    cpq's sections after it): its message is the text before them, or its ``E`` lines
    where cpq's line about the ranks is all the text says first."""
    from types import SimpleNamespace

    from cpq.fanout.plugin import _crash

    trailer = "failed on rank(s) [0, 1] of 2 (group g1); the report above is rank 0's"
    plain = SimpleNamespace(longrepr=f"no device here\n{'-' * 20} cpq {'-' * 20}\n{trailer}")
    plain.longreprtext = plain.longrepr
    assert _crash(plain) == "no device here"  # type: ignore[arg-type]
    text = f"    def test():\n>       setup()\nE       ValueError: boom\nE       more\n\n{trailer}"
    crash = SimpleNamespace(message=f"cpq: {trailer}")
    ranks = SimpleNamespace(longrepr=SimpleNamespace(reprcrash=crash), longreprtext=text)
    assert _crash(ranks) == "ValueError: boom\nmore"  # type: ignore[arg-type]
