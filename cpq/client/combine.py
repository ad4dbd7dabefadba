"""The ranks' reports of one test, combined into the test's report per phase.

``torchrun --nproc-per-node N -m pytest`` gives N reports of every test, one per rank; the
run fails when any rank fails. cpq gives pytest one report per phase, made from the ranks':

* **failed** when any rank failed that phase: the first failing rank's report (pytest's own
  long report, with its ``>`` and ``E`` lines), each other failing rank's report as a section
  unless it is the same text (then the ranks are named once), and a last ``cpq`` section
  saying which ranks failed in which group;
* **skipped** when every rank skipped (xfail included: a test every rank xfailed is xfailed);
* a skip taken on some ranks while others ran is a **failure**: in a fresh run the ranks that
  ran would wait in their first collective for the ones that left;
* **passed** otherwise.

Captured sections keep pytest's titles; with more than one rank every line says its rank
(JUnit's ``<system-out>`` joins sections without their titles). A phase's duration is the
slowest rank's (the test's own time in the ranks, never the wait for a group).

Fail closed: a verdict whose reports do not cover every rank exactly once, or do not decode
as pytest's test reports, gives ``None`` (the caller reports cpq's error); a verdict the
broker failed whose reports show no failure fails the test all the same.
"""

from __future__ import annotations

import io
import re
from typing import Any

import pytest

from cpq.protocol import TaskResult

PHASES = ("setup", "call", "teardown")


def phases(
    result: TaskResult, world_size: int, config: pytest.Config
) -> dict[str, pytest.TestReport] | None:
    """Each phase's combined report; None when the verdict has no complete set of reports."""
    if result.outcome == "error" or sorted(r.rank for r in result.ranks) != list(range(world_size)):
        return None
    by_rank: dict[int, dict[str, pytest.TestReport]] = {}
    for rank in sorted(result.ranks, key=lambda r: r.rank):
        decoded = [_decode(config, data) for data in rank.reports]
        if not decoded or any(report is None for report in decoded):
            return None
        phases_of: dict[str, pytest.TestReport] = {r.when: r for r in decoded if r is not None}
        if "setup" not in phases_of or len(phases_of) != len(decoded):
            return None
        setup = phases_of["setup"]
        if setup.passed and "call" not in phases_of and not _setup_only(config):
            return None  # a rank whose setup passed ran the test: its call report is missing
        by_rank[rank.rank] = phases_of
    combined: dict[str, pytest.TestReport] = {}
    for when in PHASES:
        present = [(rank, reports[when]) for rank, reports in by_rank.items() if when in reports]
        if present:
            combined[when] = combine_phase(present, world_size, result.group_id)
    if result.outcome == "failed" and not any(r.failed for r in combined.values()):
        calls = [rs["call"] for rs in by_rank.values() if "call" in rs]
        xfailed = bool(calls) and all(hasattr(r, "wasxfail") for r in calls)
        if not xfailed:
            last = combined["call" if "call" in combined else "setup"]
            last.outcome = "failed"
            last.longrepr = (
                f"cpq: the ranks' verdict is failed ({result.message}), no report says why"
            )
    return combined


def combine_phase(
    present: list[tuple[int, pytest.TestReport]], world_size: int, group: str
) -> pytest.TestReport:
    """One phase's report from the ranks that reached it (pure; see the module docstring)."""
    failed = [(rank, report) for rank, report in present if report.failed]
    skipped = [(rank, report) for rank, report in present if report.skipped]
    every_xfail = all(hasattr(report, "wasxfail") for _, report in present)
    notes: list[tuple[str, str]] = []  # cpq's sections, added once the phase's are set
    if failed:
        first, base = failed[0]
        text = _without_addresses(base.longreprtext)
        same = [r for r, report in failed if _without_addresses(report.longreprtext) == text]
        for rank, report in failed:
            if rank not in same:
                notes.append((f"rank {rank}", full_text(report)))
        whose = f"the report above is rank {first}'s"
        if len(same) > 1:
            whose += f", the same on rank(s) {same[1:]}"
        failing = [rank for rank, _ in failed]
        notes.append(
            ("cpq", f"failed on rank(s) {failing} of {world_size} (group {group}); {whose}")
        )
    elif skipped and len(skipped) < len(present) and not every_xfail:
        base = present[0][1]
        ran = [rank for rank, report in present if not report.skipped]
        reason = _reason(skipped[0][1])
        base.outcome = "failed"
        base.longrepr = (
            f"skipped on rank(s) {[rank for rank, _ in skipped]} ({reason}) but ran on rank(s) "
            f"{ran}: a skip must be taken on every rank (in a fresh run the ranks that ran "
            "would wait for the others in their first collective)"
        )
    elif skipped:
        base = skipped[0][1]
    else:
        base = present[0][1]
    base.sections = _sections(present, world_size)
    for name, text in notes:
        add_section(base, name, text)
    base.duration = max(report.duration for _, report in present)
    starts = [getattr(report, "start", 0.0) for _, report in present]
    stops = [getattr(report, "stop", 0.0) for _, report in present]
    base.start, base.stop = min(starts), max(stops)
    properties: list[tuple[str, object]] = []
    for _, report in present:
        for pair in report.user_properties:
            if tuple(pair) not in properties:
                properties.append(tuple(pair))  # type: ignore[arg-type]
    base.user_properties = properties
    return base


_ADDRESS = re.compile(r"\b0x[0-9a-fA-F]{6,}\b")


def _without_addresses(text: str) -> str:
    """A report's text with object addresses (``<object object at 0x7f...>``) blanked: each
    rank's objects live at other addresses, and that alone is not another failure."""
    return _ADDRESS.sub("0x…", text)


def _setup_only(config: pytest.Config) -> bool:
    return bool(config.getoption("setuponly", False) or config.getoption("setupplan", False))


def add_section(report: pytest.TestReport, name: str, text: str) -> None:
    """A titled section after a failure's report, under pytest's full-width separator: the
    traceback's own sections where the report is one; else (a text: a fixture not found,
    a strict XPASS) the report's sections, which pytest prints after it the same way. Not
    into the text: JUnit's failure message is the text itself, and must read as a fresh
    run's (``tests/fanout/test_pytest_fidelity.py``)."""
    longrepr: Any = report.longrepr
    if hasattr(longrepr, "addsection"):
        longrepr.addsection(name, text)
    else:
        report.sections.append((name, text))


def full_text(report: pytest.TestReport) -> str:
    """The report as pytest prints it, without markup — its first line's indentation
    kept (``longreprtext`` strips it: a rank's ``    def test_x():`` lost its four spaces)."""
    from _pytest._io import TerminalWriter

    out = io.StringIO()
    writer = TerminalWriter(out)
    writer.hasmarkup = False
    report.toterminal(writer)
    return out.getvalue().strip("\n").rstrip()


def _reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    return str(longrepr[2]) if isinstance(longrepr, tuple) else "skipped"


def _sections(present: list[tuple[int, pytest.TestReport]], world_size: int) -> list[Any]:
    if world_size == 1:
        return list(present[0][1].sections)
    out = []
    for rank, report in present:
        for title, text in report.sections:
            labelled = "".join(f"[rank {rank}] {line}" for line in text.splitlines(True))
            out.append((title, labelled))
    return out


def _decode(config: pytest.Config, data: Any) -> pytest.TestReport | None:
    """A rank's serialised report as pytest's (msgpack made its tuples lists)."""
    if not isinstance(data, dict) or data.get("$report_type") != "TestReport":
        return None
    data = dict(data)
    if isinstance(data.get("location"), list):
        data["location"] = tuple(data["location"])
    if isinstance(data.get("longrepr"), list):
        data["longrepr"] = tuple(data["longrepr"])
    data["user_properties"] = [tuple(p) for p in data.get("user_properties") or []]
    data["sections"] = [tuple(s) for s in data.get("sections") or []]
    try:
        report = config.hook.pytest_report_from_serializable(config=config, data=data)
    except Exception:
        return None
    if not isinstance(report, pytest.TestReport) or report.when not in PHASES:
        return None
    return report
