"""The exactly-once check and ``cpq merge`` on manifests built in memory (no processes)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from cpq.fanout import cli, manifest
from cpq.fanout.manifest import Manifest, TestRecord
from cpq.fanout.merge import merge, render
from cpq.fanout.shard import TestInfo, digest, partition

COLLECTED = [f"tests/test_x.py::test_{i:02d}" for i in range(9)]


def shard_results(count: int = 3, durations: dict[str, float] | None = None) -> list[Manifest]:
    """What ``count`` shards that ran every test to a pass would write."""
    shards = partition([TestInfo(i, "ws2") for i in COLLECTED], count, durations or {})
    out = []
    for index, ids in enumerate(shards):
        out.append(
            Manifest(
                index=index,
                count=count,
                collection_hash=digest(sorted(COLLECTED)),
                partition_hash=digest([sorted(s) for s in shards]),
                collected=list(COLLECTED),
                selected=ids,
                complete=True,
                hostname=f"n{index}",
                wall_s=10.0 + index,
                spawns=1,
                spawn_s={"ws2": 4.0 + index},
                tests={i: TestRecord("passed", 1.0 + n) for n, i in enumerate(ids)},
            )
        )
    return out


def test_complete_run_passes_with_durations_and_balance() -> None:
    report = merge(shard_results())
    assert report.exit_code == 0, render(report)
    assert report.collected == COLLECTED
    assert set(report.durations) == {*COLLECTED, "cpq:spawn:ws2"}
    assert report.durations["cpq:spawn:ws2"] == 5.0  # the median over shards
    assert report.balance == pytest.approx(12 / 10)
    text = render(report)
    assert "balance: max/min shard wall = 1.20" in text
    assert "exit 0" in text


def test_a_failed_test_is_exit_1() -> None:
    results = shard_results()
    victim = results[1].selected[0]
    results[1].tests[victim] = TestRecord("failed", 1.0, message="assert 1 == 2")
    report = merge(results)
    assert (report.exit_code, report.failed) == (1, [victim])


def test_a_missing_shard_is_exit_2_naming_its_tests() -> None:
    results = shard_results()
    lost = results.pop(2)
    report = merge(results)
    assert report.exit_code == 2
    assert report.missing == [i for i in COLLECTED if i in lost.selected]
    assert "no result from shard(s) 2/3" in render(report)


def test_an_unfinished_shard_is_exit_2_even_when_failures_exist() -> None:
    results = shard_results()
    results[0].complete = False
    gone = results[0].selected[-1]
    del results[0].tests[gone]
    results[1].tests[results[1].selected[0]].outcome = "failed"
    report = merge(results)
    assert report.exit_code == 2  # incomplete wins over failed
    assert report.missing == [gone]
    assert "shard 0/3 on n0 did not finish" in render(report)


def test_duplicates_and_a_differing_partition_are_exit_2() -> None:
    results = shard_results()
    other = shard_results(durations={COLLECTED[4]: 9.0, COLLECTED[1]: 1.0})
    assert set(other[1].selected) != set(results[1].selected)  # another durations file
    results[1] = other[1]
    report = merge(results)
    assert report.exit_code == 2
    text = render(report)
    assert "different selections" in text
    assert report.duplicated or report.missing


def test_a_differing_collection_is_named() -> None:
    results = shard_results()
    results[2].collected = [*COLLECTED, "tests/test_x.py::test_new"]
    results[2].collection_hash = digest(sorted(results[2].collected))
    report = merge(results)
    assert report.exit_code == 2
    assert "differing tests: tests/test_x.py::test_new" in render(report)


def test_two_results_for_one_shard_are_exit_2() -> None:
    results = shard_results()
    results.append(results[0])
    assert merge(results).exit_code == 2


def write_results(tmp_path: Path, results: list[Manifest]) -> Path:
    directory = tmp_path / "results"
    for result in results:
        result.write(directory)
    return directory


def test_cli_writes_junit_and_updates_durations(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = write_results(tmp_path, shard_results())
    out_durations = tmp_path / "durations.json"
    out_durations.write_text(json.dumps({"tests/old.py::test_kept": 3.5}))
    junit_path = tmp_path / "merged.xml"
    code = cli.main(["--junit", str(junit_path), "--durations", str(out_durations), str(directory)])
    assert code == 0, capsys.readouterr()
    written = json.loads(out_durations.read_text())
    assert written["tests/old.py::test_kept"] == 3.5  # a test that did not run keeps its time
    assert set(COLLECTED) <= set(written)
    root = ET.parse(junit_path).getroot()
    names = sorted(f"{c.get('classname')}::{c.get('name')}" for c in root.iter("testcase"))
    assert names == sorted(i.replace("tests/test_x.py", "tests.test_x") for i in COLLECTED)
    assert len(root.findall("testsuite")) == 3


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not JSON"),
        ('{"format": "other"}', "not a cpq shard manifest"),
        ("[]", "expected a JSON object"),
    ],
)
def test_bad_manifests_are_exit_4_and_write_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, message: str
) -> None:
    directory = write_results(tmp_path, shard_results())
    (directory / "shard-1-of-3.json").write_text(content)
    durations = tmp_path / "durations.json"
    durations.write_text('{"kept": 1.0}')
    assert cli.main(["--durations", str(durations), str(directory)]) == 4
    assert message in capsys.readouterr().err
    assert json.loads(durations.read_text()) == {"kept": 1.0}


def test_a_bad_field_is_named(tmp_path: Path) -> None:
    data = shard_results()[0].to_json()
    data["tests"][COLLECTED[0]] = {"outcome": "exploded", "wall_s": 1}
    with pytest.raises(manifest.ManifestError, match="unknown outcome 'exploded'"):
        manifest.from_json(data, "x.json")


def test_a_malformed_durations_output_is_refused_before_writing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = write_results(tmp_path, shard_results())
    durations = tmp_path / "durations.json"
    durations.write_text('{"t": "slow"}')
    junit_path = tmp_path / "merged.xml"
    code = cli.main(["--junit", str(junit_path), "--durations", str(durations), str(directory)])
    assert code == 4
    assert "not a number of seconds" in capsys.readouterr().err
    assert not junit_path.exists()


def test_missing_inputs_are_exit_4(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([str(tmp_path / "nowhere")]) == 4
    assert "no such file or directory" in capsys.readouterr().err
    assert cli.main([str(tmp_path)]) == 4
    assert "no shard manifests" in capsys.readouterr().err


def test_the_measured_spawn_wait_comes_out_of_the_test_that_waited() -> None:
    results = shard_results()
    first = results[0].selected[0]
    results[0].tests[first] = TestRecord("passed", 9.0, spawn_wait_s=8.0)  # broker-measured
    report = merge(results)
    assert report.durations[first] == 1.0
    assert report.durations["cpq:spawn:ws2"] == 5.0  # the median of the shards' 4, 5 and 6
    unmeasured = results[1].selected[0]
    assert report.durations[unmeasured] == results[1].tests[unmeasured].wall_s  # kept as is


def two_runs(tmp_path: Path) -> tuple[Path, Path]:
    """Run "old" wrote shards 0 and 1 of 2; run "new" rewrote shard 0 only (shard 1 was
    cancelled before it wrote): the directory a reused ``CPQ_RESULTS`` holds then."""
    old = shard_results(count=2)
    new = shard_results(count=2)
    for m in old:
        m.run_id, m.started_at = "old", 100.0
    for m in new:
        m.run_id, m.started_at = "new", 200.0
    old[0].write(tmp_path)
    old[1].write(tmp_path)
    new[0].write(tmp_path)  # replaces old shard 0, as the shard's own files are
    return tmp_path / "shard-0-of-2.json", tmp_path / "shard-1-of-2.json"


def test_results_of_two_runs_are_exit_2_naming_the_stale_file_and_write_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, stale = two_runs(tmp_path)
    out = tmp_path / "out"
    args = ["--junit", str(out / "j.xml"), "--durations", str(out / "d.json"), str(tmp_path)]
    assert cli.main(args) == 2
    text = capsys.readouterr().out
    assert "results of 2 runs: the newest is new" in text
    assert f"run old: {stale}" in text
    assert "nothing written" in text and not out.exists()


def test_run_id_picks_one_run_and_lists_the_others(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, stale = two_runs(tmp_path)
    assert cli.main(["--run-id", "new", str(tmp_path)]) == 2  # its shard 1 never wrote
    text = capsys.readouterr().out
    assert f"ignored (other runs): {stale}" in text
    assert "no result from shard(s) 1/2" in text
    assert cli.main(["--run-id", "old", str(tmp_path / "shard-1-of-2.json")]) == 2
    assert cli.main(["--run-id", "gone", str(tmp_path)]) == 2
    assert "no results of run gone (runs found: new, old)" in capsys.readouterr().out


def test_an_internal_error_is_exit_3_never_a_test_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for m in shard_results():
        m.write(tmp_path)

    def broken(*args: object, **kwargs: object) -> str:
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli, "render", broken)
    assert cli.main([str(tmp_path)]) == 3
    assert "internal error (exit 3)" in capsys.readouterr().err


@pytest.mark.parametrize("status", [2, 3, 4])
def test_a_shard_that_ended_interrupted_or_broken_is_exit_2(status: int) -> None:
    results = shard_results()
    results[1].exitstatus = status
    report = merge(results)
    assert report.exit_code == 2, render(report)
    assert f"shard 1/3 ended with pytest exit status {status}" in render(report)


def test_a_shard_that_failed_without_a_failed_test_fails_the_merge() -> None:
    """A collection error under --continue-on-collection-errors is in no shard's tests (every
    shard collected without it): the shard's own exit status 1 still fails the run."""
    results = shard_results()
    for shard in results:
        shard.exitstatus = 0
    results[2].exitstatus = 1
    report = merge(results)
    assert report.exit_code == 1, render(report)
    assert "shard 2/3: pytest exit status 1 without a failed test" in render(report)
    results[2].exitstatus = 5  # no tests: fine
    assert merge(results).exit_code == 0


def test_the_next_durations_count_a_wait_only_where_the_wall_holds_it() -> None:
    """A test run in the pytest process waited for ``cpq.run`` inside its wall; a test the
    ranks ran through pytest reports the ranks' own time, so its wait is not taken off."""
    fixture = TestRecord(outcome="passed", wall_s=7.0, spawn_wait_s=5.0)
    on_ranks = TestRecord(outcome="passed", wall_s=2.0, spawn_wait_s=5.0, wait_in_wall=False)
    shard = Manifest(
        index=0, count=1, collection_hash="c", partition_hash="p", collected=["a", "b"],
        selected=["a", "b"], run_id="r", tests={"a": fixture, "b": on_ranks},
    )  # fmt: skip
    assert shard.durations() == {"a": 2.0, "b": 2.0}
    again = manifest.from_json(json.loads(json.dumps(shard.to_json())), "shard")
    assert again.tests["b"].wait_in_wall is False and again.tests["a"].wait_in_wall is True
