"""The yield rule between brokers (cpq.broker.placement.yielding), on plain values."""

from __future__ import annotations

from cpq.broker.placement.yielding import (
    STALE_S,
    Holding,
    Want,
    may_take,
    parse_wants,
    shortfall,
    to_yield,
)

NOW = 1_700_000_000.0


def want(broker: str, since: float, need: int, *gpus: str) -> Want:
    return Want(broker, since, need, frozenset(gpus), who=broker)


def held(group: str, state: str, *gpus: str, spare: bool = False, used: float = 0.0) -> Holding:
    return Holding(group, frozenset(gpus), state, spare, used)


def doc(broker: str, refreshed: float, *entries: object) -> dict[str, object]:
    return {
        "broker": broker,
        "who": f"{broker}@node",
        "refreshed": refreshed,
        "wants": list(entries),
    }


def test_wants_of_others_are_read_oldest_first_and_stale_own_or_malformed_ones_are_not() -> None:
    docs = [
        doc("b", NOW, {"since": NOW - 1, "need": 2, "gpus": ["G1", "G2"], "spec": "ws2"}),
        doc("c", NOW - STALE_S - 0.1, {"since": NOW - 9, "need": 1, "gpus": ["G1"]}),  # stale
        doc("me", NOW, {"since": NOW - 9, "need": 1, "gpus": ["G1"]}),  # mine
        doc("d", NOW, {"since": NOW - 5, "need": 1, "gpus": ["G3"]}, {"need": 0}, "junk"),
        {"broker": 3, "refreshed": NOW, "wants": []},
        doc("e", NOW, {"since": "yesterday", "need": 1, "gpus": ["G1"]}),
    ]
    wants = parse_wants(docs, "me", NOW)
    assert [(w.broker, w.need, sorted(w.gpus)) for w in wants] == [
        ("d", 1, ["G3"]),
        ("b", 2, ["G1", "G2"]),
    ]
    assert wants[1].spec == "ws2" and wants[1].who == "b@node"


def test_idle_groups_and_spares_on_wanted_gpus_yield_spares_first_busy_never() -> None:
    mine = [
        held("busy", "busy", "G1", "G2"),
        held("old", "idle", "G3", "G4", used=1.0),
        held("new", "idle", "G5", "G6", used=9.0),
        held("spare", "starting", "G7", "G8", spare=True),
        held("coming", "starting", "G0"),  # starting for a task of mine: not yieldable
    ]
    everything = want("b", NOW, 2, *[f"G{i}" for i in range(9)])
    assert to_yield([everything], mine, None) == [("spare", everything)]
    four = want("b", NOW, 4, *[f"G{i}" for i in range(9)])
    assert [g for g, _ in to_yield([four], mine, None)] == ["spare", "old"]
    busy_only = want("b", NOW, 2, "G0", "G1", "G2")
    assert to_yield([busy_only], mine, None) == []


def test_groups_already_stopping_on_wanted_gpus_count_toward_the_need() -> None:
    mine = [held("going", "stopping", "G1", "G2"), held("idle", "idle", "G3", "G4")]
    assert to_yield([want("b", NOW, 2, "G1", "G2", "G3", "G4")], mine, None) == []
    assert [g for g, _ in to_yield([want("b", NOW, 3, "G1", "G2", "G3")], mine, None)] == ["idle"]


def test_the_oldest_want_is_served_first_and_a_holder_waiting_longer_keeps_its_gpus() -> None:
    mine = [held("a", "idle", "G1", "G2", used=1.0), held("b", "idle", "G3", "G4", used=2.0)]
    young, old = (
        want("young", NOW - 1, 2, "G1", "G2", "G3", "G4"),
        want("old", NOW - 5, 2, "G1", "G2"),
    )
    assert to_yield([young, old], mine, None) == [("a", old), ("b", young)]
    assert to_yield([young, old], mine, my_since=NOW - 3) == [("a", old)]
    assert to_yield([young, old], mine, my_since=NOW - 9) == []


def test_a_free_gpu_goes_to_the_oldest_want_that_names_it() -> None:
    wants = [want("b", NOW - 5, 2, "G1", "G2")]
    assert not may_take("G1", NOW - 1, "me", wants)  # younger need: b first
    assert not may_take("G1", float("inf"), "me", wants)  # a spare or warm group defers
    assert may_take("G1", NOW - 9, "me", wants)  # my task waited longer
    assert may_take("G3", NOW, "me", wants)  # nobody wants G3
    assert may_take("G1", NOW, "b", wants)  # b's own want does not hold b back


def test_shortfall_counts_lockable_and_returning_gpus() -> None:
    assert shortfall(4, 1, 1) == 2
    assert shortfall(2, 2, 0) == 0
    assert shortfall(2, 3, 3) == 0
