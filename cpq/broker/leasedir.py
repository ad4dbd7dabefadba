"""The node-shared lease directory: one lock file per GPU, and one want file per broker.

Several brokers on one node (other users, other containers) must never place groups on the
same GPU. Each GPU has a lease file named by its UUID (indices differ between containers)
in one directory every broker of the node sees (``--gpu-leases`` / ``CPQ_GPU_LEASES``,
default ``/run/lock/cpq-gpus``). Holding an exclusive ``flock`` on it is owning the GPU;
the kernel drops the lock when the last descriptor of that open file is closed, so a
crashed broker leaves nothing to clean up. This module is the file system side only: it
opens, locks, writes and reads, and never blocks (``LOCK_NB``, ``O_NONBLOCK``).

Why the rules:

* the directory is created mode 1777 (any user may add a lease file; the sticky bit keeps
  one user from deleting another's) and lease files 0666 (any user may lock them);
* lease files are opened with ``O_NOFOLLOW`` and must be regular files: a planted symlink
  or FIFO is refused (:class:`LeaseRefused`) for that GPU only, with a message that names
  it, and the broker serves the rest;
* after locking, the path must still name the locked inode: a lease file replaced under a
  holder would otherwise let two brokers "own" one GPU through two inodes;
* who holds a lease is written *into* the lease file (user, host, broker pid, group, state,
  since), for display only: ownership is the lock, never the text;
* a broker whose task waits for GPUs held elsewhere writes its wants to its own
  ``want-*.json`` file, rewritten every tick; readers ignore stale ones.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
from pathlib import Path
from typing import Any

LEASES_VAR = "CPQ_GPU_LEASES"
DEFAULT_DIR = Path("/run/lock/cpq-gpus")
FALLBACK_DIR = Path("/tmp/cpq-gpus")
WANT_PREFIX = "want-"
#: Lease and want files larger than this are not read (display data is small).
MAX_READ = 64 * 1024


class LeaseRefused(Exception):
    """This GPU cannot be leased (its lease file is unsafe or cannot be made)."""


def default_dir() -> Path:
    """``CPQ_GPU_LEASES``, else ``/run/lock/cpq-gpus``, else ``/tmp/cpq-gpus`` where the
    node has no ``/run/lock``."""
    explicit = os.environ.get(LEASES_VAR)
    if explicit:
        return Path(explicit)
    return DEFAULT_DIR if DEFAULT_DIR.parent.is_dir() else FALLBACK_DIR


def ensure_dir(path: Path) -> str:
    """Create the lease directory (mode 1777) if missing; "" when usable, else a warning.

    An existing directory is used as it is when it is a real, sticky directory: another
    user made it, and its lease files may still be lockable even where new ones cannot be
    created (:func:`open_lease` says so per GPU). Raises :class:`LeaseRefused` when no lease
    in it could be trusted (a symlink, not a directory, writable by all but not sticky)."""
    try:
        path.mkdir(parents=True, exist_ok=False)
        path.chmod(0o1777)  # mkdir's mode is cut by the umask
    except FileExistsError:
        pass
    except OSError as exc:
        raise LeaseRefused(
            f"cannot create the GPU lease directory {path}: {exc.strerror}"
        ) from None
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise LeaseRefused(
            f"cannot look at the GPU lease directory {path}: {exc.strerror}"
        ) from None
    if stat.S_ISLNK(info.st_mode):
        raise LeaseRefused(f"the GPU lease path {path} is a symlink (name the real directory)")
    if not stat.S_ISDIR(info.st_mode):
        raise LeaseRefused(f"the GPU lease path {path} is not a directory")
    if info.st_mode & stat.S_IWOTH and not info.st_mode & stat.S_ISVTX:
        raise LeaseRefused(
            f"the GPU lease directory {path} is writable by everyone but not sticky: any user "
            f"could replace another's lease files (fix: chmod 1777 {path})"
        )
    if not os.access(path, os.W_OK | os.X_OK):
        return (
            f"the GPU lease directory {path} is not writable by uid {os.geteuid()}: GPUs "
            f"without a lease file there cannot be leased (fix: chmod 1777 {path})"
        )
    return ""


def lease_path(directory: Path, uuid: str) -> Path:
    return directory / f"{uuid}.lease"


def open_lease(directory: Path, uuid: str) -> int:
    """A new descriptor on ``uuid``'s lease file (created 0666 if missing), never through a
    symlink; raises :class:`LeaseRefused` saying why."""
    path = lease_path(directory, uuid)
    try:
        fd = _open_or_create(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise LeaseRefused(f"{path} is a symlink; refusing GPU {uuid}") from None
        raise LeaseRefused(f"cannot open {path} ({exc.strerror}); refusing GPU {uuid}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise LeaseRefused(f"{path} is not a regular file; refusing GPU {uuid}")
        if info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) != 0o666:
            os.fchmod(fd, 0o666)  # ours (just made, under a umask): open it to every user
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_or_create(path: Path) -> int:
    """Open an existing lease file without ``O_CREAT``, else create it exclusively.

    Why not one ``O_CREAT`` open: with ``fs.protected_regular`` (systemd's default 1,
    Ubuntu's 2) the kernel refuses ``O_CREAT`` on an existing file another user owns in a
    sticky world-writable directory, even for root — the very case leases are for.
    """
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    for _ in range(3):  # a file created, or removed, between two calls: look again
        try:
            return os.open(path, flags)
        except FileNotFoundError:
            pass
        try:
            return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
    return os.open(path, flags)


def try_lock(directory: Path, uuid: str) -> int | None:
    """An fd holding ``uuid``'s lease, or None when another process holds it."""
    fd = open_lease(directory, uuid)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError as exc:
        os.close(fd)
        raise LeaseRefused(f"cannot lock the lease of GPU {uuid}: {exc.strerror}") from None
    try:
        now = os.stat(lease_path(directory, uuid), follow_symlinks=False)
        mine = os.fstat(fd)
        same = (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)
    except OSError:
        same = False
    if not same:
        os.close(fd)
        raise LeaseRefused(f"the lease file of GPU {uuid} was replaced while locking it")
    return fd


def is_held(directory: Path, uuid: str) -> bool | None:
    """Whether some process holds ``uuid``'s lease (None: no lease file / unreadable). A
    shared lock taken and dropped at once: never blocks, never keeps anything."""
    try:
        fd = os.open(
            lease_path(directory, uuid), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        )
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)  # also drops the shared lock


def write_holder(fd: int, details: dict[str, Any]) -> None:
    """Say who holds this lease (display only) in the lease file itself."""
    data = json.dumps(details, sort_keys=True).encode()
    with contextlib.suppress(OSError):  # a full disk costs the display, not the lease
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)


def read_json(path: Path) -> dict[str, Any] | None:
    """A small JSON object from ``path`` (never through a symlink), or None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = os.read(fd, MAX_READ)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):
        # being rewritten right now, or not ours to understand: any user may write these
        # files, so nothing in them may break the broker (a deeply nested array recurses)
        return None
    return value if isinstance(value, dict) else None


def lease_uuids(directory: Path) -> list[str]:
    """The UUIDs of every lease file in the directory (other containers' GPUs too)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(n[: -len(".lease")] for n in names if n.endswith(".lease"))


def want_path(directory: Path, key: str) -> Path:
    return directory / f"{WANT_PREFIX}{os.geteuid()}-{key}.json"


def write_want(path: Path, content: dict[str, Any]) -> None:
    """Rewrite this broker's want file (readable by all; never through a symlink)."""
    fd = os.open(
        path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644
    )
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"{path} is not a regular file")
        data = json.dumps(content, sort_keys=True).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
    finally:
        os.close(fd)


def read_wants(directory: Path) -> list[dict[str, Any]]:
    """Every want file's content (stale ones included: the reader decides)."""
    try:
        names = sorted(n for n in os.listdir(directory) if n.startswith(WANT_PREFIX))
    except OSError:
        return []
    out = []
    for name in names:
        content = read_json(directory / name)
        if content is not None:
            out.append(content)
    return out
