"""What cpq adds to each test of a session: the broker's dispatch-to-verdict time of a test
(the timing history, ``timings.jsonl``) less the test's own time in the session's JUnit file
(pytest's setup + call + teardown as the ranks measured them).

Usage: python tools/gpu/task_overhead.py TIMINGS.jsonl SESSION.xml [--since EPOCH_S]
Prints the count, median, p90 and max of the difference (ms), and the ten largest. A test
recorded more than once (a cold and a warm session in one history) counts by its last
record at or after ``--since``.
"""

from __future__ import annotations

import json
import statistics
import sys
import xml.etree.ElementTree as ET


def junit_times(path: str) -> dict[tuple[str, str], float]:
    times: dict[tuple[str, str], float] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        key = (case.get("classname", ""), case.get("name", ""))
        times[key] = times.get(key, 0.0) + float(case.get("time", "0") or 0)
    return times


def junit_key(nodeid: str) -> tuple[str, str]:
    """``a/b/test_x.py::TestC::test_d[p]`` → (``a.b.test_x.TestC``, ``test_d[p]``)."""
    path, *parts = nodeid.split("::")
    module = path[:-3] if path.endswith(".py") else path
    return (".".join([module.replace("/", "."), *parts[:-1]]), parts[-1] if parts else "")


def main(argv: list[str]) -> int:
    since = 0.0
    if "--since" in argv:
        i = argv.index("--since")
        since = float(argv[i + 1])
        argv = argv[:i] + argv[i + 2 :]
    if len(argv) != 2:
        print(__doc__)
        return 2
    broker: dict[tuple[str, str], float] = {}
    with open(argv[0]) as handle:
        for line in handle:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("test_id") and record.get("finished_at", 0) >= since:
                broker[junit_key(record["test_id"])] = float(record["duration_s"])
    own = junit_times(argv[1])
    extra = {key: (broker[key] - own[key]) * 1000 for key in own if key in broker}
    if not extra:
        print(f"no test of {argv[1]} in {argv[0]}")
        return 1
    values = sorted(extra.values())
    print(
        f"tests {len(values)}  cpq's time beyond the test's own (ms): median "
        f"{statistics.median(values):.1f}  p90 {values[int(0.9 * (len(values) - 1))]:.1f}  "
        f"max {values[-1]:.1f}  (own time median "
        f"{statistics.median(own[k] for k in extra) * 1000:.1f} ms)"
    )
    for key, ms in sorted(extra.items(), key=lambda kv: -kv[1])[:10]:
        print(f"  {ms:8.1f} ms  {key[0]}::{key[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
