"""Runs -> Chrome trace-event JSON (opens in https://ui.perfetto.dev and chrome://tracing).

The format is Chrome's "Trace Event Format" (the JSON object form, ``traceEvents``), the
one PyTorch's profiler writes. Layout:

* a process per run (one broker's history; a shard of a fan-out run), named after it;
* in it a thread (track) per group, named by id, spec and GPUs, ordered by spawn: a
  ``spawn`` slice (asked for -> ready), a slice per task named by its test id (category
  ``warm-up`` for the first task on a fresh group, where imports and first collectives
  are paid), a ``stopping`` slice (stop -> processes reaped) after an instant saying why;
* a track per client (an xdist worker) with a ``wait`` slice per task (queued ->
  dispatched), and a flow arrow from each wait to the task's slice on its group;
* counters ``queued tasks`` and ``busy ranks``.

Timestamps are microseconds from the earliest window start of all runs, so the shards of
one fan-out run share an axis; ``otherData.t0_epoch_s`` says when that was.
"""

from __future__ import annotations

from typing import Any

from cpq.timeline.layout import counters, group_slices, waits
from cpq.timeline.run import Run

#: Client tracks are numbered after every group track.
CLIENT_TID = 100_000


def build_trace(runs: list[Run]) -> dict[str, Any]:
    """The trace of ``runs`` (several: one process each, on one time axis)."""
    t0 = min((r.start for r in runs), default=0.0)
    events: list[dict[str, Any]] = []
    flow_id = 0

    def us(t: float) -> float:
        return round((t - t0) * 1e6, 1)

    for index, run in enumerate(runs):
        pid = index + 1
        events.append(_meta("process_name", pid, 0, run.source or "cpq broker"))
        events.append(_meta("process_sort_index", pid, 0, index, key="sort_index"))
        task_tid: dict[int, int] = {}  # id(attempt) -> the group track it ran on
        for n, group in enumerate(run.groups, start=1):
            events.append(_meta("thread_name", pid, n, group.label))
            events.append(_meta("thread_sort_index", pid, n, n, key="sort_index"))
            for s in group_slices(run, group):
                event: dict[str, Any] = {
                    "ph": "X",
                    "pid": pid,
                    "tid": n,
                    "ts": us(s.start),
                    "dur": us(s.end) - us(s.start),
                    "name": s.name,
                    "cat": s.kind,
                }
                if s.attempt is not None:
                    a = s.attempt
                    task_tid[id(a)] = n
                    event["args"] = {
                        "outcome": a.outcome,
                        "attempt": a.attempt,
                        "queue_wait_s": round(a.wait_s, 6),
                        "run_s": round(a.run_s, 6),
                        "group": group.id,
                        "spec": a.spec,
                        "client": a.client,
                        "session": a.session,
                        "first_task_on_group": a.first,
                    }
                elif s.kind == "spawn":
                    ready = group.ready - group.spawn if group.ready is not None else None
                    event["args"] = {"group": group.id, "spare": group.spare, "ready_s": ready}
                else:
                    event["args"] = {"reason": group.reason, "cause": group.cause}
                events.append(event)
            if group.stop is not None and run.start <= group.stop <= run.end:
                events.append(
                    {
                        "ph": "i",
                        "s": "t",
                        "pid": pid,
                        "tid": n,
                        "ts": us(group.stop),
                        "name": f"stop: {group.cause}",
                        "args": {"reason": group.reason},
                    }
                )
        tid = CLIENT_TID
        for client, client_lanes in waits(run).items():
            for lane_no, lane in enumerate(client_lanes):
                tid += 1
                suffix = f" #{lane_no + 1}" if lane_no else ""
                events.append(_meta("thread_name", pid, tid, f"waits · {client}{suffix}"))
                events.append(_meta("thread_sort_index", pid, tid, tid, key="sort_index"))
                for start, end, a in lane:
                    events.append(
                        {
                            "ph": "X",
                            "pid": pid,
                            "tid": tid,
                            "ts": us(start),
                            "dur": us(end) - us(start),
                            "name": a.test,
                            "cat": "wait",
                            "args": {"outcome": a.outcome, "attempt": a.attempt},
                        }
                    )
                    group_tid = task_tid.get(id(a))
                    if group_tid is None or a.started is None:
                        continue
                    flow_id += 1
                    flow = {"cat": "dispatch", "name": "dispatch", "id": flow_id, "pid": pid}
                    events.append({**flow, "ph": "s", "tid": tid, "ts": us(start)})
                    events.append(
                        {**flow, "ph": "f", "bp": "e", "tid": group_tid, "ts": us(a.started)}
                    )
        queued, busy = counters(run)
        for name, key, points in (("queued tasks", "tasks", queued), ("busy ranks", "ranks", busy)):
            events.extend(
                {"ph": "C", "pid": pid, "tid": 0, "ts": us(t), "name": name, "args": {key: value}}
                for t, value in points
            )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "generator": "cpq",
            "t0_epoch_s": t0,
            "runs": [r.source or "cpq broker" for r in runs],
        },
    }


def _meta(name: str, pid: int, tid: int, value: object, key: str = "name") -> dict[str, Any]:
    return {"ph": "M", "pid": pid, "tid": tid, "name": name, "args": {key: value}}
