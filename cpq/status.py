"""Human-readable views of a broker's status and of one task's verdict."""

from __future__ import annotations

from typing import Any

from cpq.protocol import TaskResult


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[str(c) for c in headers]] + [
        ["-" if c is None else str(c) for c in row] for row in rows
    ]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _secs(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 120:
        return f"{value:.1f}s"
    if value < 7200:
        return f"{value / 60:.1f}m"
    return f"{value / 3600:.1f}h"


def render(status: dict[str, Any]) -> str:
    broker = status["broker"]
    totals = status["totals"]
    gpus = broker.get("gpus") or []
    lines = [
        f"cpq-broker {broker['version']}  pid {broker['pid']}  {broker['endpoint']}  "
        f"up {_secs(broker['uptime_s'])}",
        f"GPUs: {','.join(gpus) or 'none'} (free: {','.join(broker.get('gpus_free') or []) or '-'})  "
        f"max CPU ranks: {broker['max_ranks']}" + ("  DRAINING" if broker.get("draining") else ""),
        "",
    ]
    pools = status["pools"]
    if pools:
        rows = []
        for p in pools:
            task = p.get("task") or {}
            current = (
                f"{task.get('test_id') or task.get('target')} ({_secs(task.get('elapsed_s'))})"
                if task
                else ""
            )
            rows.append(
                [
                    p["id"],
                    p["spec"],
                    ",".join(p["gpus"]) or "-",
                    p["state"],
                    p["pid"],
                    _secs(p["uptime_s"]),
                    p["tasks_done"],
                    _secs(p.get("last_heartbeat_s")),
                    "/".join(f"{m:.0f}" for m in p.get("rss_mb") or []) or "-",
                    current,
                ]
            )
        lines.append(
            _table(
                ["group", "spec", "gpus", "state", "pid", "up", "tasks", "hb", "rss MB", "running"],
                rows,
            )
        )
    else:
        lines.append("no groups")
    lines.append("")
    if status["queue"]:
        lines.append(
            _table(
                ["queued spec", "depth", "oldest wait"],
                [[q["spec"], q["depth"], _secs(q["oldest_wait_s"])] for q in status["queue"]],
            )
        )
        lines.append("")
    if status["clients"]:
        lines.append(
            _table(
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
        "totals: "
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
            )
        )
    )
    return "\n".join(lines)


def render_result(result: TaskResult) -> str:
    lines = [
        f"{result.outcome.upper()} in {result.duration_s * 1000:.1f} ms on group {result.group_id or '-'}"
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
