"""Plugins cpq adds to a rank's pytest session (:mod:`cpq.rank.items`): what the test's
protocol reported, and a terminal reporter that writes nowhere (reporting is the calling
process's)."""

from __future__ import annotations

from typing import Any


class Recorder:
    """A plugin in the rank's session: what the item's protocol reported, and which phase
    runs now."""

    def __init__(self) -> None:
        self.reports: list[Any] = []
        self.warnings: list[dict[str, Any]] = []
        self.failure: BaseException | None = None
        self.collect_failures: list[Any] = []

    def clear(self) -> None:
        self.reports, self.warnings, self.failure = [], [], None

    def pytest_runtest_logreport(self, report: Any) -> None:
        self.reports.append(report)

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            self.collect_failures.append(report)

    def pytest_exception_interact(self, node: Any, call: Any, report: Any) -> None:
        if self.failure is None and call.excinfo is not None and report.failed:
            self.failure = call.excinfo.value

    def pytest_warning_recorded(
        self, warning_message: Any, when: str, nodeid: str, location: Any
    ) -> None:
        category = warning_message.category
        self.warnings.append(
            {
                "message": str(warning_message.message),
                "category": f"{category.__module__}:{category.__qualname__}",
                "filename": str(warning_message.filename),
                "lineno": int(warning_message.lineno or 0),
                "when": when,
                "nodeid": nodeid,
            }
        )


class QuietReporter:
    """Stands for pytest's terminal reporter in a rank: its writer and its writing methods,
    which write nowhere; no hooks."""

    def __init__(self, config: Any, writer: Any) -> None:
        self.config = config
        self._tw = writer
        self.stats: dict[str, list[Any]] = {}
        self.verbosity = 0
        self.isatty = False

    def _nothing(self, *args: Any, **kwargs: Any) -> None:
        return None

    write = write_line = line = section = write_sep = rewrite = ensure_newline = _nothing
