"""The broker's log file, which must never be the reason the broker stops serving.

A full or broken disk under ``--log-dir`` makes every write to ``broker.log`` fail. The
standard :class:`logging.FileHandler` then prints a traceback to stderr for every record;
this handler says so once, clearly, keeps the broker running (records still reach the
other handlers, stderr included), and says so again when writes work again.
"""

from __future__ import annotations

import contextlib
import logging
import sys


class LogFileHandler(logging.FileHandler):
    def __init__(self, filename: str, **kwargs: object) -> None:
        super().__init__(filename, **kwargs)  # type: ignore[arg-type]
        self.failures = 0
        self._failing = False
        self._last_ok = True

    def emit(self, record: logging.LogRecord) -> None:
        self._last_ok = True
        super().emit(record)  # calls handleError on failure
        if self._failing and self._last_ok:
            self._failing = False
            _warn(f"cpq: writing the log file {self.baseFilename} works again")

    def handleError(self, record: logging.LogRecord) -> None:
        self._last_ok = False
        self.failures += 1
        if self.stream is not None:
            # Drop what the failed write left buffered (it would grow while the disk stays
            # full); those lines reached stderr. The file is reopened on the next record.
            with contextlib.suppress(OSError, ValueError):
                self.stream.close()
            self.stream = None
        if self._failing:
            return
        self._failing = True
        _warn(
            f"cpq: WARNING: cannot write the log file {self.baseFilename} "
            f"({sys.exc_info()[1]}); the broker keeps serving and logs to stderr only until "
            "writes work again"
        )


def _warn(text: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
