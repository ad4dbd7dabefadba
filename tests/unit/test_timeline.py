"""The timeline: what the broker records (on fakes, with a hand-driven clock), and the pure
building of runs, traces, pages and summaries from hand-made records."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from cpq import protocol
from cpq.timeline import records
from cpq.timeline.command import parse_time, select
from cpq.timeline.html import build_html
from cpq.timeline.run import WindowError, build, window
from cpq.timeline.summary import summarize
from cpq.timeline.trace import build_trace

from .fakes import Sim, spec
from .traces import check_trace, thread_names

# --------------------------------------------------------------------------- recording


def _recorded(sim: Sim, tmp_path: Path) -> list[dict[str, Any]]:
    sim.tick(0.05)  # the broker writes its events once per tick
    loaded = records.read(tmp_path / "timings.timeline.jsonl")
    assert loaded.skipped == 0
    return loaded.records


def test_the_broker_records_spawns_attempts_and_a_failed_group_where_they_happen(
    tmp_path: Path,
) -> None:
    sim = Sim(timings_file=tmp_path / "timings.jsonl")
    t0 = sim.clock.time()
    sim.client(b"c1", name="pytest", xdist_worker="gw0", pid=42, session="s1")
    sim.submit(test_id="t.py::a", pool_spec=spec(1))
    sim.tick(0.05)  # g1 is asked for
    spawned = sim.clock.time()
    sim.clock.advance(2.0)
    sim.bring_up("g1")  # ready: a runs at once
    sim.clock.advance(0.5)
    sim.finish_all("g1", "t1")
    sim.submit(test_id="t.py::b", pool_spec=spec(1))
    sim.processes["g1"].code = -9  # a rank dies during b
    sim.tick(0.05)  # g1 fails; b is retried on a fresh g2
    sim.bring_up("g2")
    sim.finish_all("g2", "t2")
    got = _recorded(sim, tmp_path)

    kinds = [r["ev"] for r in got]
    assert kinds[0] == "broker" and kinds.count("spawn") == 2 and kinds.count("task") == 3
    (hello,) = [r for r in got if r["ev"] == "hello"]
    assert hello["client"] == "pytest gw0 (pid 42)" and hello["session"] == "s1"
    spawn1 = next(r for r in got if r["ev"] == "spawn" and r["group"] == "g1")
    ready1 = next(r for r in got if r["ev"] == "ready" and r["group"] == "g1")
    assert spawn1["t"] == pytest.approx(spawned) and ready1["t"] == pytest.approx(spawned + 2.0)
    a, b1, b2 = (r for r in got if r["ev"] == "task")
    assert (a["test"], a["outcome"], a["group"], a["first"]) == ("t.py::a", "passed", "g1", True)
    assert a["queued"] == pytest.approx(t0) and a["started"] == pytest.approx(ready1["t"])
    assert a["t"] - a["started"] == pytest.approx(0.5)
    assert b1["group"] == "g1" and b1["outcome"].startswith("retried: torchrun exited")
    assert b1["first"] is False and b1["attempt"] == 1
    assert (b2["group"], b2["attempt"], b2["first"], b2["outcome"]) == ("g2", 2, True, "passed")
    assert b2["session"] == "s1" and b2["client"] == "pytest gw0 (pid 42)"
    stop1 = next(r for r in got if r["ev"] == "stop" and r["group"] == "g1")
    assert stop1["cause"] == "failed" and "status -9" in stop1["reason"]
    assert any(r["ev"] == "gone" and r["group"] == "g1" for r in got)

    # The failed attempt's slice ends where its group was stopped: no overlap on g1's track.
    trace = build_trace([select(build(got), "all", None, None)])
    slices = check_trace(trace)
    tasks = [e for track in slices.values() for e in track if e["cat"] in ("task", "warm-up")]
    assert sorted(e["name"] for e in tasks) == ["t.py::a", "t.py::b", "t.py::b"]


def test_a_timed_out_test_is_recorded_failed_as_pytest_reports_it(tmp_path: Path) -> None:
    """Its verdict is cpq's ``error`` (cause ``deadline``); pytest reports the test FAILED
    (pytest-timeout's failure, or cpq's in the call phase): the page colours it failed."""
    sim = Sim(timings_file=tmp_path / "timings.jsonl", stack_wait_s=1.0)
    sim.client(b"c1", name="pytest", session="s1", features=sorted(protocol.ALL_FEATURES))
    hung = sim.submit(test_id="t.py::hangs", pool_spec=spec(1), timeout=5, retries=0)
    sim.bring_up("g1")
    sim.tick(5.1)
    sim.stacks("g1", 0, hung, "in recv")
    assert (sim.done()[hung].outcome, sim.done()[hung].cause) == ("error", "deadline")
    (record,) = [r for r in _recorded(sim, tmp_path) if r["ev"] == "task"]
    assert (record["test"], record["outcome"]) == ("t.py::hangs", "failed")
    page = build_html([select(build(_recorded(sim, tmp_path)), "all", None, None)], "t")
    assert "fill='#e53935'><title>t.py::hangs\nfailed," in page  # pytest's red, not purple


def test_a_broker_without_a_history_records_nothing(tmp_path: Path) -> None:
    sim = Sim()  # timings_file None: no history, no timeline
    sim.client()
    sim.submit(pool_spec=spec(1))
    sim.tick(0.05)
    assert sim.broker.timeline.pending == [] and not sim.broker.timeline.enabled


def test_a_failing_disk_keeps_the_events_until_it_works_again(tmp_path: Path) -> None:
    target = tmp_path / "gone" / "timings.jsonl"
    sim = Sim(timings_file=target)
    sim.client()
    sim.submit(pool_spec=spec(1))
    sim.tick(0.05)
    pending = len(sim.broker.timeline.pending)
    assert pending >= 2 and sim.broker.timeline.file.errors >= 1  # broker, spawn: unwritten
    target.parent.mkdir()
    sim.tick(0.05)
    assert sim.broker.timeline.pending == []
    assert [r["ev"] for r in records.read(records.timeline_path(target)).records][:2] == [
        "broker",
        "hello",
    ]


def test_the_timeline_rotates_with_the_timing_history(tmp_path: Path) -> None:
    sim = Sim(timings_file=tmp_path / "timings.jsonl", timings_max_bytes=1)
    sim.client()
    sim.submit(pool_spec=spec(1))
    sim.tick(0.05)
    sim.bring_up("g1")
    sim.finish_all("g1", "t1")  # one timing line: over 1 byte, rotated, and the timeline too
    assert (tmp_path / "timings.jsonl.1").exists()
    assert (tmp_path / "timings.timeline.jsonl.1").exists()


# --------------------------------------------------------------------------- hand-made runs

T = 1_700_000_000.0


def task(test: str, group: str, queued: float, started: float | None, ended: float, **kw: Any):
    base = {
        "ev": "task",
        "t": T + ended,
        "test": test,
        "spec": "ws2/auto",
        "ws": 2,
        "attempt": 1,
        "group": group,
        "queued": T + queued,
        "started": None if started is None else T + started,
        "outcome": "passed",
        "client": "pytest gw0 (pid 1)",
        "session": "s1",
        "first": False,
    }
    return base | kw


def life(group: str, spawn: float, ready: float, **kw: Any) -> list[dict[str, Any]]:
    spare = kw.pop("spare", False)
    out = [
        {"ev": "spawn", "t": T + spawn, "group": group, "spec": "ws2/auto", "ws": 2,
         "gpus": kw.pop("gpus", []), "spare": spare},
        {"ev": "ready", "t": T + ready, "group": group},
    ]  # fmt: skip
    if "stop" in kw:
        out.append({"ev": "stop", "t": T + kw["stop"], "group": group, "reason": "r",
                    "cause": kw.get("cause", "recycled")})  # fmt: skip
        out.append({"ev": "gone", "t": T + kw["stop"] + 0.5, "group": group})
    return out


def broker(t: float) -> dict[str, Any]:
    return {"ev": "broker", "t": T + t, "pid": 1, "host": "h"}


def hello(t: float, session: str, client: str = "pytest gw0 (pid 1)") -> dict[str, Any]:
    return {"ev": "hello", "t": T + t, "client": client, "session": session}


SESSION = [
    broker(0),
    hello(0.1, "s1"),
    hello(0.1, "s1", "pytest gw1 (pid 2)"),
    *life("g1", 0.2, 8.0, gpus=["0", "1"]),
    *life("g2", 0.2, 9.0, gpus=["2", "3"]),
    task("t::a", "g1", 1.0, 8.0, 10.0, first=True),
    task("t::b", "g2", 1.0, 9.0, 10.5, first=True, client="pytest gw1 (pid 2)"),
    task("t::c", "g1", 10.0, 10.0, 11.0, outcome="failed"),
    task("t::d", "g1", 10.5, 11.0, 12.0),
]


def test_every_task_and_spawn_is_on_its_groups_track_and_waits_flow_to_them() -> None:
    run = build(SESSION)
    trace = build_trace([run])
    slices = check_trace(trace)
    names = thread_names(trace)
    assert names[(1, 1)] == "g1 ws2/auto · GPUs 0,1" and names[(1, 2)] == "g2 ws2/auto · GPUs 2,3"
    on = {names[k]: [(e["cat"], e["name"]) for e in v] for k, v in slices.items()}
    assert on["g1 ws2/auto · GPUs 0,1"] == [
        ("spawn", "spawn"),
        ("warm-up", "t::a"),
        ("task", "t::c"),
        ("task", "t::d"),
    ]
    assert on["g2 ws2/auto · GPUs 2,3"] == [("spawn", "spawn"), ("warm-up", "t::b")]
    c = next(e for e in slices[(1, 1)] if e["name"] == "t::c")
    assert c["args"]["outcome"] == "failed" and c["args"]["group"] == "g1"
    assert c["dur"] == pytest.approx(1e6)
    d = next(e for e in slices[(1, 1)] if e["name"] == "t::d")
    assert d["args"]["queue_wait_s"] == pytest.approx(0.5)
    flows = [e for e in trace["traceEvents"] if e["ph"] == "f"]
    assert len(flows) == 4  # one per task that ran
    counters = {e["name"] for e in trace["traceEvents"] if e["ph"] == "C"}
    assert counters == {"queued tasks", "busy ranks"}
    busy = [e["args"]["ranks"] for e in trace["traceEvents"] if e["name"] == "busy ranks"]
    assert max(busy) == 4  # both ws=2 groups busy at once (9.0 .. 10.0)


def test_overlapping_waits_of_one_client_go_to_lanes() -> None:
    recs = [
        broker(0),
        *life("g1", 0, 1),
        *life("g2", 0, 1),
        task("t::a", "g1", 0.5, 1.0, 3.0),
        task("t::b", "g2", 0.6, 1.5, 3.0),
    ]
    slices = check_trace(build_trace([build(recs)]))
    waits = [k for k, v in slices.items() if all(e["cat"] == "wait" for e in v)]
    assert len(waits) == 2


def test_a_broker_restart_does_not_merge_groups_of_the_same_id() -> None:
    recs = [
        broker(0),
        *life("g1", 0, 1, stop=5),
        task("t::a", "g1", 1, 1, 2),
        broker(10),
        *life("g1", 10, 11),
        task("t::b", "g1", 11, 11, 12),
    ]
    run = build(recs)
    assert [g.key for g in run.groups] == ["1:g1", "2:g1"]
    assert [a.group for a in run.attempts] == ["1:g1", "2:g1"]
    check_trace(build_trace([run]))


def test_a_killed_brokers_groups_end_at_its_last_event_not_in_the_next_session() -> None:
    """A broker killed with SIGKILL wrote no ``stop``: its group ends at the last event it
    recorded, and the next broker's session does not list it, idle or otherwise."""
    recs = [
        broker(0),
        hello(0.1, "s1"),
        *life("g1-aa00", 0.2, 1.0),
        task("t::a", "g1-aa00", 1.0, 1.0, 2.0),
        broker(100),  # killed at some time after 2.0; a new broker starts
        hello(100.1, "s2"),
        *life("g1-bb00", 100.2, 101.0),
        task("t::b", "g1-bb00", 101.0, 101.0, 102.0, session="s2"),
    ]
    run = build(recs)
    old, new = run.groups
    assert (old.stop, old.cause, new.stop) == (T + 2.0, "broker-gone", None)
    assert "its broker ended without stopping it" in old.reason
    session = select(run, "last", None, None)
    assert [g.id for g in session.groups] == ["g1-bb00"]
    summary = summarize([session])
    assert [g["group"] for g in summary["groups"]] == ["g1-bb00"] and summary["idle"] == []
    everything = summarize([select(run, "all", None, None)])
    assert {g["group"]: g["ready_s"] for g in everything["groups"]} == pytest.approx(
        {"g1-aa00": 1.0, "g1-bb00": 1.0}  # not ready until the end of the history
    )
    assert build_html([session]).count("g1-aa00") == 0


def test_the_last_session_is_the_window_and_keeps_other_sessions_on_its_groups() -> None:
    recs = [
        *SESSION,
        hello(20, "s2"),
        task("t::x", "g1", 21, 21, 22, session="s2"),
        task("t::y", "g2", 21, 21, 23, session="other"),  # concurrently, on another group
        task("t::z", "g1", 30, 30, 31, session="other"),  # after s2: outside its window
    ]
    run = select(build(recs), "last", None, None)
    assert (run.start, run.end) == (T + 21, T + 31)  # "other" ended last: all of it
    run = select(build(recs), "s2", None, None)
    assert (run.start, run.end) == (T + 20, T + 22)  # from its hello to its last end
    assert sorted(a.test for a in run.attempts) == ["t::x", "t::y"]
    assert [g.id for g in run.groups] == ["g1", "g2"]
    slices = check_trace(build_trace([run]))
    assert all(e["ts"] >= 0 for v in slices.values() for e in v)  # clipped to the window
    with pytest.raises(WindowError, match="nope"):
        select(build(recs), "nope", None, None)


def test_a_time_range_clips_and_an_empty_one_is_an_error() -> None:
    run = build(SESSION)
    part = window(run, T + 9.5, T + 10.2)
    assert sorted(a.test for a in part.attempts) == ["t::a", "t::b", "t::c"]
    check_trace(build_trace([part]))
    with pytest.raises(WindowError):
        window(run, T + 50, T + 60)
    assert parse_time("-10m", T) == T - 600
    assert parse_time(str(T), 0) == T
    with pytest.raises(WindowError, match="cannot read the time"):
        parse_time("yesterday", T)


def test_unreadable_lines_are_skipped_and_counted() -> None:
    good = json.dumps(broker(0))
    bad = [
        "{torn",
        json.dumps({"ev": "nonsense", "t": T}),
        json.dumps(task("t::a", "g1", 0, 0, 1) | {"ws": True}),  # a bool is not an int
        json.dumps(task("t::a", "g1", 0, 0, 1) | {"queued": "soon"}),
        '{"ev": "ready", "t": NaN, "group": "g1"}',
        json.dumps({**life("g1", 0, 1)[0], "gpus": [0]}),
    ]
    loaded = records.read_lines([good, *bad, ""])
    assert len(loaded.records) == 1 and loaded.skipped == len(bad)


def test_the_page_shows_each_group_and_each_test_and_fetches_nothing() -> None:
    page = build_html([build(SESSION)])
    for label in ("g1 ws2/auto · GPUs 0,1", "g2 ws2/auto · GPUs 2,3"):
        assert label in page
    for test in ("t::a", "t::b", "t::c", "t::d"):
        assert f"data-test='{test}'" in page
    assert not re.search(r"<script|<link|@import|\bsrc=|\bhref=|url\(\s*['\"]?http", page)


def test_the_summary_says_busy_shares_spawning_waits_and_idle_groups() -> None:
    recs = [*SESSION, *life("g3", 0.2, 2.0, spare=True)]  # ready at 2 s, never used
    summary = summarize([build(recs)])
    groups = {g["group"]: g for g in summary["groups"]}
    # g1: ready 8 s .. window end 12 s = 4 s; tasks 8-10, 10-11, 11-12 = 4 s busy.
    assert groups["g1"]["busy_share"] == pytest.approx(1.0)
    # g2: ready 9 .. 12 = 3 s; one task of 1.5 s.
    assert groups["g2"]["busy_share"] == pytest.approx(0.5)
    assert [g["group"] for g in summary["idle"]] == ["g3"]
    assert summary["spawning_s"]["ws2/auto"] == pytest.approx(7.8 + 8.8 + 1.8)
    assert summary["waits"]["ws2/auto"]["max_s"] == pytest.approx(8.0)
    assert summary["slowest"][0]["test"] == "t::a"


def test_a_task_whose_group_failed_under_it_ends_where_its_group_stopped() -> None:
    # On a real clock the verdict is decided a few microseconds after the failed group was
    # stopped (same tick): its slice must not run into the group's "stopping" slice.
    recs = [
        broker(0),
        *life("g1", 0, 1, stop=5.0, cause="failed"),
        task("t::a", "g1", 1, 1, 5.00002, outcome="retried: torchrun exited"),
    ]
    slices = check_trace(build_trace([build(recs)]))
    kinds = [(e["cat"], e["name"]) for e in slices[(1, 1)]]
    assert kinds == [("spawn", "spawn"), ("task", "t::a"), ("stopping", "stopping (failed)")]
    a = slices[(1, 1)][1]
    assert a["args"]["run_s"] == pytest.approx(4.00002)  # its measured end, in the arguments


# --------------------------------------------------------------------------- fan-out merge


def _shard(directory: Path, index: int, recs: list[dict[str, Any]] | None) -> None:
    from cpq.fanout.manifest import Manifest, TestRecord

    tests = sorted({r["test"] for r in recs or [] if r["ev"] == "task"})
    Manifest(
        index=index,
        count=2,
        collection_hash="c",
        partition_hash="p",
        collected=tests,
        selected=tests,
        complete=True,
        hostname=f"node{index}",
        exitstatus=0,
        tests={t: TestRecord("passed", 1.0) for t in tests},
    ).write(directory)
    if recs is not None:
        text = "".join(records.iter_lines(recs))
        (directory / f"shard-{index}-of-2.timeline.jsonl").write_text(text)


def test_merge_draws_every_shard_as_its_own_track_group_on_one_axis(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from cpq.fanout import cli

    _shard(tmp_path, 0, [broker(0), *life("g1", 0, 1), task("t::a", "g1", 1, 1, 2)])
    late = [broker(5), *life("g1", 5, 6), task("t::b", "g1", 6, 6, 9)]
    _shard(tmp_path, 1, late)
    trace_path, page = tmp_path / "all.json", tmp_path / "all.html"
    code = cli.main([str(tmp_path), "--trace", str(trace_path), "--timeline", str(page)])
    assert code == 0, capsys.readouterr()
    trace = json.loads(trace_path.read_text())
    slices = check_trace(trace)
    processes = {
        e["pid"]: e["args"]["name"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "process_name"
    }
    assert processes == {1: "shard 0/2 node0", 2: "shard 1/2 node1"}
    assert slices[(2, 1)][0]["ts"] == pytest.approx(5e6)  # shard 2 started 5 s later
    assert "shard 0/2 node0" in page.read_text() and "t::b" in page.read_text()

    (tmp_path / "shard-1-of-2.timeline.jsonl").unlink()
    trace_path.unlink()
    assert cli.main([str(tmp_path), "--trace", str(trace_path)]) == 4
    assert "shard 1/2 node1 has no timeline" in capsys.readouterr().err
    assert not trace_path.exists()


def test_a_shard_exports_its_nodes_records_since_the_session_started(tmp_path: Path) -> None:
    from cpq.timeline.command import export_shard

    history = tmp_path / "timings.jsonl"
    recs = [broker(0), *life("g1", 0, 1), task("t::old", "g1", 1, 1, 2), hello(10, "s9")]
    recs += [task("t::a", "g1", 11, 11, 12), task("t::b", "g1", 12, 12, 13)]
    records.timeline_path(history).write_text("".join(records.iter_lines(recs)))
    out = tmp_path / "shard-1-of-2.timeline.jsonl"
    assert export_shard(out, history, T + 10, tests=2, wait_s=0.0) == 3
    assert [r.get("test") for r in records.read(out).records] == [None, "t::a", "t::b"]
