"""File-descriptor level capture of one task's stdout and stderr (rank side).

Capturing ``sys.stdout`` alone would miss what C++ and CUDA libraries write (NCCL warnings,
TE's kernel messages), so fds 1 and 2 themselves are pointed at temporary files for the
length of a task. Output is kept bounded: the head and the tail of a stream survive, the
middle of a huge one is replaced by a marker, so a task printing 100 MB cannot blow up a
message or the broker's memory.
"""

from __future__ import annotations

import os
import sys
import tempfile
from types import TracebackType
from typing import IO


def _bounded_read(handle: IO[bytes], limit: int) -> str:
    size = handle.seek(0, os.SEEK_END)
    if not size:  # most tasks write nothing: one call
        return ""
    handle.seek(0)
    if size <= limit:
        data = handle.read()
    else:
        half = limit // 2
        head = handle.read(half)
        handle.seek(size - half)
        tail = handle.read()
        marker = f"\n... [cpq: {size - 2 * half} bytes of output truncated] ...\n".encode()
        data = head + marker + tail
    return data.decode("utf-8", errors="replace")


def _bounded_pread(fd: int, limit: int) -> str:
    """:func:`_bounded_read` of a file that another thread writes to: no seek."""
    size = os.fstat(fd).st_size
    if size <= limit:
        data = os.pread(fd, size, 0)
    else:
        half = limit // 2
        marker = f"\n... [cpq: {size - 2 * half} bytes of output truncated] ...\n".encode()
        data = os.pread(fd, half, 0) + marker + os.pread(fd, half, size - half)
    return data.decode("utf-8", errors="replace")


class FdCapture:
    """``with FdCapture(limit) as cap: ...`` then ``cap.stdout`` and ``cap.stderr``.

    One instance is reused for every task of a rank: its two spool files are created once
    and truncated before each use, which keeps file creation off the per-task path.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.stdout = ""
        self.stderr = ""
        # Kept open for the rank's lifetime (closed with the process), hence no context manager.
        self._spools = [tempfile.TemporaryFile(prefix="cpq-capture-") for _ in (1, 2)]  # noqa: SIM115
        self._saved: list[tuple[int, int, IO[bytes]]] = []

    def __enter__(self) -> FdCapture:
        self.stdout = self.stderr = ""
        _flush_python_streams()
        for fd, spool in zip((1, 2), self._spools, strict=True):
            # Its size, not its offset: a process the last task left behind may have
            # written since, through a description of its own. Most tasks write nothing.
            if os.fstat(spool.fileno()).st_size:
                spool.seek(0)
                spool.truncate()
            saved = os.dup(fd)
            os.dup2(spool.fileno(), fd)
            self._saved.append((fd, saved, spool))
        return self

    def so_far(self) -> tuple[str, str]:
        """What the current task wrote to fds 1 and 2 until now (``("", "")`` between tasks),
        for another thread (the watchdog): read with ``pread``, which leaves the offset that
        the two fds share with the spool files where the task's writes go on."""
        if not self._saved:
            return "", ""
        try:
            out, err = (_bounded_pread(s.fileno(), self.limit) for s in self._spools)
        except OSError:  # the task ended meanwhile
            return "", ""
        return out, err

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        _flush_python_streams()
        texts = []
        for fd, saved, spool in self._saved:
            os.dup2(saved, fd)
            os.close(saved)
            texts.append(_bounded_read(spool, self.limit))
        self.stdout, self.stderr = texts
        self._saved.clear()


def _flush_python_streams() -> None:
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # a closed or broken stream must not fail the task
            pass
