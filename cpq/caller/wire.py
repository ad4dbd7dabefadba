"""What the calling pytest process and the warm caller say to each other, and where.

One ``AF_UNIX`` ``SOCK_SEQPACKET`` socket per warm caller, in the per-user state directory
(mode 0700: the file system is the access control, as for the broker's socket). A message
is one msgpack map — never pickle — and a packet keeps its bounds, so a message is read
whole or not at all. The request carries the three standard descriptors (``SCM_RIGHTS``).

A warm caller serves one **key**: the interpreter (executable, version, ``sys.flags``, ``-X``
and ``-W`` options), the import path beyond its first entry and the project's rootdir. What
it imported ahead and in which variables is its **plan**, written by the session that came
before it (:mod:`cpq.client.handoff`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import socket
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from cpq import paths

VERSION = 1
MAX_BYTES = 4 << 20
#: The warm caller's variable: "0" off, "1" kept for every session, unset or "auto": kept
#: for a project whose session took at least :data:`AUTO_MIN_START_S` to start.
ENABLE_VAR = "CPQ_WARM_CALLER"
AUTO_MIN_START_S = 5.0
#: How long a warm caller waits for a session before it exits.
IDLE_VAR = "CPQ_WARM_CALLER_IDLE_S"
DEFAULT_IDLE_S = 900.0


#: Families a plan never names: cpq and the pytest harness (the warm caller loads them at
#: its start, as a rank does) and the main modules.
NOT_PLANNED = frozenset(
    {"cpq", "pytest", "_pytest", "pluggy", "iniconfig", "py", "__main__", "__mp_main__"}
)
#: Set in a warm caller's fork (:mod:`cpq.caller.child`): the request it serves, which the
#: plugin's half (:mod:`cpq.client.handoff`) reads.
served: dict[str, Any] | None = None
#: The modules a warm caller's fork started with (its warm caller's), set with ``served``.
forked_with: frozenset[str] = frozenset()


def _nothing_stale() -> str:
    return ""


#: In a fork: why what its warm caller held aside was stale for the session ("" when it was
#: not; :func:`cpq.rank.ahead.stale`, set by :mod:`cpq.caller.child`).
stale_ahead: Callable[[], str] = _nothing_stale


def _nothing_said() -> None:
    return None


#: In a fork: warn again what its warm caller's imports of modules that stay loaded warned
#: (:func:`cpq.rank.ahead.say_staying`, set by :mod:`cpq.caller.child`).
say_staying: Callable[[], None] = _nothing_said


class WireError(Exception):
    """A message that is not one of ours (its text says what is wrong)."""


def folder() -> Path:
    return paths.ensure_private_dir(paths.state_dir() / "callers")


def key_of(rootpath: str, path: list[str]) -> str:
    """The key of a calling process with this rootdir and this import path as its
    interpreter set it up (see the module docstring)."""
    parts = [
        sys.executable,
        sys.version,
        list(sys.flags),
        sorted(f"{k}={v}" for k, v in sys._xoptions.items()),
        list(sys.warnoptions),
        path[1:],
        rootpath,
    ]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:20]


#: Modules blamed (:mod:`cpq.caller.blame`) before a project's warm callers give up on it.
MAX_BLAMED = 32
#: Passes that blamed a module, likewise: a pass finds them all, unless a dependency went
#: unseen (the next pass sees it); one that ran left-out modules again and again would
#: otherwise restart for ever.
MAX_PASSES = 4


@dataclass
class LeftOut:
    """What a project's warm callers leave out (``KEY.exclude.json``): the modules whose own
    code did what a fork cannot take (name -> what), and those that need one of them
    (name -> the blamed module). ``"*"`` blamed: a refusal no import explained."""

    blamed: dict[str, str] = field(default_factory=dict)
    needing: dict[str, str] = field(default_factory=dict)
    passes: int = 0  # that blamed a module
    #: Modules left out only because they initialise CUDA or need only such modules: a
    #: session prepared ahead imports them (:mod:`cpq.caller.prepared`).
    cuda_only: list[str] = field(default_factory=list)
    #: Why this project's sessions are not prepared ahead ("" when they may be).
    no_prepared: str = ""

    def __contains__(self, name: object) -> bool:
        """Whether ``name`` is left out: named, or a submodule of a package named (its
        import runs the package's)."""
        if not isinstance(name, str):
            return False
        parts = name.split(".")
        return any(
            ".".join(parts[:n]) in self.blamed or ".".join(parts[:n]) in self.needing
            for n in range(1, len(parts) + 1)
        )

    def gave_up(self) -> bool:
        """Whether the project gets no warm caller: too many modules blamed or passes made,
        or a warm-up refused for what no import was seen doing."""
        return len(self.blamed) >= MAX_BLAMED or self.passes >= MAX_PASSES or "*" in self.blamed


def excluded_path(key: str) -> Path:
    return folder() / f"{key}.exclude.json"


def read_left_out(key: str) -> LeftOut:
    """What ``key``'s warm callers leave out (nothing when unreadable)."""
    try:
        raw = json.loads(excluded_path(key).read_text())
    except (OSError, ValueError):
        return LeftOut()
    if not isinstance(raw, dict):
        return LeftOut()
    blamed, needing, passes = raw.get("blamed"), raw.get("needing"), raw.get("passes")
    if not isinstance(blamed, dict) or not isinstance(needing, dict) or not isinstance(passes, int):
        return LeftOut()
    cuda_only, no_prepared = raw.get("cuda_only", []), raw.get("no_prepared", "")
    return LeftOut(
        {str(k): str(v) for k, v in blamed.items()},
        {str(k): str(v) for k, v in needing.items()},
        passes,
        [str(name) for name in cuda_only] if isinstance(cuda_only, list) else [],
        no_prepared if isinstance(no_prepared, str) else "not readable",
    )


def write_left_out(key: str, left_out: LeftOut) -> None:
    target = excluded_path(key)
    temporary = target.with_name(f"{target.name}.{os.getpid()}")
    temporary.write_text(json.dumps(asdict(left_out)))
    os.replace(temporary, target)


@contextlib.contextmanager
def _left_out_locked(key: str) -> Iterator[None]:
    """``KEY.exclude.json`` to read and write alone (released when the lock file closes)."""
    with open(folder() / f"{key}.exclude.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def add_left_out(
    key: str, blamed: dict[str, str], needing: dict[str, str], cuda_only: Iterable[str] = ()
) -> LeftOut:
    """Add one pass's findings to what ``key``'s warm callers leave out, and count the pass.
    Under a lock: a project may have two warm callers warming at once (one a session started
    at its start, one at its end), and neither may lose the other's findings."""
    with _left_out_locked(key):
        left_out = read_left_out(key)
        left_out.blamed.update(blamed)
        left_out.needing.update({k: v for k, v in needing.items() if k not in left_out.blamed})
        left_out.cuda_only += [name for name in cuda_only if name not in left_out.cuda_only]
        left_out.passes += 1
        write_left_out(key, left_out)
        return left_out


def no_prepared(key: str, why: str) -> None:
    """``key``'s sessions are not to be prepared ahead any more (``why``)."""
    with _left_out_locked(key):
        left_out = read_left_out(key)
        left_out.no_prepared = why
        write_left_out(key, left_out)


def passes_served(key: str) -> None:
    """A pass served: the count of passes that blamed a module starts again (it bounds one
    run of restarts, not a project's life)."""
    with _left_out_locked(key):
        left_out = read_left_out(key)
        if left_out.passes:
            left_out.passes = 0
            write_left_out(key, left_out)


def gave_up(key: str) -> bool:
    """Whether ``key``'s project gets no warm caller (:meth:`LeftOut.gave_up`)."""
    return read_left_out(key).gave_up()


def interpreter_identity() -> list[Any]:
    """The interpreter, as a caller sends it and the warm caller compares it with its own."""
    return [
        sys.executable,
        sys.version,
        list(sys.flags),
        sorted(f"{k}={v}" for k, v in sys._xoptions.items()),
        list(sys.warnoptions),
    ]


def socket_path(key: str) -> Path:
    return folder() / f"{key}.sock"


def plan_path(key: str) -> Path:
    return folder() / f"{key}.plan.json"


def warming_path(key: str) -> Path:
    return folder() / f"{key}.warming.json"


def note_warming(
    key: str, ready_by: float, pass_s: float | None, serving: bool = False, pid: int = 0
) -> None:
    """Say that this process (``pid``: the one just started) warms ``key``'s project and
    expects to serve by ``ready_by`` (epoch seconds), or (``serving``) that it serves since;
    ``pass_s``: how long the project's last pass took from its process's start (the next
    warm caller's estimate)."""
    target = warming_path(key)
    temporary = target.with_name(f"{target.name}.{os.getpid()}")
    said = {"pid": pid or os.getpid(), "ready_by": ready_by, "pass_s": pass_s, "serving": serving}
    temporary.write_text(json.dumps(said))
    os.replace(temporary, target)


def still_warming(key: str) -> bool:
    """Whether a warm caller of ``key``'s project is importing now (alive, not serving)."""
    warming = read_warming(key)
    return bool(warming) and not warming.get("serving") and alive(int(warming["pid"]))


def retire_all() -> int:
    """``cpq stop``: every warm caller of this state directory stops taking sessions — its
    socket removed, it exits once the sessions it runs are done — and one still importing
    (serving no one yet) is ended. Returns how many there were."""
    import psutil

    found = 0
    where = paths.state_dir() / "callers"
    for sock in where.glob("*.sock") if where.is_dir() else ():
        sock.unlink(missing_ok=True)
        found += 1
    for note in where.glob("*.warming.json") if where.is_dir() else ():
        key = note.name.removesuffix(".warming.json")
        if not still_warming(key):
            continue
        with contextlib.suppress(psutil.Error, OSError):
            process = psutil.Process(int(read_warming(key)["pid"]))
            if "cpq.caller" in " ".join(process.cmdline()):  # that pid is still one of ours
                process.terminate()
                found += 1
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process of that pid: not ours, but alive
        return True
    return True


def read_warming(key: str) -> dict[str, Any]:
    """What :func:`note_warming` said last (empty when nothing readable)."""
    try:
        raw = json.loads(warming_path(key).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(raw, dict):
        return {}
    pid, ready_by = raw.get("pid"), raw.get("ready_by")
    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid < 2**31:
        return {}
    if not isinstance(ready_by, (int, float)):
        return {}
    return dict(raw)


def wait_until(warming: dict[str, Any], start_s: float, now: float) -> float:
    """Until when a session that found no warm caller answering waits for one that is
    warming (0: it does not wait). It waits when the warm caller expects to serve before
    the session would have started by itself (``start_s``, its last measured start), and
    never longer than that start: a warm caller that comes late, or refuses, costs at
    most one more start. A little slack past the expected time: a pass runs as fast as the
    last one, not to the millisecond."""
    if not warming or start_s <= 0:
        return 0.0
    ready_by = float(warming["ready_by"])
    if ready_by - now > start_s:
        return 0.0
    return min(ready_by + max(2.0, 0.2 * start_s), now + start_s)


@dataclass
class Plan:
    """What the warm caller of ``key`` imports ahead, and how it is started."""

    key: str
    #: Modules in the order the last session imported them (see ``handoff.modules_to_plan``).
    modules: list[str]
    path: list[str]
    cwd: str
    environ: dict[str, str]
    #: The interpreter and its options, as the calling process was started.
    interpreter: list[str]
    #: The session's start: process start to the end of its initial conftests.
    start_s: float
    v: int = VERSION
    notes: dict[str, Any] = field(default_factory=dict)

    def write(self) -> Path:
        target = plan_path(self.key)
        temporary = target.with_suffix(f".{os.getpid()}.tmp")
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w") as out:
            json.dump(asdict(self), out)
        os.replace(temporary, target)
        return target

    @classmethod
    def read(cls, path: Path) -> Plan:
        """The plan in ``path``; :class:`WireError` for anything else."""
        try:
            raw = json.loads(path.read_text())
            if raw.get("v") != VERSION:
                raise WireError(f"plan version {raw.get('v')!r}, this cpq writes {VERSION}")
            plan = cls(**raw)
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            raise WireError(f"unreadable plan {path}: {exc}") from None
        if not isinstance(plan.start_s, (int, float)) or isinstance(plan.start_s, bool):
            raise WireError(f"plan {path}: start_s must be a number of seconds")
        fields = (plan.modules, plan.path, plan.interpreter)
        if not all(isinstance(x, list) and all(isinstance(s, str) for s in x) for x in fields):
            raise WireError(f"plan {path}: modules, path and interpreter must be lists of text")
        if not isinstance(plan.environ, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in plan.environ.items()
        ):
            raise WireError(f"plan {path}: environ must map text to text")
        if not isinstance(plan.notes, dict):
            raise WireError(f"plan {path}: notes must be a map")
        return plan


def send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    data = msgpack.packb({"v": VERSION, **message}, use_bin_type=True)
    if len(data) > MAX_BYTES:
        raise WireError(f"message of {len(data)} bytes, the most is {MAX_BYTES}")
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.sendall(data)


def recv(sock: socket.socket, maxfds: int = 0) -> tuple[dict[str, Any] | None, list[int]]:
    """One message and the descriptors that came with it; ``(None, [])`` when the peer
    closed. Descriptors of a message that does not decode are closed before it raises."""
    data, fds, _, _ = socket.recv_fds(sock, MAX_BYTES, maxfds)
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    try:
        message = msgpack.unpackb(data, raw=False, strict_map_key=True)
        if not isinstance(message, dict) or message.get("v") != VERSION:
            raise WireError(f"not a version-{VERSION} message")
    except Exception as exc:
        for fd in fds:
            os.close(fd)
        if isinstance(exc, WireError):
            raise
        raise WireError(f"undecodable message: {type(exc).__name__}: {exc}") from None
    return message, fds


def connect(path: Path, timeout_s: float) -> socket.socket | None:
    """A connection to the warm caller at ``path``, None when none listens there."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(timeout_s)
    try:
        sock.connect(str(path))
    except OSError:
        sock.close()
        return None
    return sock
