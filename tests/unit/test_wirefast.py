"""The wire's compiled fast paths (``cpq.wirefast``) against the exact checker.

Decoding: for every message kind, a valid message and random corruptions of it (a field
set to a value of another type, one removed, an unknown one added, nested records
included) decode through the fast path to exactly what the exact checker gives: the same
record, or a ``ProtocolError`` with the same words. Encoding: a message round-trips, and a
field that holds its default stays home, so a no-op's verdict is small.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpq import protocol, wirecheck, wirefast
from cpq.protocol import RankResult, TaskResult

from .test_wire import example

KINDS = sorted(protocol._KINDS.values(), key=lambda k: k.KIND)

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.floats(allow_nan=False),
    st.text(max_size=3),
    st.binary(max_size=3),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=6,
)


def decoded_both_ways(cls: type, data: Any) -> tuple[Any, Any]:
    """(fast path's outcome, exact checker's outcome): a record or the error's words."""
    outcomes = []
    for check in (wirefast.record_checker(cls, wirecheck.checker(cls)), wirecheck.checker(cls)):
        try:
            outcomes.append(check(data, cls.__name__))
        except protocol.ProtocolError as exc:
            outcomes.append(f"ProtocolError: {exc}")
    return outcomes[0], outcomes[1]


def wire_map(message: protocol.Message) -> dict[str, Any]:
    data = protocol.unpack(protocol.encode(message))
    del data["v"], data["k"]
    return data


def full_map(message: protocol.Message) -> dict[str, Any]:
    """Every field on the wire, defaults included (the map an older cpq sent)."""
    data = protocol.to_wire(message)
    return data if isinstance(data, dict) else {}


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.KIND)
def test_every_kind_round_trips_and_decodes_as_the_exact_checker_does(kind: type) -> None:
    message = example(kind)
    assert protocol.decode(protocol.encode(message)) == message
    for data in (wire_map(message), full_map(message)):
        fast, exact = decoded_both_ways(kind, data)
        assert fast == exact == message


@settings(max_examples=600, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    full=st.booleans(),
    edits=st.lists(
        st.tuples(st.integers(0, 40), st.sampled_from(["set", "drop", "add"]), VALUES), max_size=3
    ),
)
def test_corrupted_messages_decode_or_fail_exactly_as_the_exact_checker_says(
    kind: type, full: bool, edits: list[tuple[int, str, Any]]
) -> None:
    message = example(kind)
    data = full_map(message) if full else wire_map(message)
    for index, what, value in edits:
        target = data
        nested = [k for k, v in data.items() if isinstance(v, dict) and k != "kwargs"]
        if nested and index % 2:  # the result, the spec: a record inside the message
            target = data[nested[index % len(nested)]]
        names = sorted(target) or ["task_id"]
        name = names[index % len(names)]
        if what == "set":
            target[name] = value
        elif what == "drop":
            target.pop(name, None)
        else:
            target[f"unknown{index}"] = value
    fast, exact = decoded_both_ways(kind, data)
    assert fast == exact


def test_a_no_op_verdict_leaves_its_defaults_home() -> None:
    ranks = [RankResult(rank=r, outcome="passed") for r in range(2)]
    done = protocol.Done(TaskResult(task_id="t1", outcome="passed", ranks=ranks))
    assert wire_map(done) == {
        "result": {
            "task_id": "t1",
            "outcome": "passed",
            "ranks": [{"rank": 0, "outcome": "passed"}, {"rank": 1, "outcome": "passed"}],
        }
    }
    assert protocol.decode(protocol.encode(done)) == done


def test_a_value_of_another_type_than_its_default_is_sent() -> None:
    """0 is not 0.0's type: the field travels, and the checker decides (it takes an int for
    a float): leaving it out would hide what the sender put there."""
    result = RankResult(rank=0, outcome="passed", duration_s=0)  # type: ignore[arg-type]
    assert wire_map(protocol.RankDone(task_id="t1", result=result))["result"]["duration_s"] == 0
    unset = protocol.RankDone(task_id="t1", result=RankResult(rank=0, outcome="failed"))
    assert "duration_s" not in wire_map(unset)["result"]


WRONG = [None, True, 0, 1, 1.5, "x", "passed", b"x", [], ["x"], [1], [True], [["a", "b"]],
         [["a", 1]], [["a"]], [{}], {}, {"a": 1}, {"a": "b"}, {"a": None}]  # fmt: skip


def field_paths(data: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every field of a wire map, and of the records inside it (maps, lists of maps)."""
    paths = []
    for name, value in data.items():
        paths.append((*prefix, name))
        if isinstance(value, dict) and name not in ("kwargs", "env", "rng", "coverage"):
            paths += field_paths(value, (*prefix, name))
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            paths += field_paths(value[0], (*prefix, name, "0"))
    return paths


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.KIND)
def test_every_field_set_to_every_wrong_value_decodes_as_the_exact_checker_says(
    kind: type,
) -> None:
    """A table, not a sample: each field (nested ones too) of a full message of ``kind``
    set to each of a fixed list of values of other types and shapes (a bool for an int, an
    unknown outcome, a map of non-strings for variables, a malformed [name, value] pair)."""
    message = example(kind)
    if kind is protocol.RankDone:  # a result with an error and a report: more nested fields
        message.result = RankResult(rank=0, outcome="failed", error=protocol.RankError("E", "m"))
    base = full_map(message)
    for path in field_paths(base):
        for wrong in WRONG:
            data = protocol.unpack(protocol.pack(base))
            target = data
            for step in path[:-1]:
                target = target[int(step)] if step.isdigit() else target[step]
            target[path[-1]] = wrong
            fast, exact = decoded_both_ways(kind, data)
            assert fast == exact, (path, wrong)
