"""Interrupting a running task whose client went away (docs/design.md, "Abandoned tasks").

The broker sends ``cancel_task``; the rank's watchdog thread records which task to cancel and
sends ``SIGUSR2`` to the main thread. Its handler raises :class:`TaskCancelled` in the task
(a ``BaseException``, so ``except Exception`` in user code does not swallow it), which
wakes blocking calls such as ``time.sleep`` or a socket read: the task unwinds, the rank
reports, and the group serves again. A rank inside a collective does not wake (the C++
wait does not return on a signal); the broker then recycles its group after a short grace.

The handler only raises while the main thread is inside the task's own call
(:func:`window`); a signal that arrives a moment too late finds cpq's bookkeeping running
and is ignored, so cancellation never breaks the rank itself.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

SIGNAL = signal.SIGUSR2


class TaskCancelled(BaseException):
    """The task's client went away; the broker asked this rank to stop the task."""


class _State:
    running = ""  # the task id whose user code is running now ("" between tasks)
    requested = ""  # the task id the broker cancelled


_state = _State()
_lock = threading.Lock()


def _handler(signum: int, frame: FrameType | None) -> None:
    if _state.running and _state.running == _state.requested:
        _state.running = ""  # raise once; the unwinding code must not be interrupted again
        raise TaskCancelled("cancelled: the client that submitted this task went away")


def current() -> str:
    """The task whose user code the main thread is running ("" if none)."""
    return _state.running


def install() -> None:
    """Route the cancel signal to :func:`_handler` (main thread, before the first task)."""
    signal.signal(SIGNAL, _handler)


def request(task_id: str, main_thread_id: int | None) -> None:
    """Cancel ``task_id`` (from the watchdog thread): now if it runs, at its start if it is next."""
    with _lock:
        _state.requested = task_id
    if main_thread_id is not None and _state.running == task_id:
        signal.pthread_kill(main_thread_id, SIGNAL)


@contextmanager
def window(task_id: str) -> Iterator[None]:
    """The span in which a cancel of ``task_id`` interrupts the main thread."""
    with _lock:
        if _state.requested == task_id:
            raise TaskCancelled("cancelled before it started: its client went away")
        _state.running = task_id
    try:
        yield
    finally:
        _state.running = ""
