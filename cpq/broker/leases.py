"""The GPU leases this broker holds: taken before a group starts, dropped when it stops.

A group's GPUs are leased (:mod:`cpq.broker.leasedir`: an exclusive ``flock`` per GPU
UUID) before its torchrun starts; the lease descriptors are passed to the group
(``pass_fds``; :mod:`cpq.rank.launch` passes them on to every rank), so an orphaned rank
keeps its GPU leased until it exits. The broker closes its own copy when it stops the
group; the kernel frees the GPU when the last process holding the lease has exited.
Nothing here blocks: a lease held elsewhere is simply not free now.

Taking is all or nothing (a group needs all its GPUs at once). Which GPUs to take is the
placement's decision (:mod:`cpq.broker.placement`); a GPU found held elsewhere is reported
back to it through :meth:`Leases.held_elsewhere` (measured here, where the lock was tried).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from cpq.broker import leasedir
from cpq.broker.leasedir import LeaseRefused

log = logging.getLogger("cpq.broker")

#: A GPU found held elsewhere is not probed again for this long (one broker tick).
RETRY_S = 0.05


class Leases:
    """This broker's leases, by GPU id (what ``CUDA_VISIBLE_DEVICES`` names here)."""

    def __init__(self, directory: Path, uuids: dict[str, str], me: str) -> None:
        self.directory = directory
        self.uuids = dict(uuids)
        self.me = me
        #: GPUs this broker may never lease, and why (found when it started).
        self.refused: dict[str, str] = {}
        self._fds: dict[str, int] = {}
        self._refs: dict[str, int] = {}
        self._held_elsewhere: dict[str, float] = {}  # gpu -> monotonic time seen
        self._problems: dict[str, str] = {}
        self._details: dict[str, str] = {}

    def prepare(self, gpus: list[str]) -> dict[str, str]:
        """Make the directory and every GPU's lease file; refuse the GPUs whose UUID is
        unknown or whose lease file is unsafe or cannot be made (each with a logged reason).
        Returns the refused."""
        try:
            why = leasedir.ensure_dir(self.directory)
        except LeaseRefused as exc:  # no lease in it could be trusted: every GPU refused
            for gpu in gpus:
                self.refused[gpu] = str(exc)
            log.error("every GPU refused: %s", exc)
            return dict(self.refused)
        if why:
            log.warning("%s", why)
        for gpu in gpus:
            uuid = self.uuids.get(gpu)
            if uuid is None:
                self.refused[gpu] = f"the UUID of GPU {gpu} is unknown (nvidia-smi -L names none)"
                log.error("GPU %s refused: %s", gpu, self.refused[gpu])
                continue
            try:
                os.close(leasedir.open_lease(self.directory, uuid))
            except LeaseRefused as exc:
                self.refused[gpu] = str(exc)
                log.error("GPU %s (%s) refused: %s", gpu, uuid, exc)
        return dict(self.refused)

    # ---- taking and dropping

    def holds(self, gpu: str) -> bool:
        return gpu in self._fds

    def take(self, gpus: list[str], now: float) -> bool:
        """Lease every GPU of ``gpus``, or none (False; the GPUs found held elsewhere are
        remembered for :meth:`held_elsewhere`)."""
        new: dict[str, int] = {}
        missing = False
        try:
            for gpu in gpus:
                if gpu in self._fds or gpu in new:  # already ours (--oversubscribe): share it
                    continue
                fd = self._try(gpu, now)
                if fd is None:
                    missing = True
                    continue
                new[gpu] = fd
        except BaseException:  # all or nothing: what this call took goes back
            for fd in new.values():
                os.close(fd)
            raise
        if missing:
            for fd in new.values():
                os.close(fd)
            return False
        self._fds.update(new)
        for gpu in gpus:
            self._refs[gpu] = self._refs.get(gpu, 0) + 1
        return True

    def held_elsewhere(self, now: float) -> frozenset[str]:
        """GPUs this broker could not lease when it last tried (just now): another broker
        held them, or their lease file could not be used."""
        return frozenset(g for g, seen in self._held_elsewhere.items() if now - seen < RETRY_S)

    def _try(self, gpu: str, now: float) -> int | None:
        uuid = self.uuids[gpu]
        try:
            fd = leasedir.try_lock(self.directory, uuid)
        except LeaseRefused as exc:
            if self._problems.get(gpu) != str(exc):
                log.error("GPU %s not leased: %s", gpu, exc)
            self._problems[gpu] = str(exc)
            self._held_elsewhere[gpu] = now  # not to be tried again at once either
            return None
        self._problems.pop(gpu, None)
        if fd is None:
            self._held_elsewhere[gpu] = now
        else:
            self._held_elsewhere.pop(gpu, None)
        return fd

    def drop(self, gpus: list[str]) -> None:
        """A group on ``gpus`` stopped: close this broker's copy of each lease it alone
        used (its processes keep theirs until they exit)."""
        for gpu in gpus:
            refs = self._refs.get(gpu, 0) - 1
            if refs > 0:
                self._refs[gpu] = refs
                continue
            self._refs.pop(gpu, None)
            self._details.pop(gpu, None)
            fd = self._fds.pop(gpu, None)
            if fd is not None:
                os.close(fd)

    def fds(self, gpus: list[str]) -> list[int]:
        """The lease descriptors a group on ``gpus`` inherits."""
        return [self._fds[g] for g in gpus if g in self._fds]

    # ---- display

    def describe(self, gpu: str, details: dict[str, Any]) -> None:
        """Write who holds ``gpu`` into its lease file when that changed (display only)."""
        fd = self._fds.get(gpu)
        text = repr(sorted(details.items()))
        if fd is None or self._details.get(gpu) == text:
            return
        self._details[gpu] = text
        leasedir.write_holder(fd, details)

    def problem(self, gpu: str) -> str:
        """Why ``gpu`` could not be leased last time ("" if it could)."""
        return self.refused.get(gpu) or self._problems.get(gpu, "")
