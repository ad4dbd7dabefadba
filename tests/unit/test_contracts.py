"""Typed contracts across processes, on fakes: a missed deadline is the verdict's ``cause``,
a rank's refusal says its ``stale_kind``, a rank's report the broker cannot read ends its
task at once, and group ids name their broker. Unknown values of the new fields are
decode errors (fail closed), never a pass or a default."""

from __future__ import annotations

import itertools
import re
from typing import Any

import pytest

from cpq import protocol
from cpq.broker.config import broker_tag
from cpq.client import timeouts
from cpq.protocol import RankResult, TaskResult

from .fakes import Sim, spec

FEATURES = sorted(protocol.ALL_FEATURES)


def _sim(**config: Any) -> Sim:
    sim = Sim(**config)
    sim.client(features=FEATURES)
    return sim


def _reencoded(message: protocol.Message, path: list[str], value: Any) -> bytes:
    """``message``'s frame with the field at ``path`` set to ``value`` (what a peer of
    another version, or a broken one, could send)."""
    wire = protocol.unpack(protocol.encode(message))
    target = wire
    for name in path[:-1]:
        target = target[name]
    target[path[-1]] = value
    return protocol.pack(wire)


# --------------------------------------------------------------------------- a missed deadline


def test_a_missed_deadline_is_the_verdicts_cause_and_other_errors_have_none() -> None:
    sim = _sim(stack_wait_s=1.0)
    hung = sim.submit(pool_spec=spec(1), timeout=5, retries=0)
    sim.bring_up("g1")
    sim.tick(5.1)
    sim.stacks("g1", 0, hung, "in recv")
    verdict = sim.done()[hung]
    assert (verdict.outcome, verdict.cause) == ("error", "deadline")
    died = sim.submit(pool_spec=spec(1), retries=0)
    sim.tick(0.05)
    sim.bring_up("g2")
    sim.processes["g2"].code = -9
    sim.tick(0.05)
    assert (sim.done()[died].outcome, sim.done()[died].cause) == ("error", "")


def test_a_client_without_the_feature_gets_no_cause_and_decodes_the_verdict() -> None:
    done = protocol.Done(TaskResult(task_id="t", outcome="error", cause="deadline"))
    old = frozenset(protocol.ALL_FEATURES) - {"verdict-cause"}
    wire = protocol.unpack(protocol.encode_for(done, old))
    assert "cause" not in wire["result"]
    decoded = protocol.decode(protocol.encode_for(done, old))
    assert isinstance(decoded, protocol.Done) and decoded.result.cause == ""


@pytest.mark.parametrize(
    ("message", "path"),
    [
        (protocol.Done(TaskResult(task_id="t", outcome="error")), ["result", "cause"]),
        (
            protocol.RankDone(task_id="t", result=RankResult(rank=0, outcome="error"), stale="x"),
            ["stale_kind"],
        ),
    ],
)
@pytest.mark.parametrize("value", ["timeout", "Deadline", "file", 1, None])
def test_an_unknown_value_of_a_typed_field_is_a_decode_error(
    message: protocol.Message, path: list[str], value: Any
) -> None:
    with pytest.raises(protocol.ProtocolError, match=path[-1]):
        protocol.decode(_reencoded(message, path, value))


class _Item:
    """What :func:`cpq.client.timeouts.fail_if_timed_out` reads of a pytest item."""

    def __init__(self) -> None:
        self.stash = pytest.Stash()
        self.stash[timeouts.TIMER_KEY] = (3.0, 0.0)
        self.sections: list[tuple[str, str, str]] = []

    def add_report_section(self, when: str, key: str, content: str) -> None:
        self.sections.append((when, key, content))


def test_the_client_fails_as_pytest_timeout_by_the_cause_never_by_the_words() -> None:
    words_only = TaskResult(task_id="t", outcome="error", message="deadline of 3s passed")
    timeouts.fail_if_timed_out(_Item(), words_only)  # type: ignore[arg-type]  # not a deadline
    by_cause = TaskResult(
        task_id="t",
        outcome="error",
        message="the broker's words\nrank 0: in recv",
        cause="deadline",
    )
    item = _Item()
    with pytest.raises(pytest.fail.Exception) as failed:
        timeouts.fail_if_timed_out(item, by_cause)  # type: ignore[arg-type]
    assert str(failed.value) == "Timeout (>3.0s) from pytest-timeout."  # pytest-timeout's
    [(when, key, text)] = item.sections  # the stacks on stderr, as pytest-timeout's dump
    assert (when, key) == ("call", "stderr") and "rank 0: in recv" in text


# --------------------------------------------------------------------------- a rank's refusal


def _refuse(sim: Sim, group: str, task: str, **fields: Any) -> None:
    result = RankResult(rank=0, outcome="error")
    sim.rank_send(sim.rank_id(group, 0), protocol.RankDone(task_id=task, result=result, **fields))


def test_a_variable_refusal_is_known_by_its_kind_and_its_name_is_learned() -> None:
    sim = _sim()
    task = sim.submit(pool_spec=spec(1), env={"TPLIB_MODE": "fast"})
    sim.bring_up("g1")
    _refuse(sim, "g1", task, stale="TPLIB_MODE", stale_kind="variable", stale_start=True)
    assert sim.done() == {}  # bounced to a group started with the caller's value
    assert ["TPLIB_MODE", "fast"] in sim.broker.pools.groups["g2"].spec.env


def test_an_older_ranks_refusal_is_read_as_changed_code_never_parsed() -> None:
    """A rank without ``refusal-kind`` says "the variable X": the broker does not parse it;
    it takes the safe reading (a fresh group) and learns nothing."""
    sim = _sim()
    task = sim.submit(pool_spec=spec(1), env={"TPLIB_MODE": "fast"})
    sim.bring_up("g1", features=set(protocol.ALL_FEATURES) - {"refusal-kind"})
    _refuse(sim, "g1", task, stale="the variable TPLIB_MODE", stale_start=True)
    group = sim.broker.pools.groups["g1"]
    assert group.stop_reason == "code changed: the variable TPLIB_MODE"
    assert sim.done() == {} and sim.broker.tasks.start_bound.names == {}


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"stale": "/p/m.py"}, "does not say what"),
        ({"stale": "/p/m.py", "stale_kind": "code", "stale_start": True}, "not a variable"),
        ({"stale_kind": "variable"}, "names nothing"),
    ],
)
def test_a_refusal_at_odds_with_itself_ends_the_task_naming_the_rank(
    fields: dict[str, Any], why: str
) -> None:
    sim = _sim()
    task = sim.submit(pool_spec=spec(1))
    sim.bring_up("g1")
    _refuse(sim, "g1", task, **fields)
    verdict = sim.done()[task]
    assert verdict.outcome == "error" and "rank 0 of group g1" in verdict.message
    assert why in verdict.message and sim.states() == {"g1": "stopping"}


# --------------------------------------------------------------------------- unreadable reports


def test_a_garbled_report_ends_the_task_at_once_naming_the_rank_and_recycles_the_group() -> None:
    sim = _sim()
    task = sim.submit(pool_spec=spec(2), timeout=60)
    sim.bring_up("g1")
    sim.report("g1", 0, task)
    garbled = _reencoded(
        protocol.RankDone(task_id=task, result=RankResult(rank=1, outcome="passed")),
        ["result", "outcome"],
        "passed-ish",
    )
    sim.broker.controller.on_rank_frames([sim.rank_id("g1", 1), garbled])
    verdict = sim.done()[task]  # at once: no time passed
    assert verdict.outcome == "error" and verdict.attempts == 1
    assert "rank 1 of group g1 sent a report the broker cannot read" in verdict.message
    assert "'passed-ish' is not one of" in verdict.message
    assert [r.rank for r in verdict.ranks] == [0]  # what rank 0 did report is kept
    assert sim.states() == {"g1": "stopping"} and sim.broker.totals.malformed == 1
    sim.report("g1", 0, task)  # a late report changes nothing
    assert len(sim.done()) == 1
    after = sim.submit(pool_spec=spec(2))
    sim.tick(0.05)
    sim.bring_up("g2")
    assert sim.running("g2") == after


@pytest.mark.parametrize(
    "frames",
    [
        lambda sim: [sim.rank_id("g1", 0), b"\xc1 not msgpack"],
        lambda sim: [sim.rank_id("g1", 0), b"a", b"b"],  # two payload frames
        lambda sim: [
            sim.rank_id("g1", 0),
            protocol.encode(
                protocol.RankDone(task_id=sim.running("g1"), result=RankResult(1, "passed"))
            ),
        ],  # rank 0 reporting rank 1's result
    ],
)
def test_every_kind_of_unreadable_report_ends_the_task(frames: Any) -> None:
    sim = _sim()
    task = sim.submit(pool_spec=spec(1))
    sim.bring_up("g1")
    sim.broker.controller.on_rank_frames(frames(sim))
    verdict = sim.done()[task]
    assert verdict.outcome == "error" and "rank 0 of group g1" in verdict.message


def test_junk_from_an_idle_groups_rank_or_an_unknown_peer_is_only_counted() -> None:
    sim = _sim()
    sim.client_send(b"c1", protocol.Warm(specs=[spec(1)], counts=[1]))
    sim.bring_up("g1")
    sim.broker.controller.on_rank_frames([sim.rank_id("g1", 0), b"\xc1"])
    sim.broker.controller.on_rank_frames([b"stranger", b"\xc1"])
    assert sim.states() == {"g1": "idle"} and sim.broker.totals.malformed == 2
    task = sim.submit(pool_spec=spec(1))
    sim.broker.controller.on_rank_frames([b"stranger", b"\xc1"])  # not one of g1's ranks
    assert sim.running("g1") == task and sim.done() == {}


# --------------------------------------------------------------------------- group ids


def test_group_ids_name_their_broker() -> None:
    sim = _sim(broker_tag="9ix0k")
    sim.submit(pool_spec=spec(1))
    sim.tick(0.05)
    assert sim.states() == {"g1-9ix0k": "starting"}
    assert broker_tag(pid=12345, started_s=36**2 * 1000 + 20) == "9ix0k"
    tags = {
        broker_tag(pid, second)
        for pid, second in itertools.product([1, 35, 36, 1295, 12345, 4194304], range(0, 1296, 7))
    }
    assert len(tags) == 6 * len(range(0, 1296, 7))  # no two (pid, second) share a tag
    assert all(re.fullmatch("[0-9a-z]+", tag) for tag in tags)  # readable, in file names
