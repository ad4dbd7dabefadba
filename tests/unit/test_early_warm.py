"""Which of the cache's specs a session asks for before its conftests (early_warm.cached_specs)."""

from __future__ import annotations

import dataclasses

from cpq import protocol
from cpq.client.early_warm import cached_specs
from cpq.protocol import PoolSpec

HERE = PoolSpec(
    world_size=1,
    python="/usr/bin/python3",
    roots=["/proj"],
    env=[["NCCL_DEBUG", "WARN"]],
)


def entry(spec: PoolSpec, count: int = 1) -> dict[str, object]:
    return {"spec": protocol.to_wire(spec), "count": count}


def test_a_spec_with_more_start_variables_is_asked_for() -> None:
    """What a conftest's ``pytest_configure`` set last time (Megatron-LM's ``NCCL_*``) is
    in the cache, not yet in this process: the spec is still this session's."""
    cached = dataclasses.replace(HERE, env=[["NCCL_DEBUG", "WARN"], ["NCCL_MAX_NCHANNELS", "1"]])
    assert cached_specs([entry(cached, 2)], HERE) == ([cached], [2])


def test_a_start_variable_of_another_value_or_missing_is_not() -> None:
    other_value = dataclasses.replace(HERE, env=[["NCCL_DEBUG", "INFO"]])
    missing = dataclasses.replace(HERE, env=[])
    assert cached_specs([entry(other_value), entry(missing)], HERE) == ([], [])


def test_other_roots_or_interpreter_are_not() -> None:
    roots = dataclasses.replace(HERE, roots=["/elsewhere"])
    python = dataclasses.replace(HERE, python="/opt/python3")
    assert cached_specs([entry(roots), entry(python), entry(HERE, 3)], HERE) == ([HERE], [3])


def test_an_entry_of_another_shape_asks_for_nothing() -> None:
    assert cached_specs([entry(HERE), {"spec": {"world_size": "x"}, "count": 1}], HERE) == ([], [])
    assert cached_specs([{"count": 1}], HERE) == ([], [])
    assert cached_specs({"spec": 1}, HERE) == ([], [])
    assert cached_specs(None, HERE) == ([], [])
