"""pytest-timeout and cpq tests: the ranks' deadline is the test's timeout.

pytest-timeout ends a test from inside the pytest process (SIGALRM, or a thread that exits
the process). For a test whose body runs on the ranks that would show cpq's client thread
waiting for a verdict, and leave the task running on its group. So for a test the ranks run
cpq takes pytest-timeout's timer here (its ``pytest_timeout_set_timer`` hook):

* **signal method** (pytest-timeout's default): each rank's own pytest-timeout times the
  test, as in a fresh rank (:mod:`cpq.rank.timeouts`): the test fails there with
  pytest-timeout's failure and traceback, and the group goes on to the next test. The
  broker's deadline is :data:`RANKS_SLACK_S` later, for a rank SIGALRM cannot reach (blocked
  in a collective's C++ wait): then as below;
* **thread method**: what is left of the timeout is the broker's deadline for the task: when
  it passes, the broker collects every rank's stack, stops the task's group (the next test
  runs on the spare group, without waiting for a spawn) and the test fails with
  pytest-timeout's own message (its JUnit message) and where each rank was on the test's
  captured stderr, where pytest-timeout puts its own stack dump. The task is not retried.

The deadline runs from the moment a rank begins the test's protocol: the rank's pytest
session build before it (plugins, conftests, collection; the broker allows it the start
allowance a spawn gets) is not the test's time, as pytest-timeout does not time a fresh
run's collection either.

pytest-timeout's own timer still runs, :data:`BACKSTOP_S` later than the test's timeout and
the build's allowance: it bounds what the broker's deadline cannot — a fixture that hangs
in the test's setup or teardown, a verdict that never comes — as it would in a fresh run
(with that much slack).

Tests using the ``cpq`` fixture run their body here; pytest-timeout times them as usual,
and the client cancels the task it was waiting for when the timeout interrupts it.
"""

from __future__ import annotations

import time

import pytest

from cpq.protocol import TaskResult

#: (timeout in seconds, when the timer was set, the deadline's slack beyond it): the timer
#: cpq took from pytest-timeout.
TIMER_KEY = pytest.StashKey[tuple[float, float, float]]()
#: How much later than a signal-method timeout the broker's deadline comes: the ranks' own
#: SIGALRM fails the test first, and reports it, fixtures torn down (a newcomer's trial:
#: a stopped group's bare message was all a timed-out test showed).
RANKS_SLACK_S = 5.0
#: Set while the item runs on the ranks (:mod:`cpq.client.items` sets it: it imports this
#: module, never the other way round).
ON_RANKS_KEY = pytest.StashKey[bool]()
#: Set when cpq's timer of this protocol run was cancelled (pytest-timeout cancels it at
#: the first failure, and at the protocol's end): a rerun's attempt after it is untimed, as
#: in a fresh run (``untimed``: :class:`cpq.rank.timeouts.InRank`). Cleared when the protocol
#: starts.
SPENT_KEY = pytest.StashKey[bool]()
#: pytest-timeout's failure message (``pytest_timeout.PYTEST_FAILURE_MESSAGE``).
FAILURE_MESSAGE = "Timeout (>%ss) from pytest-timeout."
#: How much later than the test's timeout pytest-timeout's own timer fires: after the
#: broker's deadline, its stack collection and the verdict's way back.
BACKSTOP_S = 10.0
#: What the broker allows a rank's pytest session build before the test's deadline starts
#: (its ``--start-timeout``'s default): the backstop waits for it too.
BUILD_ALLOWANCE_S = 300.0


def _runs_on_ranks(item: pytest.Item) -> bool:
    """A test that runs on the ranks now: its protocol is hollow here (cpq.client.items),
    so pytest-timeout's signal would only interrupt the wait. A marker test in the fixture
    style runs its body here: pytest-timeout's own timer, as it is."""
    return item.stash.get(ON_RANKS_KEY, False)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: object) -> bool | None:
    if not _runs_on_ranks(item) or not hasattr(settings, "_replace"):
        return None  # pytest-timeout's own timer, as it is
    in_ranks = getattr(settings, "method", "") == "signal"  # cpq.rank.timeouts arms it there
    slack = RANKS_SLACK_S if in_ranks else 0.0
    item.stash[TIMER_KEY] = (float(getattr(settings, "timeout")), time.monotonic(), slack)  # noqa: B009
    import pytest_timeout  # here only when pytest-timeout calls: it is installed

    later = settings._replace(timeout=item.stash[TIMER_KEY][0] + BUILD_ALLOWANCE_S + BACKSTOP_S)
    pytest_timeout.pytest_timeout_set_timer(item, later)  # the backstop (module docstring)
    return True


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> bool | None:
    if TIMER_KEY not in item.stash:
        return None
    del item.stash[TIMER_KEY]
    item.stash[SPENT_KEY] = True
    import pytest_timeout

    pytest_timeout.pytest_timeout_cancel_timer(item)  # the backstop's
    return True


def spent(item: pytest.Item) -> bool:
    """Whether this protocol run's timer was cancelled before the attempt about to be sent
    (an earlier attempt failed): the ranks then arm none for it, as a fresh run arms none."""
    return item.stash.get(SPENT_KEY, False)


def reset_spent(item: pytest.Item) -> None:
    if SPENT_KEY in item.stash:
        del item.stash[SPENT_KEY]


def remaining(item: pytest.Item) -> float | None:
    """What is left of the test's pytest-timeout (None: not timed by it)."""
    timer = item.stash.get(TIMER_KEY, None)
    if timer is None:
        return None
    timeout, started, slack = timer
    left = timeout - (time.monotonic() - started)
    if left <= 0:  # setup used it all up
        pytest.fail(FAILURE_MESSAGE % timeout, pytrace=False)
    return left + slack


def fail_if_timed_out(item: pytest.Item, result: TaskResult) -> None:
    """Fail the test as pytest-timeout would, with the ranks' stacks, if its deadline passed."""
    timer = item.stash.get(TIMER_KEY, None)
    # The verdict's cause, not its words: a broker without the feature ``verdict-cause``
    # sends none, and its deadline is then reported as the error it is.
    if timer is None or result.outcome != "error" or result.cause != "deadline":
        return
    first, _, detail = result.message.partition("\n")
    # pytest-timeout's message is the failure (JUnit's message too); its stack dump goes to
    # stderr, where cpq's word and each rank's stack go as well.
    lines = [f"cpq: {first}; the group was stopped", *([detail] if detail else [])]
    item.add_report_section("call", "stderr", "\n".join(lines) + "\n")
    pytest.fail(FAILURE_MESSAGE % timer[0], pytrace=False)
