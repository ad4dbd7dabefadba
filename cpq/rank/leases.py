"""GPU leases inside a group: passed from the torchrun agent to every rank, checked there.

The broker leases a group's GPUs node-wide (an ``flock`` per GPU, see ``docs/design.md``,
"GPU leases") and passes the lease descriptors to the group's torchrun agent
(``CPQ_LEASE_FDS``: ``fd:dev:inode,...``). torchrun starts ranks with ``close_fds``, so the
launcher (:mod:`cpq.rank.launch`) adds them to its ``Popen`` calls; every rank then checks
it holds them: a rank that would use a GPU without holding its lease refuses to start
(fail closed: another broker could take the GPU once this group's agent is gone).
"""

from __future__ import annotations

import os
import subprocess
from typing import Any

LEASE_FDS_VAR = "CPQ_LEASE_FDS"


def expected() -> list[tuple[int, int, int]]:
    """``(fd, dev, inode)`` of each lease this process must hold."""
    out = []
    for item in os.environ.get(LEASE_FDS_VAR, "").split(","):
        if not item:
            continue
        fd, dev, ino = (int(part) for part in item.split(":"))
        out.append((fd, dev, ino))
    return out


def check_held() -> None:
    """Exit with a clear message unless every lease descriptor was inherited."""
    for fd, dev, ino in expected():
        try:
            info = os.fstat(fd)
        except OSError:
            info = None
        if info is None or (info.st_dev, info.st_ino) != (dev, ino):
            raise SystemExit(
                f"cpq rank: GPU lease descriptor {fd} was not inherited from the torchrun "
                f"agent (a torch version whose launcher cpq.rank.launch cannot extend?); "
                f"refusing to run on GPUs this process does not hold a lease for"
            )


def pass_to_ranks() -> None:
    """Make every ``Popen`` of the torchrun agent pass the lease descriptors on.

    torch starts workers through ``subprocess.Popen`` with ``close_fds``; depending on the
    version its handler calls ``subprocess.Popen`` or a ``Popen`` it imported by name, so
    both are replaced. Only the agent runs this (it is cpq's throwaway launcher process):
    whatever else it starts holds the leases too, until it exits, which is the safe side.
    """
    fds = tuple(fd for fd, _, _ in expected())
    if not fds:
        return
    original = subprocess.Popen

    class LeasePopen(original):  # type: ignore[valid-type,misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["pass_fds"] = tuple(sorted(set(kwargs.get("pass_fds", ())) | set(fds)))
            super().__init__(*args, **kwargs)

    subprocess.Popen = LeasePopen  # type: ignore[misc]
    try:
        from torch.distributed.elastic.multiprocessing.subprocess_handler import (
            subprocess_handler as handler,
        )
    except ImportError:
        return  # the ranks' check_held() says so, clearly, if workers start another way
    if getattr(handler, "Popen", None) is original:
        setattr(handler, "Popen", LeasePopen)  # noqa: B010 - torch does not export the name
