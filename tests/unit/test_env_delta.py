"""Task variables travel once per change (docs/design.md, "Dispatch"): a client says
``env_same`` when they equal its previous submit's, the broker says it to a group whose
ranks got the same ones last; peers that cannot read it always get them whole."""

from __future__ import annotations

from typing import Any

from cpq import protocol
from tests.unit.fakes import Sim, spec

FEATURES = sorted(protocol.ALL_FEATURES)
A = {"MYPROJ_FLAG": "on", "HOME": "/h"}
B = {"MYPROJ_FLAG": "off", "HOME": "/h"}


def submit(sim: Sim, task_id: str, env: dict[str, str] | None, client: bytes = b"c1") -> None:
    same = env is None
    sim.client_send(
        client,
        protocol.Submit(task_id=task_id, target="m:f", spec=spec(1), env=env, env_same=same),
    )


def run_and_finish(sim: Sim, task_id: str) -> protocol.RunTask:
    run: protocol.RunTask = sim.sent_to_ranks(protocol.RunTask)[-1][1]
    assert run.task_id == task_id
    sim.finish_all("g1", task_id)
    return run


def runs(sim: Sim) -> list[tuple[dict[str, str] | None, bool]]:
    return [(run.env, run.env_same) for _, run in sim.sent_to_ranks(protocol.RunTask)]


def test_a_group_gets_the_variables_once_per_change() -> None:
    sim = Sim()
    sim.client(features=FEATURES)
    submit(sim, "t1", A)
    sim.bring_up("g1")
    run_and_finish(sim, "t1")
    for task_id, env in (("t2", A), ("t3", None), ("t4", B), ("t5", None), ("t6", A)):
        submit(sim, task_id, env)
        run_and_finish(sim, task_id)
    expected = [(A, False), (None, True), (None, True), (B, False), (None, True), (A, False)]
    assert runs(sim) == expected
    assert {r.outcome for r in sim.done().values()} == {"passed"}


def test_env_same_means_this_clients_previous_variables_not_anothers() -> None:
    sim = Sim()
    sim.client(b"c1", features=FEATURES)
    sim.client(b"c2", features=FEATURES)
    submit(sim, "t1", A, b"c1")
    sim.bring_up("g1")
    run_and_finish(sim, "t1")
    submit(sim, "t2", B, b"c2")
    run_and_finish(sim, "t2")
    submit(sim, "t3", None, b"c1")  # c1's previous: A, though the group last ran B
    run = run_and_finish(sim, "t3")
    assert (run.env, run.env_same) == (A, False)


def test_env_same_before_any_variables_is_refused_and_the_broker_serves_on() -> None:
    sim = Sim()
    sim.client(features=FEATURES)
    before = sim.broker.totals.malformed
    submit(sim, "t1", None)
    assert sim.errors() == ["env_same before any task variables"]
    assert sim.broker.totals.malformed == before + 1 and not sim.sent_to_ranks(protocol.RunTask)
    submit(sim, "t2", A)
    sim.bring_up("g1")
    assert run_and_finish(sim, "t2").env == A


def test_ranks_of_an_older_cpq_get_the_variables_whole_and_no_field_they_cannot_read() -> None:
    sim = Sim()
    sim.client(features=FEATURES)
    submit(sim, "t1", A)
    sim.bring_up("g1", features=[])  # an older rank lists no features
    run_and_finish(sim, "t1")
    submit(sim, "t2", None)
    run_and_finish(sim, "t2")
    assert runs(sim) == [(A, False), (A, False)]
    frames: list[dict[str, Any]] = [
        protocol.unpack(f) for _, f in sim.wire.raw_to_ranks if protocol.unpack(f)["k"] == "run"
    ]
    assert frames and all("env_same" not in wire for wire in frames)
