"""The steps of each session in a hook-time probe's log (``tools/gpu/hooktime.py``), as
written by ``tools/gpu/warm_wall.sh``: for every process of a session (the calling process,
the warm caller's fork or the prepared session, the rank), each hook's time in seconds from
the calling process's creation, and the session's wall end.

Usage: python tools/gpu/wall_steps.py HT.log
"""

from __future__ import annotations

import re
import sys

_LINE = re.compile(r"^(?P<t>[0-9.]+) pid=(?P<pid>\d+) ppid=\d+ (?P<what>.*)$")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__)
        return 2
    blocks: list[tuple[str, list[str]]] = []
    with open(argv[0], encoding="utf-8", errors="replace") as handle:
        text = handle.read().splitlines()
    for line in text:
        if line.startswith("=== session "):
            blocks.append((line[len("=== session ") :], []))
        elif blocks:
            blocks[-1][1].append(line)
    for name, lines in blocks:
        events: dict[str, list[tuple[float, str]]] = {}
        created: dict[str, float] = {}
        end = 0.0
        for line in lines:
            if line.startswith("=== wall "):
                end = float(line.split()[3])
                continue
            match = _LINE.match(line)
            if match is None:
                continue
            pid, when, what = match["pid"], float(match["t"]), match["what"]
            if "process created" in what:
                created.setdefault(pid, float(what.split("process created ")[1].split()[0]))
                what = "plugin imported"
            events.setdefault(pid, []).append((when, what))
        if not events:
            continue
        caller = next(iter(events))
        t0 = created.get(caller, events[caller][0][0])
        print(f"session {name}: wall {end - t0:.2f} s from the calling process's creation")
        for pid, said in events.items():
            born = f"created {created[pid] - t0:+.2f}" if pid in created else ""
            steps = ", ".join(f"{what} {when - t0:.2f}" for when, what in said)
            print(f"  pid {pid} ({born}): {steps}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
