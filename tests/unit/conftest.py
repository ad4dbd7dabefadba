"""The unit tier: cpq's pure logic on in-memory fakes, without processes or sockets.

Every test here runs with sockets and child processes forbidden, so a test that quietly
starts a real broker or opens a ZeroMQ socket fails instead of slowing the tier down (the
end-to-end tests, one folder up, are where real processes and sockets belong). The shared
broker of ``tests/conftest.py`` is not started for a run of this folder alone.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
import zmq


def _forbidden(what: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"the unit tier runs without {what} (tests/unit/conftest.py)")

    return refuse


@pytest.fixture(autouse=True)
def no_processes_or_sockets(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(zmq.Context, "socket", _forbidden("sockets"))
    monkeypatch.setattr(subprocess.Popen, "__init__", _forbidden("child processes"))
    monkeypatch.setattr(os, "fork", _forbidden("child processes"))
    yield
