"""Sharing the node's GPUs with other brokers, once per tick: wants and holder details.

The files only; every decision is placement's (:mod:`cpq.broker.placement`: which GPUs to
want, which groups yield). Every tick the broker (1) reads the other brokers' wants
(:attr:`GpuSharing.foreign`, an input of the next placements), (2) publishes its own — what
the placements since the last tick wanted (:meth:`GpuSharing.want`) — and (3) writes who
holds each of its leases (display only). It also builds the ``gpus`` and ``wants`` rows of
``cpq-status``: every GPU of the node, including those of other containers whose lease
files share the directory.
"""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import logging
import os
import socket
import time
from collections.abc import Mapping
from typing import Any

from cpq.broker import leasedir
from cpq.broker.clock import Clock
from cpq.broker.leases import Leases
from cpq.broker.model import Group
from cpq.broker.placement import yielding

log = logging.getLogger("cpq.broker")

#: Every row of ``cpq-status --json`` ``gpus`` has these keys (None where there is no value).
GPU_ROW_KEYS = (
    "uuid", "index", "lease", "group", "state", "user", "host", "broker_pid", "since", "reason",
)  # fmt: skip


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.geteuid())


class GpuSharing:
    def __init__(self, leases: Leases, clock: Clock, endpoint: str) -> None:
        self.leases = leases
        self.clock = clock
        self.user, self.host, self.pid = _user(), socket.gethostname(), os.getpid()
        self.who = f"{self.user}@{self.host} pid {self.pid}"
        key = hashlib.sha256(f"{self.host}\0{endpoint}".encode()).hexdigest()[:12]
        self.want_file = leasedir.want_path(leases.directory, key)
        self.pending: dict[str, dict[str, Any]] = {}  # spec label -> want entry
        self.published: list[dict[str, Any]] = []
        self.yields = 0
        #: Fresh wants of other brokers, oldest first (read every tick).
        self.foreign: list[yielding.Want] = []
        self._since: dict[str, tuple[str, float]] = {}  # group -> (state, wall since)
        self._want_error = ""

    # ---- wants (this broker's)

    def want(self, spec: str, since: float, need: int, gpus: set[str]) -> None:
        """A group of ``spec`` could not start: ``need`` more GPUs of ``gpus`` (ids) are
        missing for a task waiting since ``since`` (wall clock)."""
        uuids = sorted(self.leases.uuids[g] for g in gpus)
        old = self.pending.get(spec)
        if old is None or since < old["since"]:
            self.pending[spec] = {"spec": spec, "since": since, "need": need, "gpus": uuids}

    def _publish(self, now: float) -> None:
        entries = sorted(self.pending.values(), key=lambda w: float(w["since"]))
        self.pending = {}
        if not entries and not self.published:
            return
        self.published = entries
        try:
            if entries:
                doc: dict[str, Any] = {"broker": self.leases.me, "who": self.who}
                doc.update(user=self.user, host=self.host, pid=self.pid)
                doc.update(refreshed=now, wants=entries)
                leasedir.write_want(self.want_file, doc)
            else:
                self.want_file.unlink(missing_ok=True)
            self._want_error = ""
        except OSError as exc:
            if self._want_error != str(exc):  # once per distinct problem, not every tick
                log.error("cannot publish GPU wants in %s: %s", self.want_file, exc)
            self._want_error = str(exc)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self.published:
                self.want_file.unlink(missing_ok=True)

    # ---- the tick

    def tick(self, groups: Mapping[str, Group]) -> None:
        """One tick: read the others' wants, publish ours, describe our leases."""
        now = self.clock.time()
        self.foreign = yielding.parse_wants(
            leasedir.read_wants(self.leases.directory), self.leases.me, now
        )
        self._publish(now)
        self._describe(groups, now)

    def _describe(self, groups: Mapping[str, Group], now: float) -> None:
        for group_id in [g for g in self._since if g not in groups]:
            del self._since[group_id]
        for group in groups.values():
            if group.state == "stopping":
                continue
            state, since = self._since.get(group.id, ("", now))
            if state != group.state:
                state, since = group.state, now
                self._since[group.id] = (state, since)
            for gpu in group.process.gpus:
                details = {"user": self.user, "host": self.host, "broker_pid": self.pid}
                details.update(group=group.id, state=state, since=since)
                self.leases.describe(gpu, details)

    # ---- status

    def gpu_rows(self, groups: Mapping[str, Group], gpus: list[str]) -> list[dict[str, Any]]:
        """Every GPU of the node: this broker's (``gpus``, refused ones too) and every other
        lease file in the directory (other containers' GPUs)."""
        mine = {self.leases.uuids[g]: g for g in gpus if g in self.leases.uuids}
        rows = [self._row(groups, uuid, mine.get(uuid)) for uuid in mine]
        others = [u for u in leasedir.lease_uuids(self.leases.directory) if u not in mine]
        return rows + [self._row(groups, uuid, None) for uuid in others]

    def _row(self, groups: Mapping[str, Group], uuid: str, gpu: str | None) -> dict[str, Any]:
        row: dict[str, Any] = dict.fromkeys(GPU_ROW_KEYS)
        row.update(uuid=uuid, index=gpu, lease="free")
        if gpu is not None and gpu in self.leases.refused:
            return row | {"lease": "refused", "reason": self.leases.refused[gpu]}
        on = [g for g in groups.values() if gpu is not None and gpu in g.process.gpus]
        if on:
            return row | {
                "lease": "this broker",
                "group": ",".join(g.id for g in on),
                "state": ",".join(g.state for g in on),
                "since": self._since.get(on[0].id, ("", None))[1],
            }
        held = leasedir.is_held(self.leases.directory, uuid)
        if held is None:
            row["lease"] = "unknown"
            if gpu is not None:
                row["reason"] = self.leases.problem(gpu) or "no lease file"
        elif held:
            found = leasedir.read_json(leasedir.lease_path(self.leases.directory, uuid)) or {}
            row["lease"] = "other broker"
            for key in ("user", "host", "broker_pid", "group", "state", "since"):
                value = found.get(key)
                if isinstance(value, str | int | float) and not isinstance(value, bool):
                    row[key] = value
        return row

    def want_rows(self) -> list[dict[str, Any]]:
        """Every fresh want on the node, this broker's included, oldest first."""
        rows = [
            {
                "who": w.who,
                "this_broker": False,
                "spec": w.spec,
                "since": w.since,
                "need": w.need,
                "gpus": sorted(w.gpus),
            }
            for w in self.foreign
        ]
        for entry in self.published:
            rows.append({"who": self.who, "this_broker": True, **entry})
        return sorted(rows, key=lambda r: float(r["since"]))


def broker_id(endpoint: str) -> str:
    """Unique per broker process on the node (a pid alone repeats across containers)."""
    seed = f"{socket.gethostname()}\0{endpoint}\0{os.getpid()}\0{time.time_ns()}"
    return hashlib.sha256(seed.encode()).hexdigest()[:16]
