"""``pytest --cpq-confirm-fresh``: a test that fails on a warm group runs once more on a
group started for it, and that fresh run gives the verdict (docs/design.md, "Confirm on a
fresh group").

Why: a warm rank is a long-lived process. Whatever cpq's session boundary does not yet
restore (a project module's global, a library's singleton) can make a test fail on a warm
group that passes in a new ``torchrun -m pytest`` process of its own. A user who must trust
every verdict then gets the fresh one, and sees both: the report says "failed warm, passed
on a fresh group" with the warm failure attached as a section (shown with the test's other
sections; ``-rP`` shows a passed test's), or "failed fresh too"; the terminal summary counts
and lists both.

What is confirmed: a test whose ranks reported a failure (any phase), or a ``cpq.run`` whose
ranks failed, on a group that had served a task before (``TaskResult.on_fresh_group`` false:
a failure on a group's first task already is the fresh verdict). Not an infra error (a
deadline, a dead rank, no reports): ``--cpq-retries`` reruns those, each on a fresh group.
Each protocol run a rerun plugin makes is confirmed alike; xdist workers confirm their own
tests and their counts reach the controller's summary.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from cpq.protocol import TaskResult

CONFIRM_VAR = "CPQ_CONFIRM_FRESH"
PASSED_FRESH = "failed warm, passed on a fresh group"
FAILED_FRESH = "failed fresh too"
LABELS = (PASSED_FRESH, FAILED_FRESH)
#: The report's user property that carries the label (JUnit writes it as a property).
PROPERTY = "cpq_confirm_fresh"
#: What the pytest controller reads of an xdist worker's ``workeroutput``.
WORKER_KEY = "cpq_confirm_fresh"

#: This test's confirmation, until its report carries it: (label, the warm failure).
_PENDING = pytest.StashKey[tuple[str, str]]()
#: The session's confirmations: label -> node ids (an xdist controller's include its workers').
_SEEN = pytest.StashKey[dict[str, list[str]]]()


def add_options(parser: pytest.Parser, group: Any) -> None:
    group.addoption(
        "--cpq-confirm-fresh",
        action="store_true",
        default=False,
        help="rerun a test that failed on a warm group on a newly started one; the fresh "
        f"run gives the verdict ({CONFIRM_VAR}=1)",
    )
    parser.addini(
        "cpq_confirm_fresh", "confirm a warm failure on a fresh group", type="bool", default=False
    )


def enabled(config: pytest.Config) -> bool:
    """Command line, then ``CPQ_CONFIRM_FRESH``, then the ini option."""
    if config.getoption("cpq_confirm_fresh", False):
        return True
    env = os.environ.get(CONFIRM_VAR)
    if env is not None:
        return env not in ("", "0")
    return bool(config.getini("cpq_confirm_fresh"))


def wanted(config: pytest.Config, result: TaskResult, failed: bool) -> bool:
    """Whether a verdict whose test ``failed`` is confirmed on a fresh group."""
    return failed and not result.on_fresh_group and enabled(config)


def warm_text(result: TaskResult, failures: list[str]) -> str:
    """The warm failure as the report attaches it: where it ran, then what failed."""
    where = f"group {result.group_id}" if result.group_id else "a warm group"
    body = "\n".join(text for text in failures if text) or result.message or "(no report)"
    return f"on {where}, which had served tasks before:\n{body}\n"


def note(item: pytest.Item, fresh_failed: bool, warm: str) -> str:
    """Record the confirmation of ``item``'s test: its report carries it (:func:`attach`)
    and the session summary counts it. Returns the label."""
    label = FAILED_FRESH if fresh_failed else PASSED_FRESH
    item.stash[_PENDING] = (label, warm)
    item.config.stash.setdefault(_SEEN, {}).setdefault(label, []).append(item.nodeid)
    return label


def forget(item: pytest.Item) -> None:
    """A new protocol run of ``item`` (a rerun plugin's): no confirmation yet."""
    if _PENDING in item.stash:
        del item.stash[_PENDING]


def attach(item: pytest.Item, report: pytest.TestReport) -> None:
    """The reports carry the test's confirmation: the deciding phase's (call, or a failed
    setup) the label as a user property (for ``-v`` and the summary) and the warm failure
    as a section; the teardown's the label too (JUnit writes the teardown's properties)."""
    pending = item.stash.get(_PENDING, None)
    if pending is None:
        return
    label, warm = pending
    report.user_properties.append((PROPERTY, label))
    if report.when == "teardown":
        del item.stash[_PENDING]
    elif warm:
        report.sections.append((f"cpq: {label}; the warm failure", warm))
        item.stash[_PENDING] = (label, "")  # attached once


def label_of(report: pytest.TestReport | pytest.CollectReport) -> str:
    """The confirmation's label on ``report`` ("" none; a collection report has none)."""
    properties = getattr(report, "user_properties", ())
    return next((str(v) for k, v in properties if k == PROPERTY), "")


def teststatus(
    report: pytest.TestReport | pytest.CollectReport,
) -> tuple[str, str, tuple[str, dict[str, bool]]] | None:
    """``-v``'s word for a confirmed test: its outcome and the label."""
    label = label_of(report)
    if not label or hasattr(report, "wasxfail"):
        return None  # xfail and xpass keep pytest's words
    if report.when == "call" and report.passed:
        return "passed", ".", (f"PASSED ({label})", {"yellow": True})
    if report.when == "call" and report.failed:
        return "failed", "F", (f"FAILED ({label})", {"red": True})
    if report.when == "setup" and report.failed:
        return "error", "E", (f"ERROR ({label})", {"red": True})
    return None


def to_wire(config: pytest.Config) -> dict[str, list[str]]:
    return {label: list(ids) for label, ids in config.stash.get(_SEEN, {}).items()}


def merge(config: pytest.Config, data: Any) -> None:
    """An xdist worker's confirmations into the controller's."""
    if not isinstance(data, dict):
        return
    seen = config.stash.setdefault(_SEEN, {})
    for label, ids in data.items():
        if label in LABELS and isinstance(ids, list):
            seen.setdefault(label, []).extend(str(i) for i in ids)


def summary(config: pytest.Config) -> tuple[str, list[str]]:
    """The summary line's words ("" when nothing was confirmed) and a line per test."""
    seen = config.stash.get(_SEEN, {})
    if not any(seen.values()):
        return "", []
    words = "; confirmed fresh: " + ", ".join(f"{len(seen.get(lb, []))} {lb}" for lb in LABELS)
    lines = [f"cpq: {label}: {nodeid}" for label in LABELS for nodeid in seen.get(label, [])]
    return words, lines
