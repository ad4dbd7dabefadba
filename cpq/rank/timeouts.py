"""pytest-timeout in a rank: its signal method times the test here, as in a fresh rank.

A fresh rank of ``torchrun -m pytest`` with pytest-timeout ends a test past its timeout with
SIGALRM: the test fails with pytest-timeout's ``Failed: Timeout (>Ns) from pytest-timeout.``
at the line it was on, its fixtures are torn down, and the process goes on to the next test.
So a rank's session keeps pytest-timeout (when the caller's session has it) and lets its
signal method arm as it would there: the same failure, the same traceback, and the group
serves the next test. The caller gives the broker a deadline a little later
(:mod:`cpq.client.timeouts`), which still ends a rank that SIGALRM cannot reach (one blocked
in a collective's C++ wait never runs the Python handler): its stacks are collected and the
group is stopped, as before.

The thread method is not armed here: on timeout it dumps the stacks and ``os._exit``\\ s, which
would take a warm rank down; the broker's deadline times such a test (the group is stopped,
the test fails with pytest-timeout's message), as it did for every timed test before.
"""

from __future__ import annotations

from typing import Any

import pytest

#: pytest-timeout's own stash key is private; this one marks a timer this plugin claimed.
_CLAIMED = pytest.StashKey[bool]()


class InRank:
    """Registered in each rank's pytest session (:class:`cpq.rank.items.RankSession`).

    :attr:`untimed` is set for an attempt whose caller's timer is spent: in a fresh run,
    pytest-timeout times the whole protocol (``func_only`` off) and cancels its timer at the
    first failure (its ``pytest_exception_interact``), so a rerun plugin's later attempts of
    the test run untimed; each attempt here is a protocol of its own, which would arm the
    timer again (a newcomer's trial: a test that timed out, then passed on its rerun in the
    fresh run, failed its rerun here).
    """

    def __init__(self) -> None:
        self.untimed = False

    @pytest.hookimpl(optionalhook=True, tryfirst=True)
    def pytest_timeout_set_timer(self, item: Any, settings: Any) -> bool | None:
        spent = self.untimed and not getattr(settings, "func_only", False)
        if getattr(settings, "method", "signal") == "signal" and not spent:
            return None  # pytest-timeout's own: SIGALRM, as in a fresh rank
        item.stash[_CLAIMED] = True
        return True  # nothing armed: the broker's deadline times it (or nothing: spent)

    @pytest.hookimpl(optionalhook=True, tryfirst=True)
    def pytest_timeout_cancel_timer(self, item: Any) -> bool | None:
        stash = getattr(item, "stash", None)
        if stash is None or not stash.get(_CLAIMED, False):
            return None
        del stash[_CLAIMED]
        return True
