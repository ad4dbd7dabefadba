"""The dispatch path's caches (issue 15) change nothing a task sees.

A submit reads the caller's environment and builds its pool spec on every call; both are
cached now (``cpq.client.caller_environ``, ``make_spec``), and the decoder checks maps and
lists of strings in one pass (``cpq.wirecheck``). These tests pin that a variable set,
changed or removed between two submits still counts, that a different start variable still
makes a different spec, and that a wrong value is still refused.
"""

from __future__ import annotations

import pytest

from cpq import protocol
from cpq.client import caller_environ, make_spec

from .fakes import spec


def test_the_callers_environment_is_read_afresh_on_every_submit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CPQ_TEST_TASK_VAR", raising=False)
    start, task = caller_environ()
    assert "CPQ_TEST_TASK_VAR" not in task
    monkeypatch.setenv("CPQ_TEST_TASK_VAR", "1")
    assert caller_environ()[1]["CPQ_TEST_TASK_VAR"] == "1"
    monkeypatch.setenv("CPQ_TEST_TASK_VAR", "2")
    assert caller_environ()[1]["CPQ_TEST_TASK_VAR"] == "2"
    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # a start variable: part of the spec
    start, task = caller_environ()
    assert start["OMP_NUM_THREADS"] == "7" and "OMP_NUM_THREADS" not in task
    monkeypatch.delenv("CPQ_TEST_TASK_VAR")
    assert "CPQ_TEST_TASK_VAR" not in caller_environ()[1]


def test_a_caller_cannot_change_the_cached_environment_through_a_result() -> None:
    _, task = caller_environ()
    task["CPQ_TEST_INJECTED"] = "x"
    assert "CPQ_TEST_INJECTED" not in caller_environ()[1]


def test_equal_inputs_share_a_spec_and_a_start_variable_makes_another() -> None:
    one = make_spec(2, None, ["/p"], caller_env={"OMP_NUM_THREADS": "1"})
    assert make_spec(2, None, ["/p"], caller_env={"OMP_NUM_THREADS": "1"}) is one
    other = make_spec(2, None, ["/p"], caller_env={"OMP_NUM_THREADS": "2"})
    assert other != one and dict(other.env)["OMP_NUM_THREADS"] == "2"
    assert make_spec(2, {"A": "1"}, ["/p"], caller_env={}) != make_spec(
        2, None, ["/p"], caller_env={}
    )
    assert make_spec(2, None, ["/q"], caller_env={}).roots == ["/q"]


@pytest.mark.parametrize(
    ("field", "value"),
    [("env", {"A": "1", "B": 2}), ("env", {"A": None})],
)
def test_a_map_of_strings_with_a_wrong_value_is_still_refused(field: str, value: object) -> None:
    message = protocol.Submit(task_id="t", target="m:f", spec=spec(2))
    wire = protocol.unpack(protocol.encode(message))
    wire[field] = value
    with pytest.raises(protocol.ProtocolError, match=r"submit\.env: expected str"):
        protocol.decode(protocol.pack(wire))


def test_a_list_of_strings_with_a_wrong_item_is_still_refused() -> None:
    message = protocol.Submit(task_id="t", target="m:f", spec=spec(2))
    wire = protocol.unpack(protocol.encode(message))
    wire["spec"]["roots"] = ["/ok", 3]
    with pytest.raises(protocol.ProtocolError, match=r"submit\.spec\.roots: expected str"):
        protocol.decode(protocol.pack(wire))
    wire["spec"]["roots"] = ["/ok"]
    decoded = protocol.decode(protocol.pack(wire))
    assert isinstance(decoded, protocol.Submit) and decoded.spec.roots == ["/ok"]
