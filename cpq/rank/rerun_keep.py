"""A failed attempt that the caller's rerun plugin will run again keeps its module, class
and package fixtures standing in the rank, as pytest-rerunfailures keeps them in a fresh
process (docs/design.md, "The ranks run pytest").

pytest-rerunfailures reruns a failed test in the process that ran it. Before the failed
attempt's teardown it takes every node but the test's own off pytest's setup stack (its
``pytest_runtest_teardown``), so that only the function's fixtures are torn down and the
rerun finds the module's fixtures as the first attempt left them (a module fixture counting
attempts sees two); it clears the cached results of fixtures that failed, so that they run
again, and the test class's instance, so that the rerun gets a fresh one. The plugin runs
in the calling process (its protocol loop is the caller's: ``items.BLOCKED_PLUGINS``), and
the ranks run the test's protocol, so a rank does the same here: when the caller says a
rerun may follow this attempt (its count of attempts against ``--reruns``) and the attempt
failed in this rank (its setup or its call, not an expected failure), only the test is torn
down; the rest stays on the stack for the rerun, and the last attempt is torn down towards
the caller's next test as any test is.
"""

from __future__ import annotations

from typing import Any


def plugin() -> Any:
    """The rank session's plugin (pytest imported only when a session starts)."""
    import pytest

    class KeepForRerun:
        def __init__(self) -> None:
            #: Set by the rank for each attempt: the caller's rerun plugin may run it again.
            self.rerun_may_follow = False
            self.failed = False

        def pytest_runtest_logreport(self, report: Any) -> None:
            if report.when in ("setup", "call") and report.failed:
                self.failed = self.failed or not hasattr(report, "wasxfail")

        @pytest.hookimpl(wrapper=True, tryfirst=True)
        def pytest_runtest_teardown(self, item: Any, nextitem: Any) -> Any:
            __tracebackhide__ = True  # cpq's, not the test's (a fresh run shows no such frame)
            if not (self.rerun_may_follow and self.failed):
                return (yield)
            state = item.session._setupstate
            kept = {node: entry for node, entry in state.stack.items() if node is not item}
            for node in kept:
                del state.stack[node]
            try:
                return (yield)  # pytest tears down what is left: the test's own
            finally:
                standing = dict(state.stack)
                state.stack.clear()
                state.stack.update(kept)
                state.stack.update(standing)
                _forget_failed_fixtures(item)
                _forget_instance(item)

    return KeepForRerun()


def _forget_failed_fixtures(item: Any) -> None:
    """A fixture whose setup failed runs again in the rerun (its cached error dropped)."""
    info = getattr(item, "_fixtureinfo", None)
    for definitions in getattr(info, "name2fixturedefs", {}).values():
        for definition in definitions:
            cached = getattr(definition, "cached_result", None)
            if cached is not None and cached[2] is not None:
                definition.cached_result = None
                finalizers = getattr(definition, "_finalizers", None)
                if finalizers is not None:
                    finalizers.clear()


def _forget_instance(item: Any) -> None:
    """The rerun gets a fresh instance of the test's class."""
    if getattr(item, "_instance", None) is not None:
        del item._instance
        item._obj = None
