"""Why a queued task still waits: the notice its client gets (docs/design.md, "Fidelity").

A test that waits for a group without a word looks like a hang in the test. After
``waiting_notice_s`` in the queue (and again every as long), the task's client hears why:
how many groups of its spec are busy or starting, how much room the node has, how many
tasks of the spec are queued. Only clients that said they read ``waiting`` get it.
"""

from __future__ import annotations

from cpq import protocol
from cpq.broker.model import Client, session_of
from cpq.broker.pools import Pools
from cpq.broker.tasks import Tasks
from cpq.protocol import PoolSpec


def due(
    tasks: Tasks, pools: Pools, clients: dict[bytes, Client], now: float, every: float
) -> list[tuple[bytes, protocol.Waiting]]:
    """The notices to send now, as ``(client identity, message)``; 0 ``every``: none."""
    if not every:
        return []
    out = []
    for task in tasks.queues:
        if now - max(task.first_queued_at, task.waiting_said_at) < every:
            continue
        task.waiting_said_at = now
        client = clients.get(task.client)
        if client is None or "task-waiting" not in client.features():
            continue
        own = session_of(task) if task.submit.own_groups else None
        text = why(task.spec, pools, tasks.queues.depth(task.spec), own, task.submit.fresh_group)
        out.append((task.client, protocol.Waiting(task.submit.task_id, text)))
    return out


def why(
    spec: PoolSpec, pools: Pools, queued: int, own_session: str | None = None, fresh: bool = False
) -> str:
    """``waiting for a ws2/gloo group (3fa2c1): 2 busy; 0 of 6 CPU ranks free; ...``

    For a task that wants groups of its own session (``own_session``), idle groups that
    served other sessions are named too: they are why it waits while groups look idle. A
    task that runs only on a group started for it (``fresh``) waits for that one."""
    live = pools.live(spec)
    if fresh:
        live = [g for g in live if g.state != "idle"]
        own_session = None
    states = [g.state for g in live]
    counts = ", ".join(f"{states.count(s)} {s}" for s in ("busy", "starting") if s in states)
    idle = sum(g.state == "idle" and own_session is None for g in live)
    if idle and not pools.room.uses_gpus(spec):  # ready, but its ranks find no free core
        waits = f"{idle} idle, waiting for cores"
        counts = f"{counts}, {waits}" if counts else waits
    if own_session is not None:
        others = sum(g.state == "idle" and not g.sessions <= {own_session} for g in live)
        if others:
            served = f"{others} idle but served other sessions (own groups asked)"
            counts = f"{counts}, {served}" if counts else served
    room = pools.room
    groups = pools.groups.values()
    if room.uses_gpus(spec):
        free = pools.free_gpus()
        text = f"{len(free)} of {len(room.gpus)} GPUs free"
        now = pools.clock.monotonic()
        elsewhere = pools.leases.held_elsewhere(now) & set(free) if pools.leases else set()
        if elsewhere:  # free here, but leased by other brokers of the node
            text += f" ({len(elsewhere)} of them held by other brokers)"
    else:  # busy ranks cost cores, live ones memory (docs/design.md, "Placement")
        cpu = [g for g in groups if not room.uses_gpus(g.spec)]
        busy = sum(g.spec.world_size for g in cpu if g.state == "busy")
        held = pools.cpu_memory_mb()
        text = (
            f"{room.max_ranks - busy} of {room.max_ranks} CPU ranks free; "
            f"CPU groups hold {held:.0f} of {room.memory_mb:.0f} MB"
        )
    others = queued - 1
    besides = f"{others} other task(s) of this spec queued" if others else "none queued besides"
    group = f"a {spec.label()} group ({spec.digest()})"
    if fresh:
        group = f"a fresh {spec.label()} group ({spec.digest()}) started for it"
    return f"waiting for {group}: {counts or 'none yet'}; {text}; {besides}"
