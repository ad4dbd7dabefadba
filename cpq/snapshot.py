"""The status document: the one dict behind ``cpq-status``, ``--json`` and ``--prometheus``.

Built from the broker's live state on each request, so it is exact at that moment and costs
nothing between requests. Every field is plain msgpack data; :mod:`cpq.status` renders it.
Kept out of :mod:`cpq.broker` so the event loop reads as the event loop.
"""

from __future__ import annotations

import os
import socket
import time
from typing import TYPE_CHECKING, Any

from cpq import __version__, protocol
from cpq.autostart import code_fingerprint

if TYPE_CHECKING:
    from cpq.broker import Broker, Group


def describe(broker: Broker) -> dict[str, Any]:
    """The broker itself: identity, configuration, free resources (also sent in ``welcome``)."""
    return {
        "endpoint": broker.config.endpoint,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "version": __version__,
        "code": code_fingerprint(),  # which cpq code it runs (autostart replaces stale ones)
        "protocol": protocol.PROTOCOL_VERSION,
        "started_at": broker.started_at,
        "uptime_s": time.time() - broker.started_at,
        "gpus": broker.config.gpus,
        "gpus_free": broker.resources.free_gpus(),
        "max_ranks": broker.config.max_ranks,
        "heartbeat_s": broker.config.heartbeat_s,
        "liveness": broker.config.liveness,
        "log_dir": str(broker.config.log_dir),
        "draining": broker.draining,
        "idle_exit_s": broker.config.idle_exit_s,
        "default_timeout_s": broker.config.default_timeout_s,
        "max_tasks_per_group": broker.config.max_tasks_per_group,
        "max_rss_growth_mb": broker.config.max_rss_growth_mb,
        "timings_file": str(broker.config.timings_file or ""),
        "adaptive_timeout": broker.config.adaptive_timeout,
        "adaptive_k": broker.config.adaptive_k,
        "adaptive_floor_s": broker.config.adaptive_floor_s,
        "history_tests": len(broker.history.slowest),
    }


def status(broker: Broker) -> dict[str, Any]:
    """Everything: the broker, every group, the waiting queues, the clients, the totals."""
    now = time.monotonic()
    pools = [_pool(broker, group, now) for group in broker.groups.values()]
    queue = [
        {
            "spec": spec.label(),
            "world_size": spec.world_size,
            "depth": broker.queues.depth(spec),
            "oldest_wait_s": now - broker.queues.by_spec[spec].oldest(),
        }
        for spec in broker.queues.waiting_specs()
    ]
    clients = [
        {
            "id": c.identity.hex(),
            "host": c.info.get("host", ""),
            "pid": c.info.get("pid"),
            "name": c.info.get("name", ""),
            "xdist_worker": c.info.get("xdist_worker", ""),
            "in_flight": len(c.in_flight),
            "submitted": c.submitted,
            "last_seen_s": now - c.last_seen,
        }
        for c in broker.clients.values()
    ]
    return {
        "broker": describe(broker),
        "pools": pools,
        "queue": queue,
        "clients": clients,
        "totals": vars(broker.totals).copy(),
    }


def _pool(broker: Broker, group: Group, now: float) -> dict[str, Any]:
    """One group as cpq-status shows it."""
    task = group.task
    ws = group.spec.world_size
    return {
        "id": group.id,
        "spec": group.spec.label(),
        "world_size": group.spec.world_size,
        "backend": broker.resources.backend_for(group.spec),
        "env": dict(group.spec.env),
        "gpus": group.process.gpus,
        "state": group.state,
        "pid": group.process.pid,
        "rank_pids": sorted(group.process.rank_pids),
        "uptime_s": now - group.started_at,
        "ready_after_s": group.ready_after_s,
        "tasks_done": group.tasks_done,
        "rss_mb": [group.rss_mb.get(r, 0.0) for r in range(group.spec.world_size)],
        "last_heartbeat_s": max((now - r.last_seen for r in group.ranks.values()), default=None),
        "task": None
        if task is None
        else {
            "target": task.submit.target,
            "test_id": task.submit.test_id,
            "elapsed_s": now - task.started_at,
            "deadline_s": task.timeout_s,
            "deadline_note": task.deadline_note,
            "attempt": task.attempts,
        },
        "stop_reason": group.stop_reason,
        "python": group.spec.python,
        "roots": group.spec.roots,
        "cuda_mb": [group.cuda_mb.get(r, 0.0) for r in range(ws)],
        "cuda_reserved_mb": [group.cuda_reserved_mb.get(r, 0.0) for r in range(ws)],
        "rss_growth_mb": [
            group.rss_mb[r] - group.rss_ready_mb[r]
            if group.rss_ready_mb.get(r) and r in group.rss_mb
            else 0.0
            for r in range(ws)
        ],
    }
