"""Runs -> one self-contained HTML page: the timeline as SVG, and where the time went.

No script, no stylesheet or font fetched, nothing but this one file: CI systems keep it as
an artifact and it opens anywhere, offline. The picture is the trace's
(:mod:`cpq.timeline.layout`): a row per group (spawn grey, tasks coloured by outcome, the
first task on a fresh group hatched as its warm-up, the stop pale), a row per client's
waits, and the queued tasks and busy ranks over time; every slice says what it is on
hover. Under it the summary (:mod:`cpq.timeline.summary`) and every task in a table.
"""

from __future__ import annotations

from html import escape
from typing import Any

from cpq.timeline.layout import counters, group_slices, waits
from cpq.timeline.run import Run
from cpq.timeline.summary import summarize

LABEL_W, PLOT_W, ROW_H, GAP, AXIS_H, COUNTER_H = 330, 1100, 18, 4, 24, 36
COLORS = {
    "passed": "#43a047",
    "failed": "#e53935",
    "skipped": "#fdd835",
    "spawn": "#9e9e9e",
    "stopping": "#cfd8dc",
    "wait": "#90caf9",
}
OTHER = "#8e24aa"  # errors, retries, bounces
STEPS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600)

STYLE = """
body{font:13px/1.4 sans-serif;margin:16px;color:#222}
h1{font-size:18px;margin:0 0 4px} h2{font-size:15px;margin:18px 0 6px}
table{border-collapse:collapse;margin:4px 0} td,th{padding:2px 8px;border-bottom:1px solid #ddd;
text-align:left} td.n{text-align:right;font-variant-numeric:tabular-nums}
svg text{font:11px sans-serif} .legend span{display:inline-block;margin-right:14px}
.legend i{display:inline-block;width:12px;height:10px;margin-right:4px;vertical-align:middle}
"""


def _color(outcome: str) -> str:
    return COLORS.get(outcome, OTHER)


def _s(value: float) -> str:
    return f"{value:.2f}" if value < 100 else f"{value:.0f}"


def build_html(runs: list[Run], title: str = "cpq timeline") -> str:
    """The page for ``runs`` (several: the shards of one fan-out run, on one time axis)."""
    t0 = min((r.start for r in runs), default=0.0)
    t1 = max((r.end for r in runs), default=0.0)
    span = max(t1 - t0, 1e-3)
    svg = _svg(runs, t0, span)
    summary = summarize(runs)
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>{escape(title)}</title><style>{STYLE}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
        f"<p>{summary['tasks']} task attempts over {_s(span)} s on "
        f"{len(summary['groups'])} groups; outcomes: "
        + escape(", ".join(f"{k} {v}" for k, v in sorted(summary["outcomes"].items())))
        + "</p>",
        _legend(),
        svg,
        _summary_html(summary),
        _tasks_table(runs),
        "</body></html>",
    ]
    return "\n".join(parts)


def _legend() -> str:
    items = [(COLORS[k], k) for k in ("spawn", "passed", "failed", "skipped", "wait", "stopping")]
    items.append((OTHER, "error / retried"))
    spans = "".join(f"<span><i style='background:{c}'></i>{escape(n)}</span>" for c, n in items)
    warm = (
        "<span><i style='background:repeating-linear-gradient(45deg,"
        "#43a047 0 3px,#1b5e20 3px 5px)'></i>first task on a fresh group (its warm-up)</span>"
    )
    return f"<p class='legend'>{spans}{warm}</p>"


def _svg(runs: list[Run], t0: float, span: float) -> str:
    scale = PLOT_W / span

    def x(t: float) -> float:
        return round(LABEL_W + (t - t0) * scale, 2)

    body: list[str] = []
    y = AXIS_H
    for run in runs:
        if len(runs) > 1 or run.source:
            body.append(f"<text class='run' x='4' y='{y + 13}' font-weight='bold'>")
            body.append(f"{escape(run.source or 'cpq broker')}</text>")
            y += ROW_H + GAP
        for group in run.groups:
            body.append(
                f"<g class='group' data-group='{escape(group.id)}'>"
                f"<text x='4' y='{y + 13}'>{escape(group.label)}</text>"
            )
            for s in group_slices(run, group):
                a = s.attempt
                fill = _color(a.outcome) if a is not None else COLORS[s.kind]
                if a is not None:
                    tip = (
                        f"{a.test}\n{a.outcome}, ran {_s(a.run_s)} s, waited {_s(a.wait_s)} s, "
                        f"attempt {a.attempt}, group {group.id}"
                        + (", first task on this group (warm-up)" if a.first else "")
                    )
                    data = f" data-test='{escape(a.test, quote=True)}'"
                    cls = "task warm-up" if a.first else "task"
                else:
                    tip = f"{group.id} {s.name}: {_s(s.end - s.start)} s"
                    if s.kind == "stopping":
                        tip += f"\n{group.reason}"
                    data, cls = "", s.kind
                width = max(x(s.end) - x(s.start), 0.5)
                body.append(
                    f"<rect class='{cls}'{data} x='{x(s.start)}' y='{y}' width='{width:.2f}' "
                    f"height='{ROW_H}' fill='{fill}'><title>{escape(tip)}</title></rect>"
                )
                if a is not None and a.first:
                    body.append(
                        f"<rect x='{x(s.start)}' y='{y}' width='{width:.2f}' height='{ROW_H}' "
                        "fill='url(#hatch)' pointer-events='none'/>"
                    )
            body.append("</g>")
            y += ROW_H + GAP
        for client, client_lanes in waits(run).items():
            for lane in client_lanes:
                body.append(f"<text x='4' y='{y + 13}'>waits · {escape(client)}</text>")
                for start, end, a in lane:
                    tip = f"{a.test}\nwaited {_s(a.wait_s)} s ({a.outcome})"
                    body.append(
                        f"<rect class='wait' x='{x(start)}' y='{y + 3}' "
                        f"width='{max(x(end) - x(start), 0.5):.2f}' height='{ROW_H - 6}' "
                        f"fill='{COLORS['wait']}'><title>{escape(tip)}</title></rect>"
                    )
                y += ROW_H + GAP
        queued, busy = counters(run)
        for name, points in (("queued tasks", queued), ("busy ranks", busy)):
            body.append(_counter(name, points, x, y, run.end))
            y += COUNTER_H + GAP
    axis = _axis(t0, span, x, y)
    height = y + 4
    defs = (
        "<defs><pattern id='hatch' width='5' height='5' patternUnits='userSpaceOnUse' "
        "patternTransform='rotate(45)'><rect width='2' height='5' fill='rgba(0,0,0,0.35)'/>"
        "</pattern></defs>"
    )
    return (
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{LABEL_W + PLOT_W + 10}' "
        f"height='{height}' role='img' aria-label='timeline'>{defs}{axis}{''.join(body)}</svg>"
    )


def _counter(name: str, points: list[tuple[float, int]], x: Any, y: float, end: float) -> str:
    top = max((v for _, v in points), default=0) or 1
    coords: list[str] = []
    level = 0
    for t, value in points:
        coords.append(f"{x(t)},{y + COUNTER_H - level * COUNTER_H / top:.1f}")
        level = value
        coords.append(f"{x(t)},{y + COUNTER_H - level * COUNTER_H / top:.1f}")
    coords.append(f"{x(end)},{y + COUNTER_H - level * COUNTER_H / top:.1f}")
    return (
        f"<text x='4' y='{y + COUNTER_H / 2 + 4}'>{escape(name)} (max {top})</text>"
        f"<polyline class='counter' points='{' '.join(coords)}' fill='none' stroke='#1565c0'/>"
    )


def _axis(t0: float, span: float, x: Any, bottom: float) -> str:
    step = next((s for s in STEPS if span / s <= 12), STEPS[-1])
    out = []
    n = 0
    while n * step <= span + 1e-9:
        px = x(t0 + n * step)
        out.append(
            f"<line x1='{px}' y1='{AXIS_H - 4}' x2='{px}' y2='{bottom}' stroke='#eee'/>"
            f"<text x='{px + 2}' y='{AXIS_H - 8}'>{n * step:g} s</text>"
        )
        n += 1
    return "".join(out)


def _table(headers: list[str], rows: list[list[str]], numeric: set[int]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    lines = [
        "<tr>"
        + "".join(
            f"<td class='n'>{escape(c)}</td>" if i in numeric else f"<td>{escape(c)}</td>"
            for i, c in enumerate(row)
        )
        + "</tr>"
        for row in rows
    ]
    return f"<table><tr>{head}</tr>{''.join(lines)}</table>"


def _summary_html(summary: dict[str, Any]) -> str:
    groups = [
        [
            (g["run"] + " " if g["run"] else "") + g["label"],
            str(g["tasks"]),
            f"{g['busy_share'] * 100:.0f}%",
            _s(g["busy_s"]),
            _s(g["spawn_s"]),
            g["stopped"] or "-",
        ]
        for g in summary["groups"]
    ]
    out = [
        "<h2>Groups: busy share (task time / time ready)</h2>",
        _table(["group", "tasks", "busy", "busy s", "spawning s", "stopped"], groups, {1, 2, 3, 4}),
        "<h2>Seconds spent spawning, per spec</h2>",
        _table(["spec", "seconds"], [[k, _s(v)] for k, v in summary["spawning_s"].items()], {1}),
        "<h2>Waits (queued until dispatched), per spec</h2>",
        _table(
            ["spec", "tasks", "total s", "mean s", "max s"],
            [
                [k, str(w["tasks"]), _s(w["total_s"]), _s(w["mean_s"]), _s(w["max_s"])]
                for k, w in summary["waits"].items()
            ],
            {1, 2, 3, 4},
        ),
        "<h2>Slowest tests</h2>",
        _table(
            ["test", "ran s", "waited s", "outcome", "first on its group"],
            [
                [
                    s["test"],
                    _s(s["run_s"]),
                    _s(s["wait_s"]),
                    s["outcome"],
                    "yes" if s["first_task_on_group"] else "",
                ]
                for s in summary["slowest"]
            ],
            {1, 2},
        ),
        "<h2>Groups that sat idle (busy under 10% of their ready time)</h2>",
    ]
    idle = summary["idle"]
    if idle:
        out.append(
            _table(
                ["group", "ready s", "busy", "tasks"],
                [
                    [g["label"], _s(g["ready_s"]), f"{g['busy_share'] * 100:.0f}%", str(g["tasks"])]
                    for g in idle
                ],
                {1, 2, 3},
            )
        )
    else:
        out.append("<p>none</p>")
    warm = summary["warm_up"]
    if warm:
        out.append(
            f"<h2>Warm-up</h2><p>{warm['tests']} tests ran both as the first task on a fresh "
            f"group ({_s(warm['first_mean_s'])} s on average) and later on a warm group "
            f"({_s(warm['later_mean_s'])} s).</p>"
        )
    return "\n".join(out)


def _tasks_table(runs: list[Run]) -> str:
    rows = []
    for run in runs:
        for a in run.attempts:
            group = run.group(a.group)
            rows.append(
                [
                    run.source,
                    a.test,
                    a.outcome,
                    str(a.attempt),
                    group.id if group else "-",
                    _s(a.wait_s),
                    _s(a.run_s),
                    a.client,
                ]
            )
    headers = ["run", "test", "outcome", "attempt", "group", "waited s", "ran s", "client"]
    return f"<h2>Every task ({len(rows)})</h2>" + _table(headers, rows, {3, 5, 6})
