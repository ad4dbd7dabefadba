"""The order a session runs its tests in: grouped by the group spec they need.

Why: the reference for a suite of several world sizes is one fresh ``torchrun -m pytest``
per world size, each running its own tests one after another. A single session that
alternates specs (a ws=1 test, a ws=4 test, a ws=1 test, ...) makes the broker hold every
spec's group at once; on a small budget (a 2-core box, a 2-GPU workstation with ws=1 and
ws=2 tests) it would stop and start groups between neighbours. So after collection, and
after any plugin shuffled it (pytest-randomly), the tests are grouped by the spec they run
on: each spec's tests keep their order, specs come in the order their first test came, and
tests that run in the pytest process (no cpq marker) count as one more spec.

``--cpq-keep-order`` (``CPQ_KEEP_ORDER=1``, ini ``cpq_keep_order``) keeps the collected
order. Every xdist worker computes the same order from the same collection, as xdist asks.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

import pytest

T = TypeVar("T")

KEEP_ORDER_VAR = "CPQ_KEEP_ORDER"


def add_options(parser: pytest.Parser, group: Any) -> None:
    group.addoption(
        "--cpq-keep-order",
        action="store_true",
        default=False,
        help="run tests in collection order, not grouped by the world size and spec they "
        f"need ({KEEP_ORDER_VAR}=1)",
    )
    parser.addini("cpq_keep_order", "run tests in collection order", type="bool", default=False)


def keep_order(config: pytest.Config) -> bool:
    env = os.environ.get(KEEP_ORDER_VAR)
    if config.getoption("cpq_keep_order", False):
        return True
    if env is not None:
        return env not in ("", "0")
    return bool(config.getini("cpq_keep_order"))


def grouped(items: Sequence[T], key: Callable[[T], Hashable]) -> list[T]:
    """``items`` grouped by ``key``: groups in order of first appearance, stable within."""
    groups: dict[Hashable, list[T]] = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return [item for members in groups.values() for item in members]
