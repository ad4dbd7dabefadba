"""Sharding through real pytest sessions (``pytester``), unmarked tests: no broker needed."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from cpq.fanout import cli

pytest_plugins = ["pytester"]

#: Only cpq's plugin (and xdist where asked): each session then starts in well under a second.
BASE = ("-p", "cpq.client.plugin", "-p", "no:cacheprovider")


@pytest.fixture(autouse=True)
def _no_autoload(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("CPQ_RUN_ID", "run-1")  # shards started by hand: one run id for all


SUITE = """
import pytest

@pytest.mark.parametrize("n", range(12))
def test_case(n):
    assert n != 7 or FAIL_SEVEN is False

def test_skipped():
    pytest.skip("not here")

FAIL_SEVEN = False
"""


def manifests(directory: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(directory.glob("shard-*.json"))]


def test_three_shards_cover_the_suite_once_and_merge(
    pytester: pytest.Pytester, capsys: pytest.CaptureFixture[str]
) -> None:
    pytester.makepyfile(test_suite=SUITE)
    results = pytester.path / "out"
    outcomes = []
    for index in range(3):
        run = pytester.runpytest_subprocess(
            *BASE, f"--cpq-shard={index}/3", f"--cpq-results={results}"
        )
        outcomes.append(run.parseoutcomes())
        run.stdout.fnmatch_lines([f"*cpq fan-out: shard {index}/3 ran * of 13 tests*"])
    assert sum(o.get("passed", 0) for o in outcomes) == 12
    assert sum(o.get("skipped", 0) for o in outcomes) == 1
    assert sorted(o["deselected"] for o in outcomes) == [8, 9, 9]
    data = manifests(results)
    assert [d["index"] for d in data] == [0, 1, 2]
    assert sorted(i for d in data for i in d["selected"]) == sorted(data[0]["collected"])
    assert all(d["complete"] for d in data)
    assert (results / "shard-2-of-3.xml").exists()
    assert cli.main([str(results)]) == 0
    assert "every collected test ran exactly once and passed" in capsys.readouterr().out


def test_xdist_workers_agree_on_the_share(pytester: pytest.Pytester) -> None:
    """Every xdist worker deselects the same tests; the controller writes the results."""
    pytester.makepyfile(test_suite=SUITE)
    results = pytester.path / "out"
    plain = pytester.runpytest_subprocess(*BASE, "--cpq-shard=1/2", f"--cpq-results={results}/a")
    spread = pytester.runpytest_subprocess(
        *BASE, "-p", "xdist.plugin", "-n", "2", "--cpq-shard=1/2", f"--cpq-results={results}/b"
    )
    assert plain.parseoutcomes()["passed"] == spread.parseoutcomes()["passed"] > 0
    (a,) = manifests(results / "a")
    (b,) = manifests(results / "b")
    assert a["selected"] == b["selected"] and a["partition_hash"] == b["partition_hash"]
    assert set(b["tests"]) == set(b["selected"]) and b["complete"]


def test_durations_balance_and_write_back(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_suite=SUITE)
    durations = pytester.path / "d.json"
    slow = "test_suite.py::test_case[0]"
    recorded = {f"test_suite.py::test_case[{n}]": 1.0 for n in range(12)}
    recorded |= {slow: 100.0, "test_suite.py::test_skipped": 1.0}
    durations.write_text(json.dumps(recorded))
    run = pytester.runpytest_subprocess(
        *BASE, "--cpq-shard=0/2", f"--cpq-durations={durations}", "-v"
    )
    run.assert_outcomes(passed=1, deselected=12)  # 100 s alone outweighs the other twelve
    assert f"{slow} PASSED" in run.stdout.str()
    assert (pytester.path / ".cpq" / "results" / "shard-0-of-2.json").exists()  # the default
    single = pytester.runpytest_subprocess(
        *BASE, "--cpq-write-durations", f"--cpq-durations={durations}"
    )
    single.assert_outcomes(passed=12, skipped=1)
    written = json.loads(durations.read_text())
    assert len(written) == 13 and written[slow] < 100.0


def test_failures_and_bad_options(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_suite=SUITE.replace("FAIL_SEVEN = False", "FAIL_SEVEN = True"))
    results = pytester.path / "out"
    for index in range(2):
        pytester.runpytest_subprocess(
            *BASE, f"--cpq-shard={index}/2", "--cpq-results", str(results)
        )
    assert cli.main(["--junit", str(results / "all.xml"), str(results)]) == 1
    assert 'message="assert' in (results / "all.xml").read_text()
    bad = pytester.runpytest_subprocess(*BASE, "--cpq-shard=2/2")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    bad.stderr.fnmatch_lines(["*shard index 2 is not in 0..1*"])
    (pytester.path / "broken.json").write_text("[1]")
    bad = pytester.runpytest_subprocess(*BASE, "--cpq-shard=0/2", "--cpq-durations=broken.json")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    bad.stderr.fnmatch_lines(["*broken.json: expected a JSON object*"])
    empty = pytester.runpytest_subprocess(
        *BASE, "-k", "test_skipped", "--cpq-shard=1/2", f"--cpq-results={pytester.path}/e"
    )
    assert empty.ret == pytest.ExitCode.OK  # an empty share is not "no tests collected"
    plain = pytester.runpytest_subprocess(*BASE)
    assert plain.ret == pytest.ExitCode.TESTS_FAILED
    assert not (pytester.path / ".cpq").exists()  # a plain run leaves no result files


KILLED = """
import os
import time

def test_a():
    pass

def test_b():
    time.sleep(1.2)  # past the manifest's batching interval: a and b are on disk after it

def test_c():
    if not os.path.exists("fixed"):
        os._exit(1)  # the node dies: no session end, no final manifest

def test_d():
    pass
"""


def test_a_killed_shard_keeps_what_it_ran_and_no_earlier_result(
    pytester: pytest.Pytester, capsys: pytest.CaptureFixture[str]
) -> None:
    pytester.makepyfile(test_suite=KILLED)
    results = pytester.path / "out"
    results.mkdir()
    stale = {"format": "cpq-shard-manifest/2", "run_id": "earlier", "complete": True}
    (results / "shard-0-of-1.json").write_text(json.dumps(stale))  # a reused directory
    (results / "shard-0-of-1.xml").write_text("<testsuites/>")
    run = pytester.runpytest_subprocess(*BASE, "--cpq-shard=0/1", f"--cpq-results={results}")
    assert run.ret == 1
    (data,) = manifests(results)
    assert data["run_id"] == "run-1" and data["complete"] is False
    assert sorted(data["tests"]) == ["test_suite.py::test_a", "test_suite.py::test_b"]
    assert not (results / "shard-0-of-1.xml").exists()  # the earlier run's, cleared at start
    assert data["wall_s"] >= 1.2 and data["spawns"] == 0  # what it ran, until its last write
    assert cli.main([str(results)]) == 2
    out = capsys.readouterr().out
    assert "MISSING (2): test_suite.py::test_c, test_suite.py::test_d" in out
    assert re.search(r"^  0/1 +\S+ +2/4 +0 +1\.[2-9] .*UNFINISHED$", out, re.M), out

    # The shard again, in the same run (a requeue): it replaces the result, and the lost
    # attempt stays in the summary.
    (pytester.path / "fixed").touch()
    run = pytester.runpytest_subprocess(*BASE, "--cpq-shard=0/1", f"--cpq-results={results}")
    assert run.ret == 0
    ((data,),) = (manifests(results),)
    assert [(a["tests"], a["complete"]) for a in data["attempts"]] == [(2, False)]
    assert cli.main([str(results)]) == 0
    assert re.search(r"^   attempt 0 +\S+ +2 .* lost$", capsys.readouterr().out, re.M)


MODULES = {
    "test_one": "import pytest\n\n@pytest.mark.parametrize('n', range(4))\ndef test_a(n):\n"
    "    pass\n",
    "test_two": "def test_b():\n    pass\n\ndef test_c():\n    pass\n",
    "test_three": "class TestK:\n    def test_d(self):\n        pass\n\n    def test_e(self):\n"
    "        pass\n\n\ndef test_f():\n    pass\n\ndef test_g():\n    pass\n",
}


def selections(results: Path) -> list[set[str]]:
    return [set(d["selected"]) for d in manifests(results)]


@pytest.mark.parametrize(
    ("how", "by"),
    [
        (("--cpq-shard-by=module",), "module"),
        (("--cpq-shard-by", "class"), "class"),
        ((), "module"),  # CPQ_SHARD_BY
        (("-o", "cpq_shard_by=module"), "module"),  # the ini option
    ],
)
def test_shard_by_keeps_a_module_or_a_class_on_one_shard(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, how: tuple[str, ...], by: str
) -> None:
    pytester.makepyfile(**MODULES)
    if not how:
        monkeypatch.setenv("CPQ_SHARD_BY", "module")
    results = pytester.path / "out"
    for index in range(3):
        run = pytester.runpytest_subprocess(
            *BASE, *how, f"--cpq-shard={index}/3", f"--cpq-results={results}"
        )
        assert run.ret == 0, run.stdout.str()
    shards = selections(results)
    assert sorted(i for s in shards for i in s) == sorted(manifests(results)[0]["collected"])
    whole = ["test_one.py", "test_two.py", "test_three.py"]
    if by == "class":
        whole = ["test_three.py::TestK"]
        loose = {i for s in shards for i in s if i.startswith("test_one.py")}
        assert len([s for s in shards if s & loose]) > 1  # a module's functions spread
    for unit in whole:
        assert len([s for s in shards if any(i.startswith(unit) for i in s)]) == 1, (unit, shards)
    assert {d["shard_by"] for d in manifests(results)} == {by}
    assert cli.main([str(results)]) == 0


def test_a_bad_shard_by_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(**MODULES)
    bad = pytester.runpytest_subprocess(*BASE, "--cpq-shard=0/2", "--cpq-shard-by=file")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    bad.stderr.fnmatch_lines(["*invalid choice: 'file'*"])
    bad = pytester.runpytest_subprocess(*BASE, "--cpq-shard=0/2", "-o", "cpq_shard_by=scope")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    bad.stderr.fnmatch_lines(["*shard by 'scope'*expected one of test, module, class*"])


RERUN = """
import os
import time

import pytest

SECONDS = [0.3, 0.2] + [0.01] * 6


@pytest.mark.parametrize("n", range(len(SECONDS)))
def test_t(n):
    time.sleep(SECONDS[n])
    assert not (n == 3 and os.path.exists("broken")), "broken"
"""


@pytest.mark.parametrize("workers", [(), ("-n", "2")])
def test_a_rerun_shard_computes_its_runs_share_whatever_the_durations_say_now(
    pytester: pytest.Pytester, capsys: pytest.CaptureFixture[str], workers: tuple[str, ...]
) -> None:
    """The documented recovery, by hand: run, merge (which rewrites the durations file),
    rerun the failed shard with the run's id, merge again: the run's verdict."""
    pytester.makepyfile(test_suite=RERUN)
    (pytester.path / "broken").touch()
    results, learned = pytester.path / "out", pytester.path / "d.json"
    plugins = ("-p", "xdist.plugin") if workers else ()
    args = (*BASE, *plugins, *workers, f"--cpq-results={results}", f"--cpq-durations={learned}")
    for index in range(2):
        pytester.runpytest_subprocess(*args, f"--cpq-shard={index}/2")
    first = selections(results)
    merge = ["--durations", str(learned), "--junit", str(results / "junit.xml"), str(results)]
    assert cli.main(merge) == 1
    # What today's durations file would give: another partition (else the test proves nothing).
    from cpq.fanout.shard import TestInfo, partition

    collected = manifests(results)[0]["collected"]
    now = partition([TestInfo(i) for i in collected], 2, json.loads(learned.read_text()))
    assert [set(s) for s in now] != first
    failing = next(n for n, s in enumerate(first) if "test_suite.py::test_t[3]" in s)

    (pytester.path / "broken").unlink()
    capsys.readouterr()
    rerun = pytester.runpytest_subprocess(*args, f"--cpq-shard={failing}/2")
    assert rerun.ret == 0, rerun.stdout.str()
    rerun.stdout.fnmatch_lines(["*the partition run run-1 started with*"])
    assert selections(results) == first
    assert cli.main(merge) == 0, capsys.readouterr().out
    assert "every collected test ran exactly once and passed" in capsys.readouterr().out
