"""Fault injectors: tasks that misbehave on demand, for cpq's own tests and benchmarks.

Each one is a plain task (``cpq submit --world-size 2 workers.faults:sigkill rank=1``): it is
called on every rank with ``torch.distributed`` initialised, ``rank`` picks the rank that
misbehaves, and the other ranks behave like healthy peers of a real test, which usually
means waiting for the victim in a collective.

``once_marker`` (a file path) makes a fault happen once: the victim misbehaves only if the
marker does not exist yet, creating it first. cpq retries infrastructure failures once on a
fresh group, so with a marker the retry runs clean and the task passes, which is how a
test checks that the retry happened *and* worked.

Some injectors leave the rank worse off for later tasks (leaked memory or file
descriptors, a mutated process): submit them to a pool spec of their own (an ``env``
override) so a shared warm group is not affected.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import random
import resource
import signal
import sys
import tempfile
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

#: What the leaking injectors keep alive, so the leak outlives the task.
_leaked: list[Any] = []


def _strikes(rank: int, once_marker: str | None) -> bool:
    """True on the rank that misbehaves this time (creating ``once_marker`` first)."""
    if dist.get_rank() != rank:
        return False
    if once_marker is None:
        return True
    try:
        fd = os.open(once_marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return False  # struck before: this is the retry, behave
    os.close(fd)
    return True


def _wait_for_peers() -> dict[str, int]:
    """What the healthy ranks do: meet the victim in a collective (as real tests do)."""
    dist.barrier()
    return {"rank": dist.get_rank()}


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        stream.flush()


# --------------------------------------------------------------------------- dying ranks


def sigkill(rank: int = 1, once_marker: str | None = None) -> dict[str, int]:
    """Rank ``rank`` SIGKILLs itself mid-task; the others wait for it in a barrier."""
    if _strikes(rank, once_marker):
        _flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return _wait_for_peers()


def sigstop(rank: int = 1, once_marker: str | None = None) -> dict[str, int]:
    """Rank ``rank`` SIGSTOPs itself: alive but frozen, so its heartbeats stop too."""
    if _strikes(rank, once_marker):
        _flush()
        os.kill(os.getpid(), signal.SIGSTOP)
    return _wait_for_peers()


def segfault(rank: int = 1, once_marker: str | None = None) -> dict[str, int]:
    """Rank ``rank`` reads address 0 (SIGSEGV, as a crashing extension would)."""
    if _strikes(rank, once_marker):
        _flush()
        ctypes.string_at(0)
    return _wait_for_peers()


def exit_code(rank: int = 1, code: int = 3, once_marker: str | None = None) -> dict[str, int]:
    """Rank ``rank`` leaves with ``os._exit(code)``, skipping every cleanup."""
    if _strikes(rank, once_marker):
        _flush()
        os._exit(code)
    return _wait_for_peers()


# --------------------------------------------------------------------------- hanging ranks


def hang_in_collective(rank: int | None = 1, once_marker: str | None = None) -> None:
    """A collective that never completes (only the per-task deadline ends it).

    With ``rank`` given, that rank never joins while the others wait in ``all_reduce``; with
    ``rank=None`` every rank blocks receiving from its neighbour, which never sends.
    Needs a world size of at least 2. With ``once_marker`` (and a ``rank``) the victim
    joins the ``all_reduce`` once the marker exists, so the retry completes.
    """
    me, world = dist.get_rank(), dist.get_world_size()
    if rank is None:
        dist.recv(torch.zeros(1), src=(me + 1) % world)
    elif _strikes(rank, once_marker):
        threading.Event().wait()  # hang_in_collective: this rank never joins
    else:
        dist.all_reduce(torch.ones(1))


def hang_in_python(seconds: float = 3600.0) -> float:
    """Every rank sleeps in plain Python (the deadline's stack dump points here)."""
    time.sleep(seconds)  # hang_in_python sleeps here
    return seconds


def spin_in_python(
    rank: int = 1, seconds: float = 3600.0, once_marker: str | None = None
) -> dict[str, int]:
    """Rank ``rank`` spins in a pure-Python loop (holding the GIL between switches) while the
    others wait in a barrier: heartbeats must still flow, and only the deadline ends it."""
    if _strikes(rank, once_marker):
        end = time.monotonic() + seconds
        while time.monotonic() < end:  # spin_in_python: busy here
            pass
    return _wait_for_peers()


def hold_gil_for(seconds: float) -> float:
    """Compute for ``seconds`` without ever letting another thread of the process run, as a
    long C-extension call or a big extension import does (it holds the GIL), so the
    process's heartbeats stop. Done in Python with a switch interval longer than the hold:
    the GIL is only handed over when a waiting thread has asked for a whole interval.

    Returns how long a watcher thread really could not run, so a test can show the silence
    lasted past the liveness limit.
    """
    longest = 0.0
    done = threading.Event()

    def watch() -> None:
        nonlocal longest
        last = time.monotonic()
        while not done.is_set():
            time.sleep(0.01)
            now = time.monotonic()
            longest, last = max(longest, now - last), now

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    time.sleep(0.05)  # let the watcher start ticking
    interval = sys.getswitchinterval()
    sys.setswitchinterval(seconds * 10)
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:  # hold_gil: busy here, GIL held
            pass
    finally:
        sys.setswitchinterval(interval)
    done.set()
    watcher.join()
    return longest


def hold_gil(rank: int = 1, seconds: float = 4.0) -> dict[str, float]:
    """Rank ``rank`` holds the GIL computing for about ``seconds`` (:func:`hold_gil_for`)
    while the others wait in a barrier: silent, yet healthy. Returns the measured hold."""
    held = hold_gil_for(seconds) if dist.get_rank() == rank else 0.0
    return {**_wait_for_peers(), "longest_gil_gap_s": held}


def raise_while_peer_waits(rank: int = 1) -> None:
    """Rank ``rank`` fails an assertion; the others block in an ``all_reduce`` it never joins."""
    if dist.get_rank() == rank:
        raise AssertionError(f"rank {rank} fails while its peers wait in all_reduce")
    dist.all_reduce(torch.ones(1))


# --------------------------------------------------------------------------- bad results


def flood_output(megabytes: float = 100, stderr: bool = False) -> int:
    """Writes ``megabytes`` to fd 1 (and as much to fd 2 with ``stderr``), then one last line
    on each; returns the bytes written to fd 1."""
    line = f"flood from rank {dist.get_rank()} ".ljust(79, ".").encode() + b"\n"
    chunk = line * (2**20 // len(line))
    total = int(megabytes * 2**20)
    counts = []
    for fd in (1, 2) if stderr else (1,):
        written = 0
        while written < total:
            written += os.write(fd, chunk[: total - written])
        written += os.write(fd, f"flood_output done on rank {dist.get_rank()}\n".encode())
        counts.append(written)
    return counts[0]


def unserialisable_return(kind: str = "object") -> object:
    """Returns a value that cannot travel back: an ``object()``; a map with int keys
    (msgpack packs it, the broker refuses it); a list nested 10,000 deep; 80 MB (``huge``,
    over the frame limit)."""
    if kind == "int_keys":
        return {1: "one"}
    if kind == "deep":
        value: list[Any] = []
        for _ in range(10_000):
            value = [value]
        return value
    if kind == "huge":
        return b"\x00" * (80 * 2**20)
    return object()


def garble_report(rank: int = 1) -> int:
    """Rank ``rank``'s report on this task carries an outcome no cpq knows, as a rank of an
    incompatible cpq would send it: the broker cannot decode the frame (the other ranks
    report as usual). The report is garbled where the rank encodes it, on its own socket."""
    if dist.get_rank() == rank:
        from cpq import protocol

        encode_for = protocol.encode_for

        def garbled(message: Any, features: frozenset[str]) -> bytes:
            frame = encode_for(message, features)
            if not isinstance(message, protocol.RankDone):
                return frame
            protocol.encode_for = encode_for  # once
            wire = protocol.unpack(frame)
            wire["result"]["outcome"] = "passed-with-warnings"
            return protocol.pack(wire)

        protocol.encode_for = garbled  # type: ignore[assignment]
    return dist.get_rank()


# --------------------------------------------------------------------------- polluted ranks


def leak_memory(megabytes: int = 100) -> float:
    """Allocates (and touches) ``megabytes`` that stay alive after the task; returns the total."""
    _leaked.append(b"\xa5" * (megabytes * 2**20))
    return sum(len(x) for x in _leaked if isinstance(x, bytes)) / 2**20


def mutate_global_state() -> dict[str, Any]:
    """Leaves behind what a careless test does, and reports what it found on entry.

    It replaces ``sys.stdout``/``sys.stderr`` with closed buffers (a later ``print`` would
    raise), sets an environment variable, changes directory and reseeds the RNGs.
    """
    found = {
        "env": os.environ.get("CPQ_FAULTS_MUTATED"),
        "cwd": os.getcwd(),
        "stdout_closed": sys.stdout.closed,
        "stderr_closed": sys.stderr.closed,
        "random": random.random(),
        "torch": float(torch.rand(1).item()),
    }
    os.environ["CPQ_FAULTS_MUTATED"] = "yes"
    os.chdir(tempfile.gettempdir())
    random.seed(4321)
    torch.manual_seed(4321)
    for name in ("stdout", "stderr"):
        dead = io.StringIO()
        dead.close()
        setattr(sys, name, dead)
    return found


def open_files(count: int = 64) -> int:
    """A healthy task that needs file descriptors: opens ``count`` at once, closes them."""
    fds: list[int] = []
    try:
        for _ in range(count):
            fds.append(os.open(os.devnull, os.O_RDONLY))
    finally:
        for fd in fds:
            os.close(fd)
    return count


def exhaust_fds(limit: int = 4096, keep: bool = True) -> int:
    """Opens descriptors until EMFILE; returns how many it opened.

    The soft ``RLIMIT_NOFILE`` is first lowered to ``limit`` (if higher) so exhaustion is
    quick. With ``keep`` the descriptors stay open after the task, so the rank cannot open
    files any more; with ``keep=False`` they are closed before returning.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft > limit:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    fds: list[int] = []
    with contextlib.suppress(OSError):  # EMFILE: exhausted
        while True:
            fds.append(os.open(os.devnull, os.O_RDONLY))
    if keep:
        _leaked.extend(fds)
    else:
        for fd in fds:
            os.close(fd)
    return len(fds)
