"""The durations file: one JSON object, test id -> seconds (and ``cpq:spawn:<spec>`` keys).

Why a flat JSON object: CI keeps it as a cache entry, an artifact or a committed file, and
people read and diff it; one object of numbers is the least a reader (or a shard computing
its share) can get wrong. Written atomically (temporary file, then rename), so a shard never
reads half a file, and updated rather than replaced: tests that did not run this time keep
their recorded seconds.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

DEFAULT_PATH = Path(".cpq") / "durations.json"


class DurationsError(ValueError):
    """A durations file that cannot be read or is not an object of seconds."""


def load(path: Path, missing_ok: bool = True) -> dict[str, float]:
    """Read a durations file; ``{}`` for a missing one when ``missing_ok``."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if missing_ok:
            return {}
        raise DurationsError(f"{path}: no such file") from None
    except OSError as exc:
        raise DurationsError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DurationsError(f"{path}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise DurationsError(f"{path}: expected a JSON object of test id -> seconds")
    result: dict[str, float] = {}
    for key, value in data.items():
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value < 0
        ):
            raise DurationsError(f"{path}: {key!r} has {value!r}, not a number of seconds >= 0")
        result[key] = float(value)
    return result


def umask() -> int:
    """This process's umask, read without changing it (``/proc``; else set and put back)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_json_atomic(path: Path, value: object) -> None:
    """Write ``value`` as JSON to ``path`` through a temporary file and a rename.

    The file gets the mode any file the user creates gets (``0o666`` less the umask), like
    the JUnit and timeline files beside it: a temporary file is private (0600), and a
    teammate reading a run on shared storage must not find half of it unreadable.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~umask())
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(value, handle, indent=1, sort_keys=True)
            handle.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def update(path: Path, new: Mapping[str, float]) -> dict[str, float]:
    """Overlay ``new`` on the file at ``path`` (kept entries: tests that did not run)."""
    merged = load(path)
    merged.update({k: round(float(v), 4) for k, v in new.items()})
    write_json_atomic(path, merged)
    return merged
