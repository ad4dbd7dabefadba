"""``Submit.fresh_group`` (``--cpq-confirm-fresh``, issue 35): a task that runs only on a
group started for it. Placement as a table of snapshots and as properties over random ones
(the invariants of ``test_placement.py`` hold with reserved groups too), then the broker on
fakes: the reserved group serves that task first and others afterwards; a cancel or a
failed start releases or fails that task alone; an older broker is refused."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpq import protocol
from cpq.broker.placement.decisions import Run, Start, Stop, Yield
from cpq.broker.placement.steps import Steps
from cpq.broker.placement.view import Queued, QueueView, Snapshot
from cpq.client.capabilities import refuse_unread_options
from cpq.specs import BadRequest

from .fakes import Sim, spec
from .test_placement import CPU, A, B, decide, group, snap, snapshots, words

FEATURES = sorted(protocol.ALL_FEATURES)


def fresh_queue(pool: protocol.PoolSpec, key: str = "f", then: int = 0) -> QueueView:
    rest = [Queued(f"n{i}", session="s") for i in range(then)]
    tasks = (Queued(key, session="s", fresh_group=True), *rest)
    return QueueView(pool, tasks, len(tasks), 90.0)


def test_a_fresh_task_gets_a_group_started_for_it_though_one_of_its_spec_is_idle() -> None:
    decisions = Steps().decide(snap([group("g1", A, gpus=("0", "1"))], [fresh_queue(A)]))
    assert words(decisions) == [("start", 2, ("2", "3"), "task")]
    (start,) = decisions
    assert isinstance(start, Start) and start.for_task == "f"


def test_only_its_own_group_takes_it_and_the_others_wait_behind_it() -> None:
    mine = group("g2", A, gpus=("2", "3"), reserved_for="f")
    other = group("g1", A, gpus=("0", "1"))
    # its group is idle: it runs there, and the next task takes the other idle group
    assert decide(snap([other, mine], [fresh_queue(A, then=1)])) == [
        ("run", "f", "g2"),
        ("run", "n0", "g1"),
    ]
    # its group still starts: nothing runs, nothing else starts (the queue waits for it)
    starting = dataclasses.replace(mine, state="starting")
    assert decide(snap([other, starting], [fresh_queue(A, then=1)])) == []


def test_a_group_reserved_for_a_task_serves_no_other() -> None:
    mine = group("g2", A, gpus=("2", "3"), reserved_for="someone-else")
    queue = QueueView(A, (Queued("n0", session="s"),), 1, 90.0)
    decisions = decide(snap([mine], [queue]))
    assert ("run", "n0", "g2") not in decisions
    assert decisions == [("start", 2, ("0", "1"), "task")]  # as if the spec had no group


def test_gpus_full_of_idle_groups_of_its_spec_one_goes_for_it() -> None:
    full = [group("g1", A, gpus=("0", "1"), last_used=50.0), group("g2", A, gpus=("2", "3"))]
    assert decide(snap(full, [fresh_queue(A)])) == [("stop", "g2", "evicted")]


def test_a_reserved_group_is_never_evicted_for_another_task() -> None:
    mine = group("g1", A, gpus=("0", "1", "2", "3")[:2], reserved_for="f")
    busy = group("g2", B, "busy", ("2", "3"))
    wide = protocol.PoolSpec(**{**dataclasses.asdict(spec(4)), "env": ()})
    assert decide(snap([mine, busy], [QueueView(wide, (Queued("w"),), 1, 1.0)])) == []


def test_on_cpu_the_fresh_group_fits_the_memory_budget_or_makes_room() -> None:
    pool = spec(2)
    idle = group("g1", pool, memory_mb=1500.0)
    # 1500 MB held + 800 MB for a new ws=2 group > 2000 MB: the idle group goes first
    assert decide(snap([idle], [fresh_queue(pool)], room=CPU)) == [("stop", "g1", "evicted")]


@st.composite
def with_fresh(draw: st.DrawFn) -> Snapshot:
    """A random snapshot where some queued tasks ask for a fresh group and some groups are
    reserved for queued tasks."""
    snapshot = draw(snapshots())
    queues = []
    for n, q in enumerate(snapshot.queues):  # keys unique across specs, as the broker's are
        tasks = tuple(
            dataclasses.replace(t, key=f"q{n}-{t.key}", fresh_group=draw(st.booleans()))
            for t in q.tasks
        )
        queues.append(dataclasses.replace(q, tasks=tasks))
    fresh_keys = [t.key for q in queues for t in q.tasks if t.fresh_group]
    groups = []
    for g in snapshot.groups:
        reserve = (
            g.state in ("starting", "idle") and not g.spare and fresh_keys and draw(st.booleans())
        )
        key = draw(st.sampled_from(fresh_keys)) if reserve else ""
        groups.append(dataclasses.replace(g, reserved_for=key))
    return dataclasses.replace(snapshot, queues=tuple(queues), groups=tuple(groups))


@settings(max_examples=300, deadline=None)
@given(with_fresh())
def test_reserved_groups_keep_every_invariant(snapshot: Snapshot) -> None:
    """Never two groups on one GPU, never a busy or reserved group stopped, a fresh task only
    on its own group and a reserved group only for its task, at most one start per task."""
    decisions = Steps().decide(snapshot)
    state = {g.id: g for g in snapshot.groups}
    held = Counter(gpu for g in snapshot.groups if g.state != "stopping" for gpu in g.gpus)
    fresh = {t.key for q in snapshot.queues for t in q.tasks if t.fresh_group}
    for d in decisions:
        if isinstance(d, Stop | Yield):
            victim = state[d.group]
            assert victim.state == "idle" or (victim.spare and victim.state == "starting"), d
            assert not victim.reserved_for or d.group not in state or isinstance(d, Yield), d
        elif isinstance(d, Run):
            mine = state[d.group].reserved_for
            assert mine == (d.task if d.task in fresh else ""), words(decisions)
        elif isinstance(d, Start):
            assert not d.for_task or not any(
                g.reserved_for == d.for_task and g.state != "stopping" for g in snapshot.groups
            ), words(decisions)
            held.update(d.gpus)
    stopped = {gpu for d in decisions if isinstance(d, Stop | Yield) for gpu in state[d.group].gpus}
    assert all(n == 1 or gpu in stopped for gpu, n in held.items()), (words(decisions), held)


# --------------------------------------------------------------------------- the broker


def test_the_broker_starts_a_group_for_it_and_then_lets_it_serve_others() -> None:
    sim = Sim()
    sim.client(b"c1", features=FEATURES)
    pool = spec(1)
    sim.submit(pool_spec=pool, task_id="warm", session="s")
    sim.bring_up("g1")
    sim.finish_all("g1", "warm", "failed")
    assert sim.done()["warm"].on_fresh_group  # g1's first task: already fresh
    sim.submit(pool_spec=pool, task_id="again", session="s")
    sim.finish_all("g1", "again", "failed")
    assert not sim.done()["again"].on_fresh_group  # g1's second: a warm group
    sim.submit(pool_spec=pool, task_id="confirm", session="s", fresh_group=True)
    assert sim.running("g1") is None and sim.states()["g2"] == "starting"
    assert sim.broker.pools.groups["g2"].reserved_for.endswith(":confirm")
    sim.submit(pool_spec=pool, task_id="next", session="s")  # waits behind "confirm"
    sim.bring_up("g2")
    assert sim.running("g2") == "confirm" and sim.running("g1") == "next"
    sim.finish_all("g2", "confirm")
    verdict = sim.done()["confirm"]
    assert verdict.outcome == "passed" and verdict.on_fresh_group
    assert verdict.groups == ["g2"] and not sim.broker.pools.groups["g2"].reserved_for
    sim.submit(pool_spec=pool, task_id="later", session="s")  # g2 is an ordinary group now
    assert sim.running("g2") == "later"


def test_a_cancelled_fresh_task_leaves_an_ordinary_group() -> None:
    sim = Sim()
    sim.client(b"c1", features=FEATURES)
    sim.submit(pool_spec=spec(1), task_id="confirm", fresh_group=True)
    sim.client_send(b"c1", protocol.Cancel(task_id="confirm"))
    sim.bring_up("g1")
    sim.submit(pool_spec=spec(1), task_id="other")
    assert sim.running("g1") == "other"


def test_a_fresh_group_that_does_not_start_fails_only_its_task() -> None:
    sim = Sim()
    sim.client(b"c1", features=FEATURES)
    pool = spec(1)
    sim.submit(pool_spec=pool, task_id="busy")
    sim.bring_up("g1")  # g1 busy from here on
    sim.submit(pool_spec=pool, task_id="confirm", fresh_group=True, retries=0)
    sim.processes["g2"].code = 1  # its torchrun exits before any rank is ready
    sim.tick(1.0)
    verdict = sim.done()["confirm"]
    assert verdict.outcome == "error" and "could not start" in verdict.message
    assert sim.running("g1") == "busy" and "busy" not in sim.done()


def test_a_client_refuses_fresh_group_from_a_broker_without_the_feature() -> None:
    message = protocol.Submit(task_id="t", target="m:f", spec=spec(1), fresh_group=True)
    old = frozenset(protocol.ALL_FEATURES) - {"fresh-group"}
    with pytest.raises(BadRequest, match="fresh-group"):
        refuse_unread_options(message, old, "ipc://x")
    refuse_unread_options(message, frozenset(protocol.ALL_FEATURES), "ipc://x")
    wire = protocol.unpack(protocol.encode_for(message, old))
    assert "fresh_group" not in wire  # an older broker could not even decode it
    done = protocol.Done(protocol.TaskResult(task_id="t", outcome="passed", on_fresh_group=True))
    assert "on_fresh_group" not in protocol.unpack(protocol.encode_for(done, old))["result"]


# --------------------------------------------------------------------------- the client


class FakeConfig:
    """What :mod:`cpq.client.confirm` reads of a ``pytest.Config``."""

    def __init__(self, option: bool = False, ini: bool = False) -> None:
        self.stash = pytest.Stash()
        self._option, self._ini = option, ini

    def getoption(self, name: str, default: object = None) -> object:
        return self._option

    def getini(self, name: str) -> object:
        return self._ini


def test_the_option_then_the_variable_then_the_ini(monkeypatch: pytest.MonkeyPatch) -> None:
    from cpq.client import confirm

    monkeypatch.delenv(confirm.CONFIRM_VAR, raising=False)
    assert confirm.enabled(FakeConfig(option=True))  # type: ignore[arg-type]
    assert confirm.enabled(FakeConfig(ini=True))  # type: ignore[arg-type]
    assert not confirm.enabled(FakeConfig())  # type: ignore[arg-type]
    monkeypatch.setenv(confirm.CONFIRM_VAR, "0")
    assert not confirm.enabled(FakeConfig(ini=True))  # type: ignore[arg-type]
    monkeypatch.setenv(confirm.CONFIRM_VAR, "1")
    assert confirm.enabled(FakeConfig())  # type: ignore[arg-type]
    warm = protocol.TaskResult(task_id="t", outcome="failed")
    on_first = protocol.TaskResult(task_id="t", outcome="failed", on_fresh_group=True)
    assert confirm.wanted(FakeConfig(), warm, failed=True)  # type: ignore[arg-type]
    assert not confirm.wanted(FakeConfig(), warm, failed=False)  # type: ignore[arg-type]
    assert not confirm.wanted(FakeConfig(), on_first, failed=True)  # type: ignore[arg-type]


def test_workers_confirmations_reach_the_controllers_summary() -> None:
    from cpq.client import confirm

    class Item:
        def __init__(self, config: FakeConfig, nodeid: str) -> None:
            self.config, self.nodeid, self.stash = config, nodeid, pytest.Stash()

    controller, one, two = FakeConfig(), FakeConfig(), FakeConfig()
    assert confirm.summary(controller) == ("", [])  # type: ignore[arg-type]
    confirm.note(Item(one, "t.py::b"), fresh_failed=False, warm="w")  # type: ignore[arg-type]
    confirm.note(Item(two, "t.py::c"), fresh_failed=True, warm="w")  # type: ignore[arg-type]
    confirm.note(Item(two, "t.py::f"), fresh_failed=False, warm="w")  # type: ignore[arg-type]
    for worker in (one, two):
        confirm.merge(controller, confirm.to_wire(worker))  # type: ignore[arg-type]
    confirm.merge(controller, {"not a label": ["x"]})  # type: ignore[arg-type]
    words, lines = confirm.summary(controller)  # type: ignore[arg-type]
    assert words == f"; confirmed fresh: 2 {confirm.PASSED_FRESH}, 1 {confirm.FAILED_FRESH}"
    assert lines == [
        f"cpq: {confirm.PASSED_FRESH}: t.py::b",
        f"cpq: {confirm.PASSED_FRESH}: t.py::f",
        f"cpq: {confirm.FAILED_FRESH}: t.py::c",
    ]
