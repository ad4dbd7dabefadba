"""Every message kind on the wrong socket is dropped, counted and logged; the broker serves on.
Random message sequences never crash it (hypothesis)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpq import protocol
from cpq.protocol import RankResult

from .fakes import Sim, spec


def example(kind: type[protocol.Message]) -> protocol.Message:
    """A valid message of ``kind``, its required fields filled in."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(kind):
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
            continue
        known = {
            "task_id": "t1",
            "target": "m:f",
            "spec": spec(1),
            "specs": [spec(1)],
            "result": RankResult(rank=0, outcome="passed"),
            "group_id": "g1",
            "token": "token-g1",
            "rank": 0,
            "local_rank": 0,
            "pid": 5_000_000,
            "startup_s": 1.0,
            "stacks": "stack",
            "broker": {},
            "status": {},
            "message": "m",
            "reason": "r",
        }
        if kind is protocol.Done and f.name == "result":
            known["result"] = protocol.TaskResult(task_id="t1", outcome="passed")
        values[f.name] = known[f.name] if f.name in known else _default_for(f.type)
    return kind(**values)


def _default_for(annotation: Any) -> Any:
    text = str(annotation)
    if "TaskResult" in text:
        return protocol.TaskResult(task_id="t1", outcome="passed")
    for name, value in (("str", ""), ("int", 0), ("float", 0.0), ("bool", False), ("dict", {})):
        if text.startswith(name):
            return value
    if text.startswith("list"):
        return []
    raise AssertionError(f"no example for {annotation!r}")


KINDS = sorted(protocol._KINDS.values(), key=lambda k: k.KIND)
CLIENT_KINDS = {
    protocol.Hello,
    protocol.Heartbeat,
    protocol.Goodbye,
    protocol.StatusRequest,
    protocol.StopRequest,
    protocol.Submit,
    protocol.Cancel,
    protocol.Warm,
    protocol.DebugAttach,
    protocol.DebugLine,
}
RANK_KINDS = {
    protocol.Heartbeat,
    protocol.RankReady,
    protocol.RankDone,
    protocol.RankStacks,
    protocol.RankBegun,
    protocol.RankStale,
    protocol.DebugOutput,
}


def test_every_kind_has_an_example() -> None:
    for kind in KINDS:
        assert protocol.decode(protocol.encode(example(kind))) == example(kind)


def warm_sim() -> Sim:
    sim = Sim()
    sim.client()
    sim.client_send(b"c1", protocol.Warm(specs=[spec(1)], counts=[1]))
    sim.bring_up("g1")
    return sim


def serves(sim: Sim) -> None:
    task = sim.submit(pool_spec=spec(1))
    assert sim.running("g1") == task
    sim.finish_all("g1", task)
    assert sim.done()[task].outcome == "passed"


@pytest.mark.parametrize("kind", sorted(set(KINDS) - RANK_KINDS - {protocol.RankHello}, key=str))
def test_a_non_rank_message_from_a_registered_rank_is_dropped_counted_and_logged(
    kind: type[protocol.Message], caplog: pytest.LogCaptureFixture
) -> None:
    sim = warm_sim()
    before = sim.broker.totals.malformed
    sent = len(sim.wire.to_ranks), len(sim.wire.to_clients)
    with caplog.at_level(logging.WARNING, logger="cpq.broker"):
        sim.rank_send(sim.rank_id("g1", 0), example(kind))
    assert sim.broker.totals.malformed == before + 1
    assert f"dropping {kind.KIND!r} from rank 0 of group g1" in caplog.text
    assert (len(sim.wire.to_ranks), len(sim.wire.to_clients)) == sent  # nothing done
    assert sim.states() == {"g1": "idle"} and sim.broker.totals.submitted == 0
    serves(sim)


@pytest.mark.parametrize("kind", sorted(set(KINDS) - CLIENT_KINDS, key=str))
def test_a_non_client_message_from_a_client_is_refused_counted_and_logged(
    kind: type[protocol.Message], caplog: pytest.LogCaptureFixture
) -> None:
    sim = warm_sim()
    before = sim.broker.totals.malformed
    with caplog.at_level(logging.WARNING, logger="cpq.broker"):
        sim.client_send(b"c1", example(kind))
    assert sim.broker.totals.malformed == before + 1
    assert sim.errors() == [f"{kind.KIND!r} is not a client message"]
    assert "not a client message" in caplog.text
    assert sim.states() == {"g1": "idle"} and sim.broker.pools.ranks.keys() == {
        sim.rank_id("g1", 0)
    }
    serves(sim)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.KIND)
def test_any_message_from_an_unknown_rank_peer_changes_nothing(
    kind: type[protocol.Message],
) -> None:
    sim = warm_sim()
    message = example(kind)
    if isinstance(message, protocol.RankHello):
        message.token = "wrong"
    before = sim.broker.totals.malformed
    sim.rank_send(b"stranger", message)
    assert b"stranger" not in sim.broker.pools.ranks
    if not isinstance(message, protocol.RankHello):  # a hello with a wrong token: refused
        assert sim.broker.totals.malformed == before + 1  # junk from strangers is counted
    serves(sim)


JUNK = [b"\xc1", protocol.encode(protocol.Heartbeat())[:-1] + b"\x00", b"\x80"]


@pytest.mark.parametrize("junk", JUNK)
def test_junk_from_a_rank_never_keeps_it_alive(junk: bytes) -> None:
    """A rank that sends only junk is silent: it is failed like one that sends nothing."""
    sim = warm_sim()
    identity = sim.rank_id("g1", 0)
    before = sim.broker.totals.malformed
    for _ in range(40):  # 20 s of junk instead of heartbeats
        sim.clock.advance(0.5)
        sim.broker.controller.on_rank_frames([identity, junk])
        sim.broker.tick(sim.clock.monotonic())
    assert sim.broker.totals.malformed >= before + 10
    assert sim.states().get("g1", "stopping") == "stopping"  # failed as silent


def test_a_known_rank_sending_a_client_message_is_not_refreshed() -> None:
    sim = warm_sim()
    identity = sim.rank_id("g1", 0)
    for _ in range(40):
        sim.clock.advance(0.5)
        sim.rank_send(identity, protocol.StatusRequest())
        sim.broker.tick(sim.clock.monotonic())
    assert sim.states().get("g1", "stopping") == "stopping"


@pytest.mark.parametrize("junk", JUNK)
def test_junk_from_a_new_client_leaves_no_client_behind(junk: bytes) -> None:
    sim = warm_sim()
    clients = set(sim.broker.clients)
    sim.broker.controller.on_client_frames([b"newcomer", junk])
    assert set(sim.broker.clients) == clients  # no record: junk proves nothing about a peer
    assert sim.errors(b"newcomer") and "malformed message" in sim.errors(b"newcomer")[-1]
    serves(sim)


def test_an_unknown_outcome_from_a_rank_is_malformed_never_a_pass() -> None:
    """Malformed, and the task does not wait for its deadline: an error at once, naming
    the rank and what the decoder refused; its group is recycled (tests/unit/test_contracts)."""
    sim = warm_sim()
    sim.client()
    task = sim.submit(pool_spec=spec(1))
    assert sim.running("g1") == task
    frame = protocol.encode(
        protocol.RankDone(task_id=task, result=RankResult(rank=0, outcome="passed"))
    ).replace(b"passed", b"passes")
    before = sim.broker.totals.malformed
    sim.broker.controller.on_rank_frames([sim.rank_id("g1", 0), frame])
    assert sim.broker.totals.malformed == before + 1
    verdict = sim.done()[task]
    assert verdict.outcome == "error" and "rank 0 of group g1" in verdict.message
    assert "'passes' is not one of" in verdict.message and sim.states() == {"g1": "stopping"}


@pytest.mark.parametrize("wrong_socket", ["rank", "client"])
def test_serve_keeps_serving_after_wrong_socket_messages(wrong_socket: str) -> None:
    """The loop itself (poll → drain → handle → tick), not only the handlers."""
    sim = warm_sim()
    # (not a rank's stale report: it rightly stops the idle group, test_spares.py)
    frames = [protocol.encode(example(k)) for k in KINDS if k is not protocol.RankStale]
    if wrong_socket == "rank":
        sim.wire.inbox_ranks.extend([sim.rank_id("g1", 0), f] for f in frames)
    else:
        sim.wire.inbox_clients.extend([b"c1", f] for f in frames)
    sim.wire.inbox_clients.append([b"c1", b"\x00junk"])
    sim.wire.inbox_clients.append([b"c1", b"a", b"b"])  # two payload frames
    sim.wire.inbox_ranks.append([b"x"])
    sim.wire.when_idle = lambda: setattr(sim.broker, "stopping", True)
    sim.broker.serve()  # returns once the inbox is empty: no handler raised
    assert sim.broker.totals.malformed >= 3
    sim.broker.stopping = False
    serves(sim)


# --------------------------------------------------------------------------- hypothesis

OPS = st.one_of(
    st.tuples(st.just("submit"), st.sampled_from([b"c1", b"c2"]), st.integers(1, 2)),
    st.tuples(st.just("hello"), st.sampled_from([b"c1", b"c2"]), st.just(0)),
    st.tuples(st.just("bye"), st.sampled_from([b"c1", b"c2"]), st.just(0)),
    st.tuples(st.just("cancel"), st.sampled_from([b"c1", b"c2"]), st.integers(1, 20)),
    st.tuples(st.just("up"), st.integers(1, 6), st.just(0)),
    st.tuples(
        st.just("report"), st.integers(1, 6), st.sampled_from(["passed", "failed", "skipped"])
    ),
    st.tuples(st.just("die"), st.integers(1, 6), st.just(0)),
    st.tuples(st.just("tick"), st.floats(0.0, 20.0), st.booleans()),
    st.tuples(st.just("wrong"), st.sampled_from(KINDS), st.booleans()),
    st.tuples(st.just("junk"), st.binary(max_size=40), st.booleans()),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(OPS, max_size=40))
def test_random_message_sequences_never_crash_the_broker(ops: list[tuple[Any, Any, Any]]) -> None:
    sim = Sim(max_ranks=4, heartbeat_s=1.0, liveness=3, start_timeout_s=15, failure_grace_s=2)
    answered: dict[bytes, list[str]] = {b"c1": [], b"c2": []}
    for op, a, b in ops:
        if op == "submit":
            sim.submit(client=a, pool_spec=spec(b), timeout=10)
        elif op == "hello":
            sim.client(a)
        elif op == "bye":
            sim.client_send(a, protocol.Goodbye())
        elif op == "cancel":
            sim.client_send(a, protocol.Cancel(task_id=f"t{b}"))
        elif op in ("up", "report", "die"):
            group = sim.broker.pools.groups.get(f"g{a}")
            if group is None or group.state == "stopping":
                continue
            if op == "up":
                sim.bring_up(group.id)
            elif op == "die":
                sim.processes[group.id].code = 1
            elif group.task is not None:
                for rank in group.ranks:
                    sim.report(group.id, rank, group.task.submit.task_id, b)
        elif op == "tick":
            sim.tick(a, heartbeats=b)
        elif op == "wrong":
            if b and sim.broker.pools.ranks:
                sim.rank_send(next(iter(sim.broker.pools.ranks)), example(a))
            elif a not in CLIENT_KINDS:
                sim.client_send(b"c1", example(a))
        elif op == "junk":
            (sim.broker.controller.on_rank_frames if b else sim.broker.controller.on_client_frames)(
                [b"c1", a]
            )
        # invariants after every step
        pools = sim.broker.pools
        for group in pools.groups.values():
            if group.state == "busy":
                assert group.task is not None and group.task.group is group
            else:
                assert group.task is None
        for task in sim.broker.tasks.tasks.values():
            assert task.attempts in (1, 2)
    for client in answered:
        ids = [
            m.result.task_id
            for who, m in sim.wire.to_clients
            if who == client and isinstance(m, protocol.Done)
        ]
        assert len(ids) == len(set(ids)), "a task answered twice"


def test_a_refused_submit_names_its_task_so_the_client_pairs_the_refusal() -> None:
    sim = warm_sim()
    frame = protocol.pack({"v": protocol.PROTOCOL_VERSION, "k": "submit", "task_id": "t9"})
    sim.broker.controller.on_client_frames([b"c1", frame])  # no target, no spec: malformed
    (refusal,) = [m for who, m in sim.wire.to_clients if isinstance(m, protocol.ErrorReply)]
    assert refusal.task_id == "t9" and "malformed" in refusal.message
