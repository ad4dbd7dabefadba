"""The status document: the one dict behind ``cpq-status``, ``--json`` and ``--prometheus``.

Built from the broker's live state on each request, so it is exact at that moment and costs
nothing between requests. Every field is plain msgpack data; :mod:`cpq.client.render` renders it.
Kept out of :mod:`cpq.broker.loop` so the event loop reads as the event loop; it reads
the parts (config, pools, tasks, clients, totals) and imports nothing that imports it.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from cpq import __version__, protocol
from cpq.broker.clock import Clock
from cpq.broker.config import BrokerConfig
from cpq.broker.model import Client, Group, Totals
from cpq.broker.pools import Pools
from cpq.broker.tasks import Tasks
from cpq.lockfile import code_fingerprint


def describe(
    config: BrokerConfig, pools: Pools, tasks: Tasks, started_at: float, clock: Clock
) -> dict[str, Any]:
    """The broker itself: identity, configuration, free resources (also sent in ``welcome``)."""
    return {
        "endpoint": config.endpoint,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "version": __version__,
        "code": code_fingerprint(),  # which cpq code it runs (autostart replaces stale ones)
        "protocol": protocol.PROTOCOL_VERSION,
        "features": sorted(protocol.ALL_FEATURES),  # optional fields and kinds it reads
        "started_at": started_at,
        "uptime_s": clock.time() - started_at,
        "gpus": config.gpus,
        "gpus_free": pools.free_gpus(),
        "gpus_fake": config.fake_gpus,
        "gpu_leases": str(config.gpu_leases or ""),
        "gpu_yields": pools.sharing.yields if pools.sharing else 0,
        "max_ranks": config.max_ranks,
        "memory_mb": config.memory_mb,  # what CPU groups may hold (--memory)
        "memory_used_mb": pools.cpu_memory_mb(),
        "heartbeat_s": config.heartbeat_s,
        "liveness": config.liveness,
        "log_dir": str(config.log_dir),
        "draining": tasks.draining,
        "idle_exit_s": config.idle_exit_s,
        "default_timeout_s": config.default_timeout_s,
        "max_tasks_per_group": config.max_tasks_per_group,
        "max_rss_growth_mb": config.max_rss_growth_mb,
        "timings_file": str(config.timings_file or ""),
        "adaptive_timeout": config.adaptive_timeout,
        "adaptive_k": config.adaptive_k,
        "adaptive_floor_s": config.adaptive_floor_s,
        "history_tests": len(tasks.verdicts.history.slowest),
    }


def status(
    config: BrokerConfig,
    pools: Pools,
    tasks: Tasks,
    clients: dict[bytes, Client],
    totals: Totals,
    started_at: float,
    clock: Clock,
) -> dict[str, Any]:
    """Everything: the broker, every group, the waiting queues, the clients, the totals."""
    now = clock.monotonic()
    queues = tasks.queues
    queue = [
        {
            "spec": spec.label(),
            "spec_id": spec.digest(),
            "world_size": spec.world_size,
            "depth": queues.depth(spec),
            "oldest_wait_s": now - queues.by_spec[spec].oldest(),
        }
        for spec in queues.waiting_specs()
    ]
    client_rows = [
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
        for c in clients.values()
    ]
    return {
        "broker": describe(config, pools, tasks, started_at, clock),
        "pools": [_pool(pools, group, now) for group in pools.groups.values()],
        "queue": queue,
        "clients": client_rows,
        "totals": vars(totals).copy(),
        # Every GPU of the node and who leases it; the GPU wants of every broker.
        "gpus": pools.sharing.gpu_rows(pools.groups, config.gpus) if pools.sharing else [],
        "wants": pools.sharing.want_rows() if pools.sharing else [],
    }


def _pool(pools: Pools, group: Group, now: float) -> dict[str, Any]:
    """One group as cpq-status shows it."""
    task = group.task
    ws = group.spec.world_size
    return {
        "id": group.id,
        "spec": group.spec.label(),
        "spec_id": group.spec.digest(),
        "world_size": group.spec.world_size,
        "backend": pools.room.backend_for(group.spec),
        "env": dict(group.spec.env),  # the spec's variables only: never a task's
        "gpus": group.process.gpus,
        "state": group.state,
        "spare": group.spare,  # clean: has run no task yet (cpq.broker.placement.spares)
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
            "session": task.submit.session,  # a pytest session tells its own tasks apart
            "elapsed_s": now - task.started_at,
            "deadline_s": task.timeout_s,
            "deadline_note": task.deadline_note,
            "attempt": task.attempts,
        },
        "stop_reason": group.stop_reason,
        # Names only (values may be secrets): variables its imports read, which bind it.
        "bound_env": sorted(group.bound_env),
        "start_bound_env": sorted(group.start_bound_env),
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
