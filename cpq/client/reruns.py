"""How many infra retries a cpq test gets (the plugin's retry policy).

cpq retries an infra failure (a missed deadline, a dead or silent rank, a group that would
not start) on a fresh group; ``--cpq-retries N`` / ``CPQ_RETRIES`` / ini ``cpq_retries`` set
how many times (default 1, 0 = off). When a rerun plugin reruns the test itself
(pytest-rerunfailures' ``--reruns``/``@pytest.mark.flaky(reruns=...)``, flaky's ``@flaky`` or
``--force-flaky``), cpq's own retry steps aside: the plugin's reruns are the only ones, so a
test that hangs costs ``reruns + 1`` deadlines, not twice that. Under pytest-timeout a test
gets its timeout as the task's deadline (``cpq.client.timeouts``): no retry either. The
broker applies the count (``cpq.broker.tasks.Tasks.retry_once``).
"""

from __future__ import annotations

import importlib
import os

import pytest

RETRIES_VAR = "CPQ_RETRIES"
DEFAULT_RETRIES = 1


def add_options(parser: pytest.Parser, group: pytest.OptionGroup) -> None:
    group.addoption(
        "--cpq-retries",
        type=int,
        default=None,
        metavar="N",
        help="retries of an infra failure on a fresh group (default 1; 0: off; "
        f"{RETRIES_VAR}); none when a rerun plugin reruns the test",
    )
    parser.addini("cpq_retries", "retries of an infra failure on a fresh group", default="")


def configured(config: pytest.Config) -> int:
    """The session's retry count: command line, then ``CPQ_RETRIES``, then ini."""
    for value, where in (
        (config.getoption("cpq_retries"), "--cpq-retries"),
        (os.environ.get(RETRIES_VAR), RETRIES_VAR),
        (config.getini("cpq_retries"), "cpq_retries"),
    ):
        if value is None or value == "":
            continue
        return whole_number(value, where, least=0)
    return DEFAULT_RETRIES


def whole_number(value: object, where: str, least: int) -> int:
    """An option's value as a whole number of at least ``least``; a usage error naming
    ``where`` otherwise (the plugin's counting options share this)."""
    try:
        count: int = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise pytest.UsageError(f"{where} must be a whole number, got {value!r}") from None
    if count < least:
        raise pytest.UsageError(f"{where} must be {least} or more, got {count}")
    return count


def rerun_by_plugin(item: pytest.Item) -> str:
    """The rerun plugin that reruns ``item`` when it fails ("" when none does)."""
    manager = item.config.pluginmanager
    if manager.hasplugin("rerunfailures"):
        # Imported by name: the plugin is optional (and ships no type information).
        plugin = importlib.import_module("pytest_rerunfailures")
        if (plugin.get_reruns_count(item) or 0) > 0:
            return "pytest-rerunfailures"
    if manager.hasplugin("flaky"):
        function = getattr(item, "function", None)
        runs = getattr(item, "_flaky_max_runs", None) or getattr(function, "_flaky_max_runs", None)
        if (runs or 0) > 1 or getattr(item.config.option, "force_flaky", False):
            return "flaky"
    return ""


def rerun_may_follow(item: pytest.Item) -> bool:
    """Whether a rerun plugin may run ``item`` again after the attempt about to start.

    A fresh run reruns a test in the process that ran it: the module state the first
    attempt left (a counter, a cache) is what the rerun finds. The ranks keep the calling
    session open after its last test for such an attempt (``cpq.rank.items.run_item``), so
    that a rerun finds it there too. flaky may rerun a passing test (``min_passes``), so
    under flaky every attempt may be followed."""
    which = rerun_by_plugin(item)
    if which == "pytest-rerunfailures":
        plugin = importlib.import_module("pytest_rerunfailures")
        attempt = getattr(item, "execution_count", 1)  # the plugin counts before each attempt
        return bool(attempt <= (plugin.get_reruns_count(item) or 0))
    return which == "flaky"


def retries_for(item: pytest.Item, configured_retries: int, timed: bool) -> int:
    """Infra retries for this test's task: none under a rerun plugin or pytest-timeout."""
    if timed or rerun_by_plugin(item):
        return 0
    return configured_retries
