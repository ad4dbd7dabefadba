"""Human-readable views: a broker's status, one task's verdict, the timing history.

Client side (``cpq-status``, ``cpq submit``); renders the plain dicts the broker sends and
the records :mod:`cpq.timings` reads. One duration formatter, :func:`fmt_duration`.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

from cpq.protocol import TaskResult

#: A status cell longer than this is cut (``--json`` keeps every value whole).
MAX_CELL = 60
#: Names listed in a line of the status before "+N more".
MAX_NAMES = 6


def cut(text: str, limit: int = MAX_CELL) -> str:
    """``text`` within ``limit`` characters, its cut marked (a whole PATH in a spec cell
    made one status 35 KB)."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def names(items: list[str], limit: int = MAX_NAMES) -> str:
    """A list of names summarised: the first few, then how many more."""
    shown = ", ".join(items[:limit]) or "-"
    return shown + (f" +{len(items) - limit} more" if len(items) > limit else "")


def table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[str(c) for c in headers]] + [
        ["-" if c is None else str(c) for c in row] for row in rows
    ]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def fmt_duration(value: float | None) -> str:
    """A duration for a table cell: "-", "370ms", "2.41s", "3.5m", "2.1h"."""
    if value is None:
        return "-"
    if value < 1:
        return f"{value * 1000:.0f}ms"
    if value < 120:
        return f"{value:.2f}s"
    if value < 7200:
        return f"{value / 60:.1f}m"
    return f"{value / 3600:.1f}h"


def _per_rank(values: list[float] | None) -> str:
    return "/".join(f"{v:.0f}" for v in values or []) or "-"


def cpu_memory(broker: dict[str, Any]) -> str:
    """What CPU groups hold of ``--memory`` (an older broker says nothing)."""
    budget = broker.get("memory_mb") or 0
    if not budget:
        return ""
    return f"  CPU group memory: {broker.get('memory_used_mb', 0):.0f} of {budget:.0f} MB"


def render(status: dict[str, Any]) -> str:
    """The ``cpq-status`` screen: broker, groups, queues, clients, totals."""
    broker = status["broker"]
    totals = status["totals"]
    gpus = broker.get("gpus") or []
    free = broker.get("gpus_free") or []
    lines = [
        f"cpq-broker {broker['version']}  pid {broker['pid']}  {broker['endpoint']}  "
        f"up {fmt_duration(broker['uptime_s'])}" + ("  DRAINING" if broker.get("draining") else ""),
        f"GPUs: {','.join(gpus) or 'none'} ({len(gpus)} owned, {len(free)} free: "
        f"{','.join(free) or '-'})  max busy CPU ranks: {broker['max_ranks']}" + cpu_memory(broker),
        "",
    ]
    pools = status["pools"]
    if pools:
        rows = []
        for p in pools:
            task = p.get("task") or {}
            current = ""
            if task:
                deadline = (
                    f"/{fmt_duration(task.get('deadline_s'))}" if task.get("deadline_s") else ""
                )
                current = (
                    f"{task.get('test_id') or task.get('target')} "
                    f"({fmt_duration(task.get('elapsed_s'))}{deadline})"
                )
            elif p["state"] == "stopping" and p.get("stop_reason"):
                current = f"({cut(p['stop_reason'], 2 * MAX_CELL)})"
            cuda = p.get("cuda_mb") or []
            rows.append(
                [
                    p["id"],
                    cut(_spec(p)),
                    ",".join(p["gpus"]) or "-",
                    f"{p['state']} (spare)" if p.get("spare") else p["state"],
                    p["pid"],
                    fmt_duration(p["uptime_s"]),
                    p["tasks_done"],
                    fmt_duration(p.get("last_heartbeat_s")),
                    _per_rank(p.get("rss_mb")),
                    _per_rank(cuda) if any(cuda) else "-",
                    current,
                ]
            )
        lines.append(
            table(
                [
                    "group",
                    "spec",
                    "gpus",
                    "state",
                    "pid",
                    "up",
                    "tasks",
                    "hb",
                    "rss MB",
                    "cuda MB",
                    "running (elapsed/deadline)",
                ],
                rows,
            )
        )
        lines += _bound_env(pools)
    else:
        lines.append("no groups")
    lines.append("")
    lines.extend(_node_gpus(status))
    if status["queue"]:
        lines.append(
            table(
                ["queued spec", "depth", "oldest wait"],
                [[_spec(q), q["depth"], fmt_duration(q["oldest_wait_s"])] for q in status["queue"]],
            )
        )
        lines.append("")
    if status["clients"]:
        lines.append(
            table(
                ["client", "host", "pid", "worker", "in flight", "submitted"],
                [
                    [
                        c["name"],
                        c["host"],
                        c["pid"],
                        c["xdist_worker"] or "-",
                        c["in_flight"],
                        c["submitted"],
                    ]
                    for c in status["clients"]
                ],
            )
        )
        lines.append("")
    lines.append(
        # The broker's tasks, not pytest's tests: a rerun attempt is a task of its own, and
        # an xfailed test counts as skipped (a newcomer compared these with pytest's line).
        "totals (tasks; each attempt one): "
        + "  ".join(
            f"{k}={totals[k]}"
            for k in (
                "submitted",
                "passed",
                "failed",
                "skipped",
                "errors",
                "retries",
                "groups_started",
                "groups_recycled",
            )
            if k in totals
        )
    )
    return "\n".join(lines)


def _node_gpus(status: dict[str, Any]) -> list[str]:
    """Every GPU of the node and who leases it, then every broker's GPU wants."""
    lines: list[str] = []
    now = time.time()
    rows = []
    for g in status.get("gpus") or []:
        lease = g.get("lease", "?")
        if lease == "this broker":
            holder = f"group {g.get('group')} ({g.get('state')})"
        elif lease == "other broker":
            holder = (
                f"{g.get('user', '?')}@{g.get('host', '?')} pid {g.get('broker_pid', '?')} "
                f"group {g.get('group', '?')} ({g.get('state', '?')})"
            )
        else:
            holder = g.get("reason", "")
        since = g.get("since")
        ago = fmt_duration(now - since) if isinstance(since, int | float) else "-"
        rows.append([g.get("index") or "-", g.get("uuid"), lease, holder, ago])
    if rows:
        lines += [table(["gpu", "uuid", "lease", "holder", "since"], rows), ""]
    wants = [
        [
            w.get("who", "?") + (" (this broker)" if w.get("this_broker") else ""),
            w.get("spec", ""),
            w.get("need"),
            ",".join(w.get("gpus") or []) or "-",
            fmt_duration(now - w["since"]) if isinstance(w.get("since"), int | float) else "-",
        ]
        for w in status.get("wants") or []
    ]
    if wants:
        lines += [table(["GPU want of", "spec", "needs", "of GPUs", "waiting"], wants), ""]
    return lines


# --------------------------------------------------------------------------- Prometheus

#: Every state a group can be in, so ``cpq_groups{state=...}`` always has all four series
#: (a series that vanishes at 0 makes rates and alerts lie).
GROUP_STATES = ("starting", "idle", "busy", "stopping")


def _label(value: Any) -> str:
    text = str(value)
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _sample(name: str, value: float, labels: dict[str, Any] | None = None) -> str:
    inner = ",".join(f'{k}="{_label(v)}"' for k, v in (labels or {}).items())
    number = "NaN" if math.isnan(value) else repr(float(value))
    return f"{name}{{{inner}}} {number}" if inner else f"{name} {number}"


def render_prometheus_down() -> str:
    """What ``--prometheus`` prints when no broker answers, so alerts can fire on it."""
    return "# HELP cpq_up 1 while the broker answers.\n# TYPE cpq_up gauge\ncpq_up 0.0\n"


def render_prometheus(status: dict[str, Any]) -> str:
    """The status in Prometheus' text exposition format (version 0.0.4).

    Counters are the broker's totals since it started (they reset with the broker, which
    Prometheus' ``rate()`` handles); gauges are the moment's state. Written by hand so that
    cpq itself does not depend on ``prometheus_client`` (the tests parse it with that).
    """
    broker, totals = status["broker"], status["totals"]
    out: list[str] = []

    def family(name: str, kind: str, help_text: str, samples: list[str]) -> None:
        out.append(f"# HELP {name} {help_text}")
        out.append(f"# TYPE {name} {kind}")
        out.extend(samples)

    family("cpq_up", "gauge", "1 while the broker answers.", [_sample("cpq_up", 1)])
    family(
        "cpq_broker_info",
        "gauge",
        "The broker's version and endpoint (value 1).",
        [
            _sample(
                "cpq_broker_info",
                1,
                {
                    "version": broker["version"],
                    "protocol": broker.get("protocol", ""),
                    "endpoint": broker["endpoint"],
                    "pid": broker["pid"],
                },
            )
        ],
    )
    family(
        "cpq_uptime_seconds",
        "gauge",
        "Seconds since the broker started.",
        [_sample("cpq_uptime_seconds", broker["uptime_s"])],
    )
    family(
        "cpq_draining",
        "gauge",
        "1 while the broker drains (accepts no new tasks).",
        [_sample("cpq_draining", 1 if broker.get("draining") else 0)],
    )
    owned, free = len(broker.get("gpus") or []), len(broker.get("gpus_free") or [])
    family(
        "cpq_gpus",
        "gauge",
        "GPUs the broker owns, by whether a group holds them.",
        [
            _sample("cpq_gpus", free, {"state": "free"}),
            _sample("cpq_gpus", owned - free, {"state": "used"}),
        ],
    )
    family(
        "cpq_tasks_submitted_total",
        "counter",
        "Tasks submitted by clients.",
        [_sample("cpq_tasks_submitted_total", totals["submitted"])],
    )
    family(
        "cpq_tasks_total",
        "counter",
        "Finished tasks by outcome (rejected tasks count as error too).",
        [
            _sample("cpq_tasks_total", totals[key], {"outcome": outcome})
            for outcome, key in (
                ("passed", "passed"),
                ("failed", "failed"),
                ("skipped", "skipped"),
                ("error", "errors"),
            )
        ],
    )
    for name, key, help_text in (
        ("cpq_tasks_rejected_total", "rejected", "Tasks refused at submit."),
        ("cpq_retries_total", "retries", "Infra errors retried on a fresh group."),
        ("cpq_groups_started_total", "groups_started", "Worker groups started."),
        ("cpq_groups_failed_total", "groups_failed", "Groups that died or never came up."),
        ("cpq_groups_recycled_total", "groups_recycled", "Groups recycled (tasks or memory)."),
        ("cpq_group_start_seconds_total", "group_start_s", "Seconds spent starting groups."),
        ("cpq_malformed_messages_total", "malformed", "Messages dropped as malformed."),
        (
            "cpq_busy_silences_total",
            "busy_silences",
            "Ranks silent past liveness but computing (GIL held), so not declared dead.",
        ),
        (
            "cpq_timings_write_errors_total",
            "timings_write_errors",
            "Timing history lines that could not be written.",
        ),
    ):
        if key in totals:
            family(name, "counter", help_text, [_sample(name, totals[key])])
    pools = status["pools"]
    family(
        "cpq_groups",
        "gauge",
        "Worker groups by state.",
        [
            _sample("cpq_groups", sum(1 for p in pools if p["state"] == state), {"state": state})
            for state in GROUP_STATES
        ],
    )
    family(
        "cpq_group_tasks_done",
        "gauge",
        "Tasks a live group has served.",
        [
            _sample("cpq_group_tasks_done", p["tasks_done"], {"group": p["id"], "spec": p["spec"]})
            for p in pools
        ],
    )
    for name, key, help_text in (
        ("cpq_group_rss_bytes", "rss_mb", "Resident memory of each rank after its last task."),
        (
            "cpq_group_cuda_allocated_bytes",
            "cuda_mb",
            "torch.cuda.memory_allocated() of each rank after its last task.",
        ),
        (
            "cpq_group_cuda_reserved_bytes",
            "cuda_reserved_mb",
            "torch.cuda.memory_reserved() of each rank after its last task.",
        ),
    ):
        family(
            name,
            "gauge",
            help_text,
            [
                _sample(name, mb * 2**20, {"group": p["id"], "rank": rank})
                for p in pools
                for rank, mb in enumerate(p.get(key) or [])
            ],
        )
    family(
        "cpq_task_elapsed_seconds",
        "gauge",
        "How long each busy group's current task has run.",
        [
            _sample(
                "cpq_task_elapsed_seconds",
                p["task"]["elapsed_s"],
                {"group": p["id"], "test": p["task"]["test_id"] or p["task"]["target"]},
            )
            for p in pools
            if p.get("task")
        ],
    )
    family(
        "cpq_queue_depth",
        "gauge",
        "Queued tasks per pool spec.",
        [_sample("cpq_queue_depth", q["depth"], {"spec": q["spec"]}) for q in status["queue"]],
    )
    family(
        "cpq_queue_oldest_wait_seconds",
        "gauge",
        "How long the oldest queued task of each spec has waited.",
        [
            _sample("cpq_queue_oldest_wait_seconds", q["oldest_wait_s"], {"spec": q["spec"]})
            for q in status["queue"]
        ],
    )
    clients = status["clients"]
    family("cpq_clients", "gauge", "Connected clients.", [_sample("cpq_clients", len(clients))])
    family(
        "cpq_tasks_in_flight",
        "gauge",
        "Tasks submitted and not yet answered (queued or running).",
        [_sample("cpq_tasks_in_flight", sum(c["in_flight"] for c in clients))],
    )
    return "\n".join(out) + "\n"


def render_result(result: TaskResult) -> str:
    lines = [
        f"{result.outcome.upper()} in {result.duration_s * 1000:.1f} ms "
        f"on group {result.group_id or '-'}"
    ]
    if result.message:
        lines.append(result.message)
    lines.extend(result.notes)
    for rank in result.ranks:
        if rank.error is not None and rank.outcome != "passed":
            lines.append(f"--- rank {rank.rank}: {rank.outcome} ---")
            lines.append(rank.error.traceback or f"{rank.error.type}: {rank.error.message}")
        for stream in ("stdout", "stderr"):
            text = getattr(rank, stream)
            if text.strip():
                lines.append(f"--- rank {rank.rank} {stream} ---\n{text.rstrip()}")
    if result.value is not None:
        lines.append(f"value: {result.value!r}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- timings


def _spec(row: dict[str, Any]) -> str:
    """A spec's label and digest: two groups whose labels agree but whose roots, interpreter
    or start variables differ (so they cannot share tasks) are told apart."""
    return f"{row['spec']} #{row['spec_id']}" if row.get("spec_id") else str(row["spec"])


def _project(path: str) -> str:
    """A project's short name in tables: its directory's name (the path is in ``--json``)."""
    return os.path.basename(path.rstrip(os.sep)) or "-"


def _when(epoch: float | None) -> str:
    return "-" if epoch is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch))


def render_timings(summary: dict[str, Any], path: Path) -> str:
    """The ``cpq-status --timings`` screen: a per-test table, then the slowest runs."""
    if not summary["records"]:
        return f"no timing history in {path} (the broker writes one line per finished task)"
    tests = summary["tests"]
    lines = [
        f"timing history {path}: {summary['records']} tasks, {len(tests)} tests, "
        f"{_when(summary['first_at'])} .. {_when(summary['last_at'])}",
        "",
        table(
            ["project", "test", "runs", "fail", "infra", "retry", "p50", "p95", "max"],
            [
                [
                    _project(e.get("project", "")),
                    e["test"],
                    e["runs"],
                    e["failed"],
                    e["errors"],
                    e["retries"],
                    fmt_duration(e["p50_s"]),
                    fmt_duration(e["p95_s"]),
                    fmt_duration(e["max_s"]),
                ]
                for e in tests
            ],
        ),
    ]
    if any(e["errors"] for e in tests):  # cpq's outcome "error": pytest's word is "failed"
        lines.append(
            "infra: cpq's outcome 'error' (a deadline passed, a rank died, a group did not "
            "start); pytest reports each of them as a failed test"
        )
    if summary["slowest"]:
        lines += [
            "",
            f"{len(summary['slowest'])} slowest runs:",
            table(
                ["duration", "test", "outcome", "spec", "queued", "group", "finished"],
                [
                    [
                        fmt_duration(t["duration_s"]),
                        t["test_id"] or t["target"],
                        t["outcome"] + (f" (attempt {t['attempts']})" if t["retries"] else ""),
                        t["spec"],
                        fmt_duration(t["queue_s"]),
                        t["group_id"] or "-",
                        _when(t["finished_at"]),
                    ]
                    for t in summary["slowest"]
                ],
            ),
        ]
    return "\n".join(lines)


def _bound_env(pools: list[dict[str, Any]]) -> list[str]:
    """Which variables bind each group: read by imports during its tasks (a task with other
    values goes to a fresh group), and how many its start-up imports read (torch's own;
    names in ``--json``). Names only: values may be secrets."""
    lines = []
    for p in pools:
        at_start = set(p.get("start_bound_env") or [])
        by_tasks = [n for n in p.get("bound_env") or [] if n not in at_start]
        if by_tasks or at_start:
            read = f"{names(by_tasks)}; " if by_tasks else ""
            lines.append(f"  {p['id']}: {read}{len(at_start)} read while it started")
    if lines:  # said once: the names alone meant nothing to a newcomer
        heading = (
            "variables a group's imports read (the group keeps their values: "
            "a task with other values gets another group):"
        )
        lines.insert(0, heading)
    return lines
