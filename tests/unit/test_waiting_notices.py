"""The broker's word on why a test waits (cpq.client.session._Notices): a notice the broker
repeats while the wait lasts is said once; a changed one is said again."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from cpq.client.session import _Notices


def _config() -> Any:
    """A pytest config without a terminal (as an xdist worker's): notices go to stderr."""
    manager = SimpleNamespace(get_plugin=lambda name: None)
    return SimpleNamespace(pluginmanager=manager, getoption=lambda *a, **k: "fd")


def test_a_repeated_notice_is_said_once_and_a_new_one_again(
    capsys: pytest.CaptureFixture[str],
) -> None:
    notices = _Notices(_config(), "test_x.py::test_y")
    for notice in ["waiting for a ws2/auto group: 1 starting"] * 3 + [
        "waiting for a ws2/auto group: 1 busy",
        "waiting for a ws2/auto group: 1 busy",
    ]:
        notices.say(notice)
    assert capsys.readouterr().err.splitlines() == [
        "cpq: waiting for a ws2/auto group: 1 starting",
        "cpq: waiting for a ws2/auto group: 1 busy",
    ]
