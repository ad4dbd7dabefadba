"""The warnings summaries of two pytest logs, compared: which warnings one shows that the other
does not (a fresh run's against a cpq session's: the summary line's counts differed).

Usage: python3 tools/gpu/warnings_diff.py FRESH.log OTHER.log
A warning is keyed by its message line(s) and the tests (or "collection") it was raised in;
prints the counts per log and the keys whose counts differ.
"""

from __future__ import annotations

import collections
import re
import sys


def warnings_of(path: str) -> collections.Counter[str]:
    with open(path, errors="replace") as handle:
        text = handle.read()
    start = text.find("warnings summary")
    end = text.find("-- Docs: https://docs.pytest.org", start)
    counts: collections.Counter[str] = collections.Counter()
    if start < 0 or end < 0:
        return counts
    places: list[str] = []
    message: list[str] = []

    def flush() -> None:
        said = re.sub(r"0x[0-9a-f]+", "0x…", " ".join(message))[:200]
        for place in places:
            counts[f"{said} @ {place[:120]}"] += 1

    for line in text[text.index("\n", start) + 1 : end].splitlines():
        if not line.strip():
            continue
        if not line.startswith(" "):
            if message:  # a new entry's first place
                flush()
                places, message = [], []
            places.append(line.strip())
        else:
            message.append(line.strip())
    if message:
        flush()
    return counts


def main() -> int:
    fresh, other = warnings_of(sys.argv[1]), warnings_of(sys.argv[2])
    print(
        f"warning entries: {sys.argv[1]} {sum(fresh.values())}, {sys.argv[2]} {sum(other.values())}"
    )
    for key in sorted(set(fresh) | set(other)):
        if fresh[key] != other[key]:
            print(f"  {fresh[key]} / {other[key]}  {key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
